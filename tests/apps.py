"""Generator functions that the app-engine tests serve (`cadence serve --app tests.apps:NAME`).

Worker processes import this module by name, so it must stay importable from the repository
root (the tests put the root on PYTHONPATH). Each function reads its instructions from the
prompt: `count N` yields N pieces; `fail` raises after two pieces; `block` blocks until
cancelled; `record PATH` appends what it sees of cancellation to PATH; `overlap N` yields N
pieces that each say how many pieces were running at once in the worker.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator

from cadence.engines.app import AppContext, AppRequest

_lock = threading.Lock()
_running = 0


def _count(request: AppRequest) -> int:
    words = request.prompt.split()
    return int(words[1]) if len(words) > 1 and words[0] in ("count", "overlap") else 10**6


def sync_app(request: AppRequest, context: AppContext) -> Iterator[str | list[int]]:
    """A blocking function: text pieces, token-id pieces, failures, blocking, cancellation."""
    words = request.prompt.split()
    if words and words[0] == "record":
        yield from _record(words[1], context)
        return
    if words and words[0] == "block":
        yield "blocked "
        # Holds its executor thread until the request is cancelled (or 60 s pass).
        context.cancel_event.wait(60)
        return
    if words and words[0] == "overlap":
        yield from overlap_app(request, context)
        return
    if words and words[0] == "multi":
        yield "héllo wörld "  # one piece, several tokens (and multi-byte characters)
        yield [65, 66, 67]
        return
    for i in range(_count(request)):
        if words and words[0] == "fail" and i == 2:
            raise ValueError("the app failed on purpose at piece 2")
        time.sleep(0.002)
        yield f"{i % 10}"


def _record(path: str, context: AppContext) -> Iterator[str]:
    # Stopped either inside the wait (it returns early) or at the yield (closed there):
    # either way the finally block runs, with the cancellation visible.
    try:
        while not context.cancelled:
            yield "."
            context.cancel_event.wait(0.01)
    finally:
        with open(path, "a") as f:
            f.write(f"closed cancelled={context.cancelled}\n")


async def async_app(request: AppRequest, context: AppContext) -> AsyncIterator[str]:
    """An async function: text pieces on the worker's event loop; records cancellation."""
    words = request.prompt.split()
    try:
        for i in range(_count(request)):
            if words and words[0] == "fail" and i == 2:
                raise RuntimeError("async app failed on purpose")
            await asyncio.sleep(0.002)
            yield f"{i % 10}"
    except asyncio.CancelledError:
        if words and words[0] == "record":
            with open(words[1], "a") as f:  # noqa: ASYNC230 - once, at cancellation
                f.write(f"cancelled context.cancelled={context.cancelled}\n")
        raise


def overlap_app(request: AppRequest, context: AppContext) -> Iterator[list[int]]:
    """Each piece is [the number of pieces running in this process when it started]: the
    evidence of how many executor threads run the function at once."""
    global _running
    for _ in range(_count(request)):
        with _lock:
            _running += 1
            seen = _running
        time.sleep(0.01)
        with _lock:
            _running -= 1
        yield [seen]


def pid_app(request: AppRequest, context: AppContext) -> Iterator[str]:
    """Yields the serving process's pid and device, to tell where the function runs."""
    yield f"{os.getpid()} {context.device} {request.device}"


_last_block = 0.0


async def loop_blocking_app(request: AppRequest, context: AppContext) -> AsyncIterator[str]:
    """One piece every 10 ms; every 0.3 s, whichever stream comes first blocks the event loop
    for 60 ms with a blocking call (a planted fault: user code that blocks the front's loop
    when run with --app-in-front)."""
    global _last_block
    for i in range(request.max_tokens):
        await asyncio.sleep(0.01)
        now = time.monotonic()
        if now - _last_block >= 0.3:
            _last_block = now
            time.sleep(0.06)  # noqa: ASYNC251 - the planted fault
        yield f"{i % 10}"


def bad_tokenizer_app(request: AppRequest, context: AppContext) -> Iterator[str | list[int]]:
    """With tests.batched_models' BadTokenizer: `encode-fails` yields "ENCODE-FAILS" as its
    third piece, `stream-raises`, `stream-surrogate` and `stream-huge` the ids [1], [2], [3];
    anything else: "0", "1", ... "9"."""
    third = {
        "encode-fails": "ENCODE-FAILS",
        "stream-raises": [1],
        "stream-surrogate": [2],
        "stream-huge": [3],
    }.get(request.prompt)
    for i in range(min(request.max_tokens, 10)):
        yield third if i == 2 and third is not None else [ord("0") + i]


def _bad_tokenizer():
    from tests.batched_models import BadTokenizer

    return BadTokenizer()


bad_tokenizer_app.tokenizer = _bad_tokenizer()


def stream_only_tokenizer_app(request: AppRequest, context: AppContext) -> Iterator[list[int]]:
    """With tests.batched_models' StreamOnlyTokenizer (encode and stream, no decode): the
    ids of "0", "1", ... "9"."""
    for i in range(min(request.max_tokens, 10)):
        yield [ord("0") + i]


def _stream_only_tokenizer():
    from tests.batched_models import StreamOnlyTokenizer

    return StreamOnlyTokenizer()


stream_only_tokenizer_app.tokenizer = _stream_only_tokenizer()
