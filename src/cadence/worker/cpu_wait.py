"""How long a worker's engine threads waited for a CPU, step by step (Linux; absent elsewhere).

Linux keeps, per thread, the time it spent runnable but not running, waiting in a run queue
for a CPU: the second field of /proc/<pid>/task/<tid>/schedstat (`run_delay`, ns; the first is
the time it ran). A thread that another job keeps off its core waits a scheduler slice there,
which a step that thread was running takes longer by, with no fault of the engine's.

The engine's threads are the step loop's own thread and the threads born while the engine
was built and warmed up (torch's intra-op pool, a user model's own threads): not the worker's
I/O threads (the transport's, the heartbeat's), which are born after, nor the threads of a
process the worker runs in (a Ray actor's), which were there before. Each thread's file stays
open and is read again from its start (`pread`), so a reading costs one system call per
thread and nothing else; a thread that has exited fails its read and is dropped.

A step's figure is the longest wait of any one of those threads since the previous step's
end: threads of one parallel region that wait at once delay the step once, which a sum would
count once per thread. The interval is from end to end, as a stream's gaps are, so a wait of
the loop between two steps (its sends and receives) counts with the step that follows.
"""

from __future__ import annotations

import os
import threading

ABSENT = -1
"""The wait of a step that was not measured (no /proc: not Linux, or not mounted)."""

_TASKS = "/proc/self/task"


def thread_ids() -> frozenset[int] | None:
    """This process's threads now (their kernel ids), or None without /proc."""
    try:
        return frozenset(int(tid) for tid in os.listdir(_TASKS))
    except OSError:
        return None


def _run_delay_ns(fd: int) -> int:
    """The thread's run_delay so far (raises OSError once the thread has exited)."""
    fields = os.pread(fd, 64, 0).split()
    if len(fields) < 2:
        raise OSError("schedstat without run_delay")
    return int(fields[1])


class CpuWait:
    """The engine's threads' wait for a CPU, read once per step (`since_last`)."""

    def __init__(self, tids: list[int]) -> None:
        """Watch the threads `tids` (those that exist: one that has exited is left out)."""
        self._fds: list[int] = []
        self._last: list[int] = []
        for tid in tids:
            try:
                fd = os.open(f"{_TASKS}/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                self._last.append(_run_delay_ns(fd))
            except (OSError, ValueError):
                os.close(fd)
                continue
            self._fds.append(fd)

    @classmethod
    def of_engine(cls, before: frozenset[int] | None) -> CpuWait | None:
        """The wait of the calling thread (the step loop's) and of the threads born since
        `before` (`thread_ids()` taken before the engine was built); None without /proc.
        Called once the engine has warmed up, before the worker starts its I/O threads."""
        now = thread_ids()
        if before is None or now is None:
            return None
        own = threading.get_native_id()
        waits = cls([own, *sorted(now - before - {own})])
        return waits if waits.threads else None

    @property
    def threads(self) -> int:
        """Threads watched now."""
        return len(self._fds)

    def since_last(self) -> int:
        """The longest wait for a CPU of any watched thread since the last call (ns), or
        ABSENT once no thread is left to read."""
        fds, last = self._fds, self._last
        longest = ABSENT
        gone = None
        for i, fd in enumerate(fds):
            try:
                delay = _run_delay_ns(fd)
            except (OSError, ValueError):  # the thread has exited
                gone = [*(gone or ()), i]
                continue
            if delay - last[i] > longest:
                longest = delay - last[i]
            last[i] = delay
        if gone:
            for i in reversed(gone):
                os.close(fds.pop(i))
                del last[i]
        return longest

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self._last.clear()
