"""The worker: one process per card (or tensor-parallel group) running the batching loop."""

from __future__ import annotations

import os

STARTER_PID_ENV = "CADENCE_STARTER_PID"
"""The process id of the front that started a worker (or front 0, a front): a child whose
parent is another process was orphaned before it could ask to die with its starter. Not
"parent is 1": in a container the front itself is process 1."""


def child_environment() -> dict[str, str]:
    """The environment of a worker or front this process starts: its own, and its pid."""
    return {**os.environ, STARTER_PID_ENV: str(os.getpid())}


def orphaned(parent: int) -> bool:
    """This process's starter died before the child asked to die with it: `parent` (the
    parent's id once that request is made) is not the starter."""
    return parent != int(os.environ.get(STARTER_PID_ENV, parent))
