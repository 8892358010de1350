"""How late a load process's event loop ran what was due: the most its reads may lag.

A chunk is stamped when the process's loop gets to it, not when its bytes arrived. While
the loop is busy (a closed loop's wave of new requests being made and sent, many chunks
parsed at once) or the process waits for a core, every read due meanwhile is stamped late,
and the gap it ends looks longer than the server made it. `LoopLateness` ticks a timer every
PERIOD_S on the loop and keeps how late each tick ran: their distribution is the client's
read lag (`cadence.lab.analysis.noise_floor`), and the stretches where the loop ran late
(`stalls`) are what the lab's own client may have added to a gap that ended in one
(`cadence.lab.analysis.diagnosis.signatures.ClientStalls`).
"""

from __future__ import annotations

import asyncio
import time
from array import array

PERIOD_S = 0.005
"""Between ticks: 200 a second (their cost: docs/lab.md, the noise floor)."""
LATE_MS = 2.0
"""A tick this late or more was held up (a loop's timer otherwise runs up to a millisecond
late: epoll waits in whole milliseconds); its stretch is a stall."""
MOST = 500_000
"""Ticks kept at most (40 minutes); later ones are not measured."""


class LoopLateness:
    """The ticker of one load process, from `start` to `stop`."""

    def __init__(self) -> None:
        self.late_ms = array("f")
        """Each tick's lateness (ms)."""
        self.stalls: list[tuple[int, int]] = []
        """(from, to) of each stretch the loop ran late: the due time of its first late tick
        and the time its last late tick ran (time.monotonic_ns)."""
        self._task: asyncio.Task | None = None

    def start(self) -> LoopLateness:
        self._task = asyncio.ensure_future(self._tick())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _tick(self) -> None:
        period_ns, late_ns = int(PERIOD_S * 1e9), int(LATE_MS * 1e6)
        stalled = False
        while len(self.late_ms) < MOST:
            due = time.monotonic_ns() + period_ns
            await asyncio.sleep(PERIOD_S)
            ran = time.monotonic_ns()
            self.late_ms.append((ran - due) / 1e6)
            if ran - due < late_ns:
                stalled = False
            elif stalled:  # the same stretch, ticked through
                self.stalls[-1] = (self.stalls[-1][0], ran)
            else:
                self.stalls.append((due, ran))
                stalled = True
