"""`cadence bench`'s progress bar: requests finished (or time elapsed of --duration), on stderr.

The load processes only add one to a shared counter per finished request
(`loadgen.RequestCounter`); the bar reads the counter when rich redraws it, a few times a
second, in the bench's parent process, so the load pays nothing per chunk. The bar goes to
stderr, only when that is a terminal, and nothing of it reaches the result or --json.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from cadence.lab.load.processes import RequestCounter

_REDRAWS_PER_S = 4


def progress_wanted(no_progress: bool, stream: TextIO | None = None) -> bool:
    """A bar unless `--no-progress`, and only when `stream` (default stderr) is a terminal:
    never into a file or a pipe, where its redraws would be noise in a log."""
    if no_progress:
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class BenchProgress(Progress):
    """A bar of `counter`: finished requests out of `requests`, or else the time elapsed out
    of `duration_s`. Use as a context manager around the run; the bar is removed at its end
    (the summary follows). `console`: where to draw (default: stderr)."""

    def __init__(
        self,
        counter: RequestCounter,
        requests: int | None,
        duration_s: float | None,
        console: Console | None = None,
    ) -> None:
        self._counter = counter
        self._requests = requests
        self._duration_s = duration_s
        self._task = None
        # Set first: rich builds the first frame (and so polls) within its own __init__.
        super().__init__(
            TextColumn("cadence bench"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            transient=True,
            refresh_per_second=_REDRAWS_PER_S,
        )
        total = requests if requests is not None else duration_s
        self._task = self.add_task("load", total=total, status="connecting")

    def get_renderables(self):
        """Read the counter, then draw: rich's refresh thread calls this a few times a
        second, so no thread of ours polls the counter."""
        self.poll()
        yield from super().get_renderables()

    def poll(self) -> None:
        """Bring the bar up to date with the counter."""
        started = self._counter.started_ns
        if started is None or self._task is None:
            return  # the load processes are still connecting and warming up
        done = self._counter.completed
        if self._requests is not None:
            self.update(self._task, completed=done, status=f"{done}/{self._requests} requests")
            return
        elapsed = max(0.0, (time.monotonic_ns() - started) / 1e9)
        duration = self._duration_s
        if duration is None:  # a run bounded only by its rate stages: no total to show
            self.update(self._task, status=f"{elapsed:.0f} s, {done} requests")
            return
        status = f"{min(elapsed, duration):.0f}/{duration:.0f} s, {done} requests"
        if elapsed > duration:  # no new requests; the open ones run to their end
            status += ", finishing"
        self.update(self._task, completed=min(elapsed, duration), status=status)
