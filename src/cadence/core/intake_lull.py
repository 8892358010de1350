"""A lull in the front's intake of new requests: a moment in which none opened.

A call's work that must come before its first chunk but not at once (the cadence.v1 adapter's
initial metadata, a gRPC operation of its own) waits for one: done while a burst of new calls
is still arriving, it slows the intake of every call behind; left for the first chunk, it
slows the first chunks, which a step hands out all at once. Between the two the front is idle
while the engine runs the step (results/serving_overhead_burst_ab.json).
"""

from __future__ import annotations

import asyncio

from cadence.core.stream import RequestStream

QUIET_S = 0.002
"""How long no request may open for the intake to count as lulled: many times the front's
time to take one call in, so that the short gaps inside a burst do not count."""


class IntakeLull:
    """Wakes the streams waiting for a lull once QUIET_S passes in which no request opened."""

    __slots__ = ("_checking", "_seen", "_waiting", "opened")

    def __init__(self) -> None:
        self.opened = 0
        """Calls to open so far (the core counts each one, refused or not)."""
        self._seen = 0
        self._waiting: dict[RequestStream, None] = {}
        self._checking = False

    async def wait(self, stream: RequestStream) -> None:
        """Return at the next lull, or sooner once `stream` has output or has ended."""
        self._waiting[stream] = None
        if not self._checking:
            self._checking = True
            self._look_again()
        try:
            await stream.wait()
        finally:
            # Never woken again once back: a later wake would end its wait for a chunk.
            self._waiting.pop(stream, None)

    def _look_again(self) -> None:
        self._seen = self.opened
        asyncio.get_running_loop().call_later(QUIET_S, self._check)

    def _check(self) -> None:
        if self.opened != self._seen:  # still taking requests in
            self._look_again()
            return
        self._checking = False
        waiting, self._waiting = self._waiting, {}
        for stream in waiting:
            stream.wake()
