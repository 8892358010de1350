"""Start real `cadence serve` processes on 127.0.0.1 and stop them, checking nothing is left."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import pytest

from cadence.client import Client

_BANNER = re.compile(r"cadence serving on (\S+):(\d+)")
SERVE_ARGS = tuple(shlex.split(os.environ.get("CADENCE_TEST_SERVE_ARGS", "")))
"""Added to every server the tests start: `--grpc-server native` runs the gRPC tests that
use them against gRPC on Envoy (see .ci/run)."""

runs_once = pytest.mark.skipif(
    bool(SERVE_ARGS), reason="its server is started without CADENCE_TEST_SERVE_ARGS: the run "
    "on Envoy would repeat it as it is")
"""For a test in a module that runs again on Envoy whose server ignores SERVE_ARGS (the lab's
`ServerProcess`)."""


@dataclass
class RunningServer:
    process: subprocess.Popen
    target: str
    workers: list[psutil.Process]
    front: psutil.Process | None = None
    """The process the front runs in: `process`, or its Envoy with --grpc-server native."""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Signal the front and wait for it; assert that no worker outlives it."""
        workers = list(self.workers)
        if self.process.poll() is None:
            # Restarted workers too, not only those seen at start.
            with contextlib.suppress(psutil.Error):
                workers += psutil.Process(self.process.pid).children(recursive=True)
            self.process.send_signal(sig)
        code = self.process.wait(timeout)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers outlived the server: {[p.pid for p in alive]}"
        return code


def start_server(*args: str, timeout: float = 60.0, env: dict[str, str] | None = None,
                 stderr: int | None = None) -> RunningServer:
    """Run `cadence serve --port 0 ARGS` and return once health says SERVING."""
    process = subprocess.Popen(
        [sys.executable, "-m", "cadence.cli", "serve", "--port", "0", "--log-level", "WARNING", *args,
         *SERVE_ARGS],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + timeout
    line = process.stdout.readline()  # the banner comes after every worker is ready
    match = _BANNER.search(line)
    if not match:
        process.kill()
        raise RuntimeError(f"server did not start (exit {process.wait()}): {line!r}")
    target = f"{match.group(1)}:{match.group(2)}"
    with Client(target) as client:
        while client.health() != "SERVING":
            assert time.monotonic() < deadline, "server never became SERVING"
            time.sleep(0.05)
    children = psutil.Process(process.pid).children(recursive=True)
    envoy = [p for p in children if p.name() == "envoy"]
    workers = [p for p in children if p not in envoy]
    return RunningServer(process, target, workers, envoy[0] if envoy else psutil.Process(process.pid))


def live_workers(server: RunningServer) -> dict[int, psutil.Process]:
    """The server's worker processes now (replacements included, zombies not), by index."""
    found = {}
    for p in psutil.Process(server.process.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmdline = p.cmdline()
            if "cadence.worker" in cmdline and p.status() != psutil.STATUS_ZOMBIE:
                found[json.loads(cmdline[-1])["index"]] = p
    return found


@pytest.fixture
def server_factory() -> Iterator:
    started: list[RunningServer] = []

    def factory(*args: str) -> RunningServer:
        server = start_server(*args)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """A shared two-worker synthetic server with a short step."""
    running = start_server("--devices", "cpu:2", "--step-ms", "5")
    yield running
    assert running.stop() == 0


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
