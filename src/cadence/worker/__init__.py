"""The worker: one process per card (or tensor-parallel group) running the batching loop."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

STARTER_PID_ENV = "CADENCE_STARTER_PID"
"""The process id of the front that started a worker (or front 0, a front): a child whose
parent is another process was orphaned before it could ask to die with its starter. Not
"parent is 1": in a container the front itself is process 1."""


def child_environment() -> dict[str, str]:
    """The environment of a worker or front this process starts: its own, and its pid."""
    return {**os.environ, STARTER_PID_ENV: str(os.getpid())}


def bind_to_starter() -> int | None:
    """Ask Linux to SIGTERM this process when its starter (the front) dies, so that none is
    orphaned; return the starter's pid, or None when it died before the request took effect
    (its parent is another process: it must exit at once)."""
    if sys.platform == "linux":
        pr_set_pdeathsig = 1
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        except OSError:
            pass
    parent = os.getppid()
    return None if parent != int(os.environ.get(STARTER_PID_ENV, parent)) else parent


def starter_gone(parent: int, wait_s: float = 0.5) -> bool:
    """The starter `parent` died. Its death reaches the child (PDEATHSIG) when the thread that
    started it exits, which can be before the kernel reparents the child: so this looks again
    for a moment before it takes the starter for alive."""
    deadline = time.monotonic() + wait_s
    while True:
        if os.getppid() != parent or process_gone(parent):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def process_gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by its parent counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True
