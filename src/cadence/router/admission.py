"""Admission control: how many streams the server serves at once."""

from __future__ import annotations

import fcntl
import mmap
import os


class AdmissionGate:
    """At most `limit` streams at once; a request beyond that is refused at once.

    Refusing at once (RESOURCE_EXHAUSTED) rather than queueing keeps every wait bounded:
    a client that is refused knows immediately and can retry or go elsewhere, and time to
    first token never hides an unbounded queue.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {limit}")
        self.limit = limit
        self.active = 0

    def try_enter(self) -> bool:
        """Take a slot if one is free."""
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def leave(self) -> None:
        """Give a slot back; the next request can take it at once."""
        self.active -= 1


class SharedAdmissionGate:
    """`--fronts N`: one `--max-concurrent` for all front processes together.

    A small file in the fronts' private folder, mapped into every front, holds one count per
    front; each front changes only its own count, under an exclusive `flock` of the file, after
    checking the sum. `flock` is released by the kernel when a process dies, so a front killed
    mid-admission cannot wedge the others; front 0 zeroes a dead front's count (`clear`).
    Costs two system calls per admission and per release, never per token.
    """

    def __init__(self, path: str, front: int, fronts: int, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {limit}")
        self.limit = limit
        self.active = 0
        """This front's own streams."""
        self._front = front
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = 8 * fronts
        if os.fstat(self._fd).st_size < size:
            os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)
        self._counts = memoryview(self._map).cast("q")

    def _lock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def _unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def try_enter(self) -> bool:
        self._lock()
        try:
            if sum(self._counts) >= self.limit:
                return False
            self._counts[self._front] += 1
        finally:
            self._unlock()
        self.active += 1
        return True

    def leave(self) -> None:
        self._lock()
        try:
            self._counts[self._front] -= 1
        finally:
            self._unlock()
        self.active -= 1

    def clear(self, front: int) -> None:
        """Front `front` died: its streams hold no slots any more."""
        self._lock()
        try:
            self._counts[front] = 0
        finally:
            self._unlock()
