"""How worker processes are started: a small seam, local processes today.

A launcher turns a `WorkerSpec` into a running worker and gives back a handle to watch and
stop it. Workers only need the spec (addresses and engine config), so a launcher that
places them on other hosts (Ray, for instance) can replace `LocalLauncher` without
touching the transport or the front.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Protocol

import msgspec

from cadence.transport.messages import WorkerSpec


class WorkerHandle(Protocol):
    """A started worker."""

    index: int

    def exit_code(self) -> int | None:
        """None while it runs, its exit status once it has stopped."""

    def terminate(self) -> None:
        """Ask it to stop now."""

    def kill(self) -> None:
        """Stop it without asking."""

    def wait(self, timeout: float) -> int | None:
        """Wait up to `timeout` seconds for it to stop; its exit status, or None."""


class Launcher(Protocol):
    def launch(self, spec: WorkerSpec) -> WorkerHandle:
        """Start a worker for `spec`."""


class LocalProcess:
    """A worker running as a child process of the front."""

    def __init__(self, index: int, process: subprocess.Popen) -> None:
        self.index = index
        self.pid = process.pid
        self._process = process

    def exit_code(self) -> int | None:
        return self._process.poll()

    def terminate(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()

    def kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()

    def wait(self, timeout: float) -> int | None:
        try:
            return self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class LocalLauncher:
    """Starts each worker as `python -m cadence.worker SPEC` on this host.

    Workers get their own session, so a Ctrl-C at the terminal reaches only the front,
    which then stops them in order; they also die with the front if it is killed.
    """

    def launch(self, spec: WorkerSpec) -> LocalProcess:
        process = subprocess.Popen(
            [sys.executable, "-m", "cadence.worker", msgspec.json.encode(spec).decode()],
            start_new_session=True,
        )
        return LocalProcess(spec.index, process)
