"""Start-up from outside: health says SERVING exactly when a request would be admitted (gRPC
health, HTTP /health and KServe readiness alike), a worker lost during start-up fails the start
in one line, and a signal during start-up stops the server at once.

Workers load for as long as `tests/startup_models.py SlowLoadModel` is told, one time per
worker, so that one worker is ready while another still loads.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import psutil
import pytest

from cadence.client import Client
from cadence.proto.kserve import grpc_service_pb2 as kpb
from cadence.proto.kserve import grpc_service_pb2_grpc as kpb_grpc
from tests.integration.conftest import SERVE_ARGS, free_port, runs_once, wait_until
from tests.startup_models import LOAD_ENV

MODEL = "tests.startup_models:SlowLoadModel"


pytestmark = pytest.mark.usefixtures("importable_models")


@dataclass
class Starting:
    """A `cadence serve` still starting: its ports are known before its banner, its stderr
    is read as it comes (`lines`), and `banner` is set once it printed one."""

    process: subprocess.Popen
    port: int
    http_port: int
    lines: list[str] = field(default_factory=list)
    banner: threading.Event = field(default_factory=threading.Event)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def processes(self) -> list[psutil.Process]:
        """The server and every process under it now."""
        with contextlib.suppress(psutil.Error):
            front = psutil.Process(self.process.pid)
            return [front, *front.children(recursive=True)]
        return []

    def wait_line(self, pattern: str, timeout: float) -> re.Match:
        found: list[re.Match] = []

        def seen() -> bool:
            found.extend(m for line in list(self.lines) if (m := re.search(pattern, line)))
            return bool(found)

        wait_until(
            seen, timeout, f"no line {pattern!r} in the server's log: {self.lines}", interval=0.01
        )
        return found[0]


@contextlib.contextmanager
def starting(*args: str, loads: str) -> Iterator[Starting]:
    """`cadence serve --engine SlowLoadModel ARGS` with worker i loading `loads`'s i-th
    number of seconds; killed, with every process under it, on the way out."""
    port, http_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "cadence.cli",
        "serve",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--engine",
        MODEL,
        "--log-level",
        "INFO",
        "--startup-timeout",
        "120",
        *args,
        *SERVE_ARGS,
    ]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, LOAD_ENV: loads},
    )
    server = Starting(process, port, http_port)

    def read(stream, banner: bool) -> None:
        for line in stream:
            server.lines.append(line.rstrip())
            if banner and "cadence serving on" in line:
                server.banner.set()

    for stream, banner in ((process.stdout, True), (process.stderr, False)):
        threading.Thread(target=read, args=(stream, banner), daemon=True).start()
    try:
        yield server
    finally:
        for p in reversed(server.processes()):
            with contextlib.suppress(psutil.Error):
                p.kill()
        process.wait(30)


def _http_health(server: Starting) -> int:
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{server.http_port}/health", timeout=10
        ) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _grpc_health(client: Client, service: str = "") -> str:
    try:
        return client.health(service)
    except grpc.RpcError:
        return "NO_ANSWER"  # the port is not open yet


def _admitted(client: Client) -> bool:
    """Whether a request is taken now (False: refused with UNAVAILABLE)."""
    try:
        chunks = list(client.generate("hi", max_tokens=2, timeout=30))
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        return False
    assert chunks
    return True


def _server_ready(client: Client) -> bool:
    stub = kpb_grpc.GRPCInferenceServiceStub(client._channel)
    return stub.ServerReady(kpb.ServerReadyRequest(), timeout=10).ready


@pytest.mark.slow
def test_health_says_serving_exactly_while_requests_are_admitted() -> None:
    """Worker 0 ready in no time, worker 1 after 8 s: while worker 1 loads, the start is not
    over and requests are refused, so health (gRPC's, HTTP's, KServe's) says not serving;
    once the banner is out, all three say serving and requests are taken. Then worker 1 is
    killed: while it restarts (8 s of loading again) the server still serves on worker 0,
    and all three say so (one worker of several restarting takes no server out of a load
    balancer); `cadence.worker.1` tells the outage."""
    with starting("--devices", "cpu:2", loads="0 8") as server, Client(server.target) as client:
        samples = []  # (gRPC health, HTTP status, admitted), where health held across the call
        saw_loading = False
        deadline = time.monotonic() + 90
        while not (server.banner.is_set() and samples and samples[-1][2]):
            assert time.monotonic() < deadline, f"the server did not start: {server.lines}"
            assert server.process.poll() is None, server.lines
            before, http_before = _grpc_health(client), _http_health(server)
            loading = (
                _grpc_health(client, "cadence.worker.0") == "SERVING"
                and _grpc_health(client, "cadence.worker.1") == "NOT_SERVING"
            )
            if before == "NO_ANSWER":
                time.sleep(0.1)
                continue
            admitted = _admitted(client)
            if (_grpc_health(client), _http_health(server)) == (before, http_before):
                samples.append((before, http_before, admitted))
                saw_loading |= loading and not server.banner.is_set()
            time.sleep(0.1)
        assert saw_loading, "no sample while worker 0 was ready and worker 1 loading"
        for health, http, admitted in samples:
            assert (health == "SERVING") == admitted, (
                f"gRPC health {health} while requests were "
                f"{'admitted' if admitted else 'refused'}: {samples}"
            )
            assert (http == 200) == admitted, (
                f"HTTP /health {http} while requests were "
                f"{'admitted' if admitted else 'refused'}: {samples}"
            )
        assert _server_ready(client)

        # One worker of two down: the server still serves, and says so everywhere.
        pid = int(server.wait_line(r"worker 1 ready \(pid (\d+)", 10).group(1))
        os.kill(pid, signal.SIGKILL)
        wait_until(
            lambda: _grpc_health(client, "cadence.worker.1") == "NOT_SERVING",
            10,
            "cadence.worker.1 did not show the outage",
        )
        assert _grpc_health(client) == "SERVING"
        assert _http_health(server) == 200
        assert _server_ready(client)
        assert _admitted(client)
        assert _grpc_health(client, "cadence.worker.1") == "NOT_SERVING"  # still loading


@runs_once  # the workers and the start-up's order: no part of the gRPC server's
@pytest.mark.slow
@pytest.mark.parametrize("fronts", ["1", "2"])
def test_a_worker_lost_just_after_ready_is_restarted_or_fails_the_start(fronts: str) -> None:
    """Worker 1 is the last to report ready and is killed as soon as it has. Killed before
    the start is over (with --fronts 2, while front 0 starts the other front), the server
    exits non-zero within seconds with one line naming the worker; killed after (the
    supervisor watches by then), it is restarted and the server serves. Either way nothing
    is left behind, zombie or not, and the server never hangs in "starting"."""
    with starting("--devices", "cpu:2", "--fronts", fronts, loads="0 3") as server:
        pid = int(server.wait_line(r"worker 1 ready \(pid (\d+)", 90).group(1))
        os.kill(pid, signal.SIGKILL)
        everything = server.processes()
        wait_until(
            lambda: server.process.poll() is not None or server.banner.is_set(),
            20,
            f"20 s after worker 1 died the server neither serves nor exited: {server.lines}",
        )
        if server.process.poll() is not None:  # the start failed
            assert server.process.returncode != 0
            wait_until(lambda: server.lines and server.lines[-1].startswith("cadence serve:"), 5)
            assert re.fullmatch(
                r"cadence serve: worker 1 exited during start-up \(status -9\); "
                r"see its output above",
                server.lines[-1],
            ), server.lines
            _, alive = psutil.wait_procs(everything, timeout=10)
            assert not alive, f"left behind: {alive}"
            return
        with Client(server.target) as client:  # restarted: it serves, the dead one reaped
            wait_until(lambda: not psutil.pid_exists(pid), 10, "the dead worker was not reaped")
            wait_until(
                lambda: _grpc_health(client, "cadence.worker.1") == "SERVING",
                30,
                f"worker 1 was not restarted: {server.lines}",
            )
            assert _grpc_health(client) == "SERVING" and _admitted(client)
        everything = server.processes()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(20) == 0
        _, alive = psutil.wait_procs(everything, timeout=10)
        assert not alive, f"left behind: {alive}"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("fronts", ["1", "2"])
def test_a_signal_during_a_long_load_stops_the_server(fronts: str, sig: int) -> None:
    """Worker 1 loads for ten minutes; a SIGTERM (or Ctrl-C's SIGINT) meanwhile stops the
    server within the drain timeout + 5 s, exit status 0, nothing left."""
    drain = 2.0
    with starting(
        "--devices", "cpu:2", "--fronts", fronts, "--drain-timeout", str(drain), loads="0 600"
    ) as server:
        server.wait_line(r"worker 0 ready \(pid", 90)
        everything = server.processes()
        signalled = time.monotonic()
        server.process.send_signal(sig)
        try:
            code = server.process.wait(drain + 5)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the server still runs {drain + 5:g} s after the signal: {server.lines}"
            ) from None
        took = time.monotonic() - signalled
        assert code == 0, (code, server.lines)
        _, alive = psutil.wait_procs(everything, timeout=5)
        assert not alive, f"left behind after {took:.1f} s: {alive}"
        assert any("stopped by a signal during start-up" in line for line in server.lines), (
            server.lines
        )
