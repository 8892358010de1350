"""The smallest useful apps: N tokens (N = max_tokens), a fixed delay before each.

The same token function as the PyTriton model that benchmarks/app_vs_pytriton.py drives, so
that it compares the servers and not the functions:

    cadence serve --app examples.token_app:async_tokens          # like PyTriton --mode async
    cadence serve --app examples.token_app:sync_tokens --engine-threads 32
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

from cadence.engines.app import AppContext, AppRequest

DELAY_S = 0.010
"""Time before each token."""


async def async_tokens(request: AppRequest, context: AppContext) -> AsyncIterator[list[int]]:
    """max_tokens tokens, each after `await asyncio.sleep(DELAY_S)`, on the worker's loop."""
    for i in range(request.max_tokens):
        await asyncio.sleep(DELAY_S)
        yield [i % 256]


def sync_tokens(request: AppRequest, context: AppContext) -> Iterator[list[int]]:
    """max_tokens tokens, each after a blocking `time.sleep(DELAY_S)`, on the executor."""
    for i in range(request.max_tokens):
        time.sleep(DELAY_S)
        yield [i % 256]
