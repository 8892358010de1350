"""A server cadence did not write, started from the user's command line, for `cadence sweep`.

`COMMAND` is a shell command with `{port}` (a free port on 127.0.0.1) and `{NAME}` (the
value of each variable) replaced; nothing else in it is touched, so JSON and shell braces
pass through. It runs in a process group of its own, so stopping it reaches whatever it
started (a shell, a wrapper script, a server with worker processes): SIGTERM to the whole
group, then SIGKILL to what is left after a grace period. Its output goes to a log file whose
last lines explain a server that exits or never gets ready.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from typing import Self

from cadence.credentials import ClientCredentials
from cadence.lab.servers.readiness import wait_ready


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def fill(command: str, values: dict[str, str]) -> str:
    """`command` with each `{name}` of `values` replaced by its value."""
    for name, value in values.items():
        command = command.replace("{" + name + "}", value)
    return command


class CommandServer:
    """Start `command` (filled with `values` and a free `port`), wait until it answers gRPC on
    127.0.0.1:port, and stop its whole process group on exit. `start` raises RuntimeError
    (one line, with the end of the server's output) when it exits or is not ready in time."""

    def __init__(
        self,
        command: str,
        values: dict[str, str],
        ready_timeout: float = 60.0,
        grace_s: float = 5.0,
        credentials: ClientCredentials | None = None,
    ) -> None:
        self.port = free_port()
        self.command = fill(command, {**values, "port": str(self.port)})
        self.target = f"127.0.0.1:{self.port}"
        self._ready_timeout = ready_timeout
        self._grace_s = grace_s
        self._credentials = credentials
        self._log = tempfile.TemporaryFile(mode="w+b")
        self.process: subprocess.Popen | None = None

    def start(self) -> str:
        self.process = subprocess.Popen(
            ["/bin/sh", "-c", self.command],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_ready(self.target, self._ready_timeout, self.process.poll, self._credentials)
        except RuntimeError as exc:
            self.stop(keep_log=True)
            message = f"{exc}{self._tail()}"
            self._log.close()
            raise RuntimeError(message) from None
        return self.target

    def _tail(self, lines: int = 3) -> str:
        self._log.seek(0)
        text = [
            line.strip()
            for line in self._log.read().decode(errors="replace").splitlines()
            if line.strip()
        ][-lines:]
        return f"; its last output: {' | '.join(text)}" if text else ""

    def stop(self, keep_log: bool = False) -> None:
        """SIGTERM to the command's process group, SIGKILL after the grace; idempotent."""
        if self.process is None:
            return
        group = self.process.pid  # start_new_session: the group's id is the leader's pid
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + self._grace_s
        while _group_alive(group, self.process) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _group_alive(group, self.process):
            _signal_group(group, signal.SIGKILL)
            deadline = time.monotonic() + 2.0  # killed processes are gone once reaped
            while _group_alive(group, self.process) and time.monotonic() < deadline:
                time.sleep(0.01)
        self.process.wait()
        if not keep_log:
            self._log.close()
        self.process = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _group_alive(group: int, leader: subprocess.Popen) -> bool:
    leader.poll()  # reaps the leader once it exits, so it does not count as alive
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
