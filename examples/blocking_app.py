"""A blocking generator function whose time per piece varies: the executor-sizing example.

Each piece models what a synchronous engine does per output token: about 1 ms of Python
work that holds the GIL (sampling, detokenising), then a blocking call that releases it (a
card kernel, a remote call) of 5-25 ms, and one time in twenty a slow one of 60 ms. The
sleeps are drawn from a generator seeded by the request, so a run is reproducible.

Serve it and measure it (docs/apps.md walks through the results):

    cadence serve --app examples.blocking_app:generate --engine-threads 4
    cadence sweep --vary engine_threads=1,2,4,8 \\
        --serve-args "--app examples.blocking_app:generate" \\
        --concurrency 8 --requests 16 --max-tokens 24

or from Python, which is what running this file does:

    python examples/blocking_app.py --engine-threads 4 --port 50051
"""

from __future__ import annotations

import argparse
import random
import time
import zlib
from collections.abc import Iterator

import cadence

TEXT = "a steady stream of tokens, one piece at a time, from a blocking function. "
GIL_MS = 1.0
"""Python work per piece that holds the GIL."""
BLOCK_MS = (5.0, 25.0)
"""A piece's blocking call (GIL released): uniform in this range..."""
SLOW_MS, SLOW_SHARE = 60.0, 0.05
"""...except this share of pieces, which take SLOW_MS."""


def _hold_gil(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def generate(request: cadence.AppRequest, context: cadence.AppContext) -> Iterator[str]:
    """Yield the example text one character (one token) per piece, until max_tokens."""
    rng = random.Random(zlib.crc32(bytes(request.prompt_token_ids)) ^ request.seed)
    for i in range(request.max_tokens):
        if context.cancelled:  # cadence would stop us at the next piece anyway
            return
        _hold_gil(GIL_MS / 1e3)
        slow = rng.random() < SLOW_SHARE
        time.sleep((SLOW_MS if slow else rng.uniform(*BLOCK_MS)) / 1e3)
        yield TEXT[i % len(TEXT)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--devices", default="cpu:1")
    parser.add_argument("--port", type=int, default=50051)
    args = parser.parse_args()
    cadence.serve(
        generate, devices=args.devices, engine_threads=args.engine_threads, port=args.port
    )
