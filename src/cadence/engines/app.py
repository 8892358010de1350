"""The contract between cadence and a user's generator function (the `app` engine).

A user writes one function and cadence serves it:

    def generate(request: AppRequest, context: AppContext) -> Iterator[str | list[int]]
    async def generate(request: AppRequest, context: AppContext) -> AsyncIterator[str | list[int]]

Each yielded piece becomes output tokens: a `str` is encoded with the byte tokenizer (so
text round-trips exactly), a `list[int]` is token ids (bytes, 0..255). A function with its
own vocabulary brings its tokenizer as an attribute (`generate.tokenizer = tokenizer`, or
`tokenizer` on a callable object): prompts are then its token ids, `str` pieces its encoding,
and `list[int]` pieces any ids of its vocabulary, streamed as text by
cadence.engines.detokenizer. This module holds what the function sees (`AppRequest`, `AppContext`), how a
piece becomes tokens, and how a function is named so that a worker process can import it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from cadence.byte_tokenizer import ByteTokenizer
from cadence.engines.output_text import text_problem
from cadence.vocabulary import Sampling

Piece = str | list[int]
"""What a function yields: text, or token ids."""
App = Callable[["AppRequest", "AppContext"], Iterator[Piece] | AsyncIterator[Piece]]
"""A user's generator function, sync or async."""

VOCAB_SIZE = ByteTokenizer.vocab_size


@dataclass(frozen=True, slots=True)
class AppRequest:
    """One request, as the user's function sees it."""

    seq_id: int
    """The server's number for this request (unique within a server run)."""
    prompt: str
    """The prompt as text (the client's text, or its token ids decoded: by the function's
    tokenizer, else as UTF-8 bytes)."""
    prompt_token_ids: list[int]
    """The prompt's token ids: the tokenizer's (its encoding of a text prompt, or the
    client's ids), else UTF-8 bytes."""
    max_tokens: int
    """cadence stops the function once this many tokens were yielded (finish LENGTH)."""
    sampling: Sampling
    """The client's temperature, top_p, top_k, seed and stop token ids (cadence stops the
    function after a piece containing one of these, finish STOP)."""
    device: str
    """The device of the worker serving this request: `cpu` or `cuda:N`."""

    # `sampling`'s fields one by one, as functions have read them.

    @property
    def stop_token_ids(self) -> list[int]:
        """`sampling.stop_token_ids`, as a list."""
        return list(self.sampling.stop_token_ids)

    @property
    def temperature(self) -> float:
        """`sampling.temperature`; 0: greedy."""
        return self.sampling.temperature

    @property
    def top_p(self) -> float:
        """`sampling.top_p`."""
        return self.sampling.top_p

    @property
    def top_k(self) -> int:
        """`sampling.top_k`."""
        return self.sampling.top_k

    @property
    def seed(self) -> int:
        """`sampling.seed`."""
        return self.sampling.seed


@dataclass(slots=True)
class AppContext:
    """The request's context: where it runs, and whether it should stop.

    `cancelled` becomes true when the client cancels, the deadline passes or the server
    shuts down; cadence then stops the function at its next piece anyway, so checking it
    only lets a long piece stop early. `cancel_event` is a `threading.Event`, so a sync
    function can `wait()` on it from its executor thread.
    """

    device: str
    worker: int
    deadline: float | None = None
    """`time.monotonic()` at which the request's deadline passes, or None."""
    cancel_event: threading.Event = field(default_factory=threading.Event)

    @property
    def cancelled(self) -> bool:
        """True once the request was cancelled or its deadline passed."""
        return self.cancel_event.is_set()

    def time_remaining(self) -> float | None:
        """Seconds until the deadline (negative once past), or None without a deadline."""
        return None if self.deadline is None else self.deadline - time.monotonic()


class TokenizerFailed(Exception):
    """The function's own tokenizer raised in one of its methods (not a ValueError: the
    piece itself may be fine)."""

    def __init__(self, method: str, exc: Exception) -> None:
        super().__init__(f"tokenizer.{method} raised {type(exc).__name__}: {exc}")


