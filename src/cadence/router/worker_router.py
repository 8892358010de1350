"""Chooses the worker for each request: the least outstanding work among live workers."""

from __future__ import annotations

import time


class NoWorkerAvailable(Exception):
    """Every worker has died."""


class WorkerRouter:
    """Tracks the outstanding work of each worker, in tokens still to generate at most.

    Work is counted when a request is assigned (its max_tokens) and released when it ends,
    however it ends. Ties go to the worker after the last one chosen, so equal requests
    spread evenly.
    """

    def __init__(self, workers: int) -> None:
        self.load = [0] * workers
        self.requests = [0] * workers
        self.alive = [True] * workers
        self.busy_since_ns = [0] * workers
        """When each worker last went from no request to one: the hang check's clock starts
        there, not at an output from before an idle spell."""
        self._next = 0

    def pick(self) -> int:
        """The live worker with the least outstanding work."""
        n = len(self.load)
        best = -1
        for k in range(n):
            i = (self._next + k) % n
            if self.alive[i] and (best < 0 or self.load[i] < self.load[best]):
                best = i
        if best < 0:
            raise NoWorkerAvailable("no worker is running")
        self._next = (best + 1) % n
        return best

    def assign(self, worker: int, work: int) -> None:
        if not self.requests[worker]:
            self.busy_since_ns[worker] = time.monotonic_ns()
        self.load[worker] += work
        self.requests[worker] += 1

    def release(self, worker: int, work: int) -> None:
        self.load[worker] -= work
        self.requests[worker] -= 1

    def mark_dead(self, worker: int) -> None:
        self.alive[worker] = False
