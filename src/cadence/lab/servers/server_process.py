"""Run `cadence serve` as a child process, for the demo, benchmarks and sweeps."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from typing import Self

_BANNER = re.compile(r"cadence serving on (\S+):(\d+)")


class ServerProcess:
    """A `cadence serve --port 0 ARGS` child; `target` is known once it is serving.

    Use as a context manager: leaving stops the server with SIGTERM (and its workers with it).
    """

    def __init__(
        self, *args: str, log_level: str = "WARNING", command: list[str] | None = None
    ) -> None:
        self.args = list(args)
        self._log_level = log_level
        self._command = command
        """Another server program that prints the same banner (a reference server)."""
        self.process: subprocess.Popen | None = None
        self.target = ""
        self.banner = ""
        """The server's first line: `cadence serving on HOST:PORT [(metrics on HOST:PORT)]`."""

    def start(self) -> str:
        """Start the server and return HOST:PORT once every worker is ready."""
        command = self._command or [
            sys.executable,
            "-m",
            "cadence.cli",
            "serve",
            "--log-level",
            self._log_level,
        ]
        self.process = subprocess.Popen(
            [*command, "--port", "0", *self.args],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None  # stdout=PIPE
        line = self.banner = self.process.stdout.readline().strip()
        match = _BANNER.search(line)
        if not match:
            code = self.process.wait()
            raise RuntimeError(
                f"cadence serve {' '.join(self.args)} did not start (exit status {code})"
            )
        self.target = f"{match.group(1)}:{match.group(2)}"
        return self.target

    @property
    def pid(self) -> int:
        return self.process.pid if self.process else 0

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