def piece_tokens(
    piece: object,
    vocab_size: int | None = VOCAB_SIZE,
    encode: Callable[[str], list[int]] | None = None,
) -> list[int]:
    """The token ids of one yielded piece; TypeError/ValueError says what is wrong with it,
    TokenizerFailed that `encode` raised.

    Without a tokenizer (`encode` None) text is its UTF-8 bytes and ids are bytes; with one,
    text is `encode(piece)` and ids lie in its vocabulary (`vocab_size`, None: unchecked)."""
    if type(piece) is str:
        problem = text_problem(piece)
        if problem is not None:
            raise ValueError(f"the app yielded {problem}")
        if encode is None:
            return list(piece.encode("utf-8"))
        try:
            return encode(piece)
        except Exception as exc:
            raise TokenizerFailed("encode", exc) from exc
    if isinstance(piece, (list, tuple)):
        tokens = list(piece)
        if tokens and not (
            all(type(t) is int for t in tokens)
            and 0 <= min(tokens)
            and (vocab_size is None or max(tokens) < vocab_size)
        ):
            raise ValueError(
                f"the app yielded token ids {tokens[:8]!r}; ids must be ints in "
                + (
                    f"[0, {vocab_size}) (byte tokens); yield str pieces for text, or give the "
                    "function a `tokenizer`"
                    if encode is None
                    else f"[0, {vocab_size}) (its tokenizer's vocabulary)"
                    if vocab_size is not None
                    else "[0, ...) (not negative)"
                )
            )
        return tokens
    raise TypeError(
        f"the app yielded a {type(piece).__name__}; yield str (text) or list[int] (token ids)"
    )


def is_async_app(app: Callable) -> bool:
    """True for an `async def` function (async generator or coroutine function)."""
    if inspect.isasyncgenfunction(app) or inspect.iscoroutinefunction(app):
        return True
    call = getattr(type(app), "__call__", None)  # noqa: B004 - an object's `async def __call__`
    return inspect.isasyncgenfunction(call) or inspect.iscoroutinefunction(call)


def app_reference(app: Callable | type | str) -> str:
    """The name a worker process imports `app` (a function or a model class) by:
    `module:qualname`, or `file.py:qualname` for one defined in the script being run. Raises ValueError if it has none."""
    if isinstance(app, str):
        if ":" not in app:
            raise ValueError(f"app must be MODULE:FUNCTION, got {app!r}")
        return app
    module = getattr(app, "__module__", None)
    qualname = getattr(app, "__qualname__", None)
    in_front = "" if inspect.isclass(app) else ", or serve it with app_in_front=True"
    if not module or not qualname or "<" in qualname:
        raise ValueError(
            f"{app!r} cannot be imported by a worker process: define it at the top level of "
            f"a module{in_front}"
        )
    if module == "__main__":
        main = sys.modules["__main__"]
        spec = getattr(main, "__spec__", None)
        if spec is not None and spec.name and spec.name != "__main__":  # run with `python -m`
            return f"{spec.name}:{qualname}"
        path = getattr(main, "__file__", None)
        if not path:
            raise ValueError(
                f"{qualname} is defined in an interactive session; a worker process cannot "
                f"import it: put it in a module{in_front}"
            )
        module = os.path.abspath(path)
    return f"{module}:{qualname}"


_importing = False
"""True while load_app runs the user's module (see importing_app)."""


def importing_app() -> bool:
    """True while a worker imports the user's module: cadence.serve() called at import time
    (outside `if __name__ == "__main__":`) would otherwise start servers recursively."""
    return _importing


def load_app(reference: str) -> App:
    """Import the function named `module:qualname` (or `path/to/file.py:qualname`).

    The current directory is importable, as for `python -m`, so `cadence serve --app
    my_module:generate` finds `my_module.py` where it is run.
    """
    global _importing
    module_name, _, qualname = reference.rpartition(":")
    if not module_name or not qualname:
        raise ValueError(f"app must be MODULE:FUNCTION, got {reference!r}")
    _importing = True
    try:
        module = _import(module_name)
    finally:
        _importing = False
    target: object = module
    for part in qualname.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{reference} is a {type(target).__name__}, not a function")
    return target


def _import(module_name: str) -> object:
    if module_name.endswith(".py"):
        # A script: import it under another name, so its `if __name__ == "__main__":`
        # block (which may call cadence.serve) does not run again in the worker.
        spec = importlib.util.spec_from_file_location("__cadence_app__", module_name)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {module_name}")
        module = importlib.util.module_from_spec(spec)
        sys.modules["__cadence_app__"] = module
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(module_name)
