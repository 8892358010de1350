"""Run a coroutine to completion on uvloop when it is installed, else on asyncio's own loop.

Every cadence process that runs an event loop (the front, its child fronts, app workers,
load-generating processes, `cadence.serve`) starts it here, so they all run on the same loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """`uvloop.run(coro)`, or `asyncio.run(coro)` without uvloop; returns the coroutine's result."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
