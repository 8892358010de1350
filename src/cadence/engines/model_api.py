"""The declaration of a user's batched model: every member cadence looks up on it, in one place
(`cadence.Model`, `cadence.StepModel`; docs/models.md is the user's page), and the start-up
check that names a member that looks like a misspelling of one of them.

cadence.engines.user_model reads a model through these names only (`MEMBERS`); a member the
class leaves at `Model`'s default counts as absent, so subclassing `Model` costs nothing.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, Protocol, runtime_checkable

from cadence.engines.base import Sequence

Output = int | str | Exception | None
"""One sequence's output of a step: a token id, a text piece, an exception (that sequence
failed, `cadence.SequenceError` to name its status) or None (it is done)."""


@runtime_checkable
class StepModel(Protocol):
    """What `cadence serve --engine MODULE:CLASS` needs at least: `step` (or, instead,
    `generate_stream(batch)`; see `Model`). For type checkers; cadence itself does not
    require a class to name it."""

    def step(self, prefill: list[Sequence], decode: list[Sequence]) -> list[Output]: ...


class Model:
    """A batched model for `cadence serve --engine MODULE:CLASS` (or `cadence.serve(MyModel)`).

    Subclassing is optional: cadence looks these members up on any class. Subclassing gives
    each optional member its documented default, and a type checker and an editor the
    signatures. Defaults left as they are cost nothing (cadence treats them as absent).

    Quick start::

        import cadence

        class MyModel(cadence.Model):
            def __init__(self, device: str):             # cpu or cuda:N, one worker each
                self.weights = load(device)

            def step(self, prefill, decode):             # one output per sequence
                return [self.next_token(seq) for seq in prefill + decode]

            def release(self, seq):                      # finished, cancelled or failed
                self.free(seq.state)

        if __name__ == "__main__":
            cadence.serve(MyModel, devices="cuda:0,1", max_batch=64)

    Required, one of:

    - ``step(prefill, decode) -> list``: one output per sequence of ``prefill + decode``, in
      that order: an ``int`` token id, a ``str`` piece of text (one output whatever its
      length), ``None`` (the sequence is done: STOP) or an exception in place (that sequence
      alone fails: INTERNAL, or ``cadence.SequenceError(message, status=...)``'s status).
      An exception raised out of ``step`` fails every sequence of the step.
    - ``generate_stream(batch)``: a generator yielding, per step, one output per sequence of
      ``batch`` (the batch-generator shape; no request joins a running batch).

    Optional (defaults below):

    - ``reserve(seq) -> bool``: claim room (KV cache) just before ``seq`` is admitted; False
      keeps it waiting until running sequences are released. Default: always room.
    - ``release(seq)``: the sequence finished, was cancelled or failed: free ``seq.state``.
    - ``check(seq) -> str | None``: called when a request arrives; a string refuses it with
      INVALID_ARGUMENT and that message. Default: every request is accepted.
    - ``close()``: called once when the worker stops.
    - ``export_state(seq) -> bytes`` and ``import_state(seq, data) -> bool``: disaggregated
      serving (``--prefill-devices``, ``--decode-devices``). On a prefill worker, after the
      step that gave ``seq`` its first output, ``export_state`` returns everything the model
      holds for it (its KV cache, ...) as bytes, and then ``release(seq)`` is called. On a
      decode worker, ``import_state`` gets a new ``Sequence`` (``generated`` already counts
      the outputs given) and those bytes, and sets ``seq.state`` so that ``step`` can decode it
      from its next output; False (nothing taken) keeps it waiting for room. A model without
      both cannot be served disaggregated: its workers refuse to start.

    Configuration (class or instance attributes):

    - ``max_batch``: sequences per step at most, when below ``--max-batch``. Default: None.
    - ``tokenizer``: ``encode(text) -> list[int]`` and ``decode(ids) -> str`` (a Hugging Face
      tokenizer works as it is; ``stream(prompt_ids)`` if it decodes incrementally itself).
      Default None: prompts and int outputs are UTF-8 bytes.
    - ``takes_prefill_chunks``: True to be given long prompts in chunks under a step budget
      (``--max-step-tokens``, ``--itl-target-ms``). Default False.

    The constructor is called as ``cls(device)``, plus whichever of ``rank``,
    ``group_size``, ``worker``, ``model`` and ``dtype`` its signature names.

    A public member whose name is close to one of these (``relase``, ``max_batches``) is
    named on the server's stderr at start-up: cadence would never call it.
    """

    max_batch: int | None = None
    tokenizer: Any = None
    takes_prefill_chunks: bool = False

    def reserve(self, seq: Sequence) -> bool:
        return True

    def release(self, seq: Sequence) -> None:
        return None

    def check(self, seq: Sequence) -> str | None:
        return None

    def close(self) -> None:
        return None

    def export_state(self, seq: Sequence) -> bytes:
        raise NotImplementedError

    def import_state(self, seq: Sequence, data: bytes) -> bool:
        raise NotImplementedError

    OPTIONAL: ClassVar[tuple[str, ...]] = (
        "reserve",
        "release",
        "check",
        "close",
        "max_batch",
        "tokenizer",
        "takes_prefill_chunks",
        "export_state",
        "import_state",
    )
    """The optional members, each with its default above."""


MEMBERS = ("step", "generate_stream", *Model.OPTIONAL)
"""Every member cadence looks up on a user's model."""


def member(model: object, name: str) -> Any:
    """The model's `name` (one of MEMBERS), or None where it has none or keeps `Model`'s
    default (a default is the same as no member: nothing to call)."""
    value = getattr(model, name, None)
    if value is None or not isinstance(model, Model):
        return value
    if getattr(type(model), name, None) is getattr(Model, name) and name not in vars(model):
        return None
    return value


def _public_names(cls: type) -> Iterator[str]:
    """Names the class itself (and its bases, short of `Model` and object) defines."""
    for klass in cls.__mro__:
        if klass is object or klass is Model:
            continue
        yield from (name for name in vars(klass) if not name.startswith("_"))


def misspelled_members(cls: type, names: Iterable[str] | None = None) -> list[str]:
    """One line per public member of `cls` whose name looks like a misspelling of one of
    MEMBERS (`MyModel has \\`relase\\`: did you mean \\`release\\`?`)."""
    found = []
    for name in sorted(set(_public_names(cls) if names is None else names)):
        if name in MEMBERS:
            continue
        close = difflib.get_close_matches(name, MEMBERS, n=1, cutoff=0.8)
        if close:
            found.append(
                f"{cls.__qualname__} has `{name}`: did you mean `{close[0]}`? "
                "(cadence never calls it; see docs/models.md)"
            )
    return found
