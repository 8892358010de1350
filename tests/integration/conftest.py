"""Start real `cadence serve` processes on 127.0.0.1 and stop them, checking nothing is left."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import psutil
import pytest

from cadence.client import Client

_BANNER = re.compile(r"cadence serving on (\S+):(\d+)")
SERVE_ARGS = tuple(shlex.split(os.environ.get("CADENCE_TEST_SERVE_ARGS", "")))
"""Added to every server the tests start: `--grpc-server native` runs the gRPC tests that
use them against gRPC on Envoy (see .ci/run)."""

runs_once = pytest.mark.skipif(
    bool(SERVE_ARGS),
    reason="not run again on Envoy: what it checks is grpc.aio's own path, "
    "or no part of the gRPC server's (the workers, the command line)",
)
"""For a test in a module that runs again on Envoy (test_native_grpc's GRPC_MODULES) that is
not run there: it checks grpc.aio's own path (its metrics, its stall cut-off, its limits), or
what does not pass through the gRPC server at all, which the rerun would only repeat."""


@dataclass
class RunningServer:
    process: subprocess.Popen
    target: str
    workers: list[psutil.Process]
    front: psutil.Process | None = None
    """The process the front runs in: `process`, or its Envoy with --grpc-server native."""
    banner: str = ""
    """The server's first line: `cadence serving on HOST:PORT`, then `(http on ...)` and
    `(metrics on ...)` where it has those ports."""
    base: str = ""
    """The HTTP front's URL (`http://HOST:PORT`, https with a TLS context), with `http=True`."""
    metrics_url: str = ""
    """`http://HOST:PORT/metrics` of `--metrics-port`, when the server has one."""

    @property
    def pid(self) -> int:
        return self.process.pid

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(
    *args: str,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    stderr: int | None = None,
    http: bool = False,
    log: Path | None = None,
    tls_context: ssl.SSLContext | None = None,
    command: list[str] | None = None,
) -> RunningServer:
    """Run `cadence serve --port 0 ARGS` (and SERVE_ARGS) and return once health says SERVING.

    The one way the tests start a server; `with start_server(...) as server:` stops it.
    `http`: with `--http-port 0`, returned once its /health answers 200 too (`tls_context`:
    the client's TLS settings for a server with --tls-cert); `log`: the server's stderr goes
    to this file, which a failed start quotes; `command`: another program that prints the
    same banner (a reference server, or `cadence.serve` from Python), run as `COMMAND ARGS`.
    """
    if command is None:
        argv = [
            sys.executable,
            "-m",
            "cadence.cli",
            "serve",
            "--port",
            "0",
            *(("--http-port", "0") if http else ()),
            "--log-level",
            "WARNING",
            *args,
            *SERVE_ARGS,
        ]
    else:
        argv = [*command, *args]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=log.open("w") if log is not None else stderr,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + timeout
    line = process.stdout.readline()  # the banner comes after every worker is ready
    match = _BANNER.search(line)
    if not match:
        process.kill()
        said = log.read_text() if log is not None else ""
        raise RuntimeError(f"server did not start (exit {process.wait()}): {line!r} {said}")
    server = RunningServer(process, f"{match.group(1)}:{match.group(2)}", [], banner=line.strip())
    if address := re.search(r"\(http on (\S+)\)", line):
        server.base = f"{'http' if tls_context is None else 'https'}://{address.group(1)}"
    if address := re.search(r"\(metrics on (\S+)\)", line):
        server.metrics_url = f"http://{address.group(1)}/metrics"
    if command is None and "--tls-cert" not in args:  # a TLS server's health needs credentials
        with Client(server.target) as client:
            wait_until(
                lambda: client.health() == "SERVING",
                deadline - time.monotonic(),
                "server never became SERVING",
            )
    if server.base:
        wait_until(
            lambda: (
                process.poll() is None and _http_status(server.base + "/health", tls_context) == 200
            ),
            deadline - time.monotonic(),
            "the HTTP front never answered /health with 200",
        )
    children = psutil.Process(process.pid).children(recursive=True)
    envoy = [p for p in children if p.name() == "envoy"]
    server.workers = [p for p in children if p not in envoy]
    server.front = envoy[0] if envoy else psutil.Process(process.pid)
    return server


def serve_refused(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `cadence serve --port 0 ARGS` (`env`: variables added to ours), which should exit
    before it serves, and return its exit status and stderr.

    Its own start, not start_server's: there is no health to wait for. A server that starts
    anyway is stopped and reads as status 0 with stderr "it started", so that a test's
    `returncode != 0` fails at once instead of waiting out a timeout.
    """
    argv = [sys.executable, "-m", "cadence.cli", "serve", "--port", "0", *args]
    with tempfile.TemporaryFile("w+") as stderr:  # a file: a long log cannot fill a pipe
        process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, **(env or {})},
        )
        if process.stdout.readline().startswith("cadence serving on"):  # "": it exited
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=60)
            return subprocess.CompletedProcess(argv, 0, "", "it started")
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()  # as subprocess.run does
            raise
        stderr.seek(0)
        return subprocess.CompletedProcess(argv, process.returncode, "", stderr.read())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a server whose port a test
    must know before it starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_status(url: str, context: ssl.SSLContext | None) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def wait_until(
    predicate: Callable[[], object],
    timeout: float = 10.0,
    message: str = "condition not reached in time",
    interval: float = 0.05,
) -> None:
    """Poll `predicate` until it is true; fail with `message` once `timeout` seconds passed.

    Instead of a fixed sleep before an assertion: as short as the host allows, as long as a
    loaded host needs.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, message
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], object],
    timeout: float = 10.0,
    message: str = "condition not reached in time",
    interval: float = 0.05,
) -> None:
    """`wait_until` inside an event loop: `predicate` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        assert time.monotonic() < deadline, message
        await asyncio.sleep(interval)


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


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def importable_models() -> Iterator[None]:
    """Servers and their workers import test models (`tests.batched_models`,
    `tests.startup_models`) from the repository root: the root on PYTHONPATH and the working
    directory, for the module. A module whose every test needs it marks itself with
    `pytestmark = pytest.mark.usefixtures("importable_models")`."""
    with pytest.MonkeyPatch.context() as mp:
        path = [str(ROOT), os.environ.get("PYTHONPATH")]
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, path)))
        mp.chdir(ROOT)
        yield


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """A shared two-worker synthetic server with a short step."""
    running = start_server("--devices", "cpu:2", "--step-ms", "5")
    yield running
    assert running.stop() == 0


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


ALONE_MODULES = frozenset(
    {
        "test_diagnosis_planted",
        "test_disaggregation_diagnosis",
        "test_engine_shaped_diagnosis",
        "test_grpc_lab",
        "test_verdict",
        "test_bench_honest",
        "test_scrape",
        "test_capacity",
        "test_http_burst",
        "test_tracing",
        "test_ray_hosts",
    }
)
"""Modules whose tests run alone (`alone`), not beside another test: they judge latencies (the
lab's findings on planted and clean servers, capacity, the schedule, stop times), or start
Ray clusters on emulated hosts, which want the whole machine. A test of theirs that judges
none of that (a bad argument's one line, a refused call) is marked `shares_host` and runs in
the first stage beside the others."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in this folder is an integration test (`-m "not integration"` runs the rest);
    those of ALONE_MODULES are `alone` too, but for those marked `shares_host`."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.integration)
            if item.path.stem in ALONE_MODULES and not item.get_closest_marker("shares_host"):
                item.add_marker(pytest.mark.alone)
