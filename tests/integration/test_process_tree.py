"""Whatever part of a server dies first, the rest of its process tree stops within the drain
plus 5 s, the exit status says whether it failed, and nothing is left in TMPDIR."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

from cadence.client import Client
from tests.integration.conftest import SERVE_ARGS, RunningServer, start_server

DRAIN_S = 1.0


@pytest.fixture
def tree(tmp_path):
    """Start a server whose TMPDIR is a fresh folder; afterwards, nothing may be left in it."""
    started: list[tuple[RunningServer, list[psutil.Process]]] = []

    def start(*args: str) -> tuple[RunningServer, list[psutil.Process]]:
        server = start_server(
            "--drain-timeout",
            str(DRAIN_S),
            *args,
            env={**os.environ, "TMPDIR": str(tmp_path)},
            stderr=subprocess.PIPE,
        )
        started.append((server, psutil.Process(server.process.pid).children(recursive=True)))
        return started[-1]

    yield start
    for server, _ in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def _all_gone(processes: list[psutil.Process], within: float) -> None:
    _, alive = psutil.wait_procs(processes, timeout=within)
    assert not alive, f"still running after {within:.0f} s: {[p.pid for p in alive]}"


def _left_in(folder) -> list[str]:
    deadline = time.monotonic() + 2  # the last process out may still be removing
    while (
        left := sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _open_stream(server: RunningServer):
    """A stream that would run for minutes, its first chunk read."""
    client = Client(server.target)
    stream = client.generate("long", max_tokens=10_000)
    next(stream)
    return client, stream


@pytest.mark.parametrize("fronts", ["1", "2"])
def test_a_killed_serve_takes_its_tree_and_its_files(tree, tmp_path, fronts) -> None:
    server, processes = tree("--devices", "cpu:2", "--step-ms", "10", "--fronts", fronts)
    client, _stream = _open_stream(server)
    server.process.kill()
    server.process.wait(10)
    _all_gone(processes, DRAIN_S + 5)
    client.close()
    assert _left_in(tmp_path) == []


def _native_once() -> tuple[str, ...]:
    """The arguments of a native server, in the run without CADENCE_TEST_SERVE_ARGS only
    (they would repeat the same test in the run on Envoy)."""
    pytest.importorskip("pyvoy")
    if SERVE_ARGS:
        pytest.skip("runs in the default run, with --grpc-server native of its own")
    return ("--grpc-server", "native")


def _envoy(processes: list[psutil.Process]) -> psutil.Process:
    return next(p for p in processes if p.name() == "envoy")


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_envoy_stopping_on_its_own_is_a_failure(tree, tmp_path, how) -> None:
    """Envoy is the front's process with --grpc-server native: when it dies, or is stopped by
    anyone but `cadence serve` (its admin interface, which could tell it to quit, is reachable
    by no one: test_native_grpc), serving is over and the exit status says so."""
    server, processes = tree(*_native_once(), "--devices", "cpu:2", "--step-ms", "10")
    envoy = _envoy(processes)
    client, _stream = _open_stream(server)
    envoy.send_signal(getattr(signal, how))
    code = server.process.wait(DRAIN_S + 5)
    client.close()
    assert code != 0
    last = server.process.stderr.read().strip().splitlines()[-1]
    assert last.startswith("cadence serve: Envoy stopped while serving on"), last
    assert "Traceback" not in server.process.stderr.read()
    _all_gone(processes, 5)
    assert _left_in(tmp_path) == []


def test_a_signal_still_stops_native_with_status_0(tree, tmp_path) -> None:
    server, processes = tree(*_native_once(), "--devices", "cpu:1")
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(DRAIN_S + 5) == 0
    _all_gone(processes, 5)
    assert _left_in(tmp_path) == []
