"""Admission, cancellation, deadlines, worker death and shutdown, on real processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request

import grpc
import psutil
import pytest

from cadence.client import Client, build_request
from cadence.proto.v1 import inference_pb2 as pb
from cadence.proto.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.conftest import (
    free_port,
    live_workers,
    runs_once,
    serve_refused,
    start_server,
    wait_until,
)

_SLOT_WAIT_S = 2.0
"""Upper bound for a freed slot to become usable: cancellation crosses the network."""


async def _open_stream(stub, prompt: str, max_tokens: int = 10_000, timeout=None):
    """Start a stream and read its first chunk; return the call, or the error code."""
    call = stub.Generate(build_request(prompt, max_tokens=max_tokens), timeout=timeout)
    try:
        await call.read()
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return call


async def _admit_within(stub, prompt: str, seconds: float):
    """Open a stream, retrying RESOURCE_EXHAUSTED until `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while True:
        result = await _open_stream(stub, prompt)
        if not isinstance(result, grpc.StatusCode):
            return result
        assert result == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() < deadline, "a cancelled stream's slot was not freed"
        await asyncio.sleep(0.01)


def test_cancelling_streams_frees_their_slots(server_factory) -> None:
    server = server_factory("--devices", "cpu:2", "--step-ms", "20", "--max-concurrent", "4")

    async def run() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            first = [await _open_stream(stub, f"a{i}") for i in range(4)]
            assert all(isinstance(c, grpc.aio.UnaryStreamCall) for c in first)
            # Beyond --max-concurrent: refused at once, not queued.
            t0 = time.monotonic()
            assert await _open_stream(stub, "too many") == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - t0 < 1.0
            for call in first:
                call.cancel()
            second = [await _admit_within(stub, f"b{i}", _SLOT_WAIT_S) for i in range(4)]
            # The new streams keep streaming: the cancelled ones left the workers' batches.
            for call in second:
                chunk = await call.read()
                assert chunk.index > 0
            assert await _open_stream(stub, "still full") == grpc.StatusCode.RESOURCE_EXHAUSTED
            for call in second:
                call.cancel()

    asyncio.run(run())


def test_deadline_ends_stream_and_frees_slot(server_factory) -> None:
    server = server_factory("--step-ms", "20", "--max-concurrent", "1")
    with Client(server.target) as client:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate("slow", max_tokens=10_000, timeout=0.3))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 5.0

    async def admitted() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            call = await _admit_within(pb_grpc.InferenceStub(channel), "next", _SLOT_WAIT_S)
            call.cancel()

    asyncio.run(admitted())


def test_killed_worker_fails_its_streams_and_others_go_on(server_factory) -> None:
    server = server_factory("--devices", "cpu:2", "--step-ms", "10")

    async def run() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            calls = [
                stub.Generate(build_request(f"p{i}", max_tokens=150, include_timing=True))
                for i in range(4)
            ]
            firsts = [await call.read() for call in calls]
            victim = firsts[0].timing.worker
            os.kill(server.workers[victim].pid, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await calls[0].read() is not grpc.aio.EOF:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"worker {victim}" in info.value.details()
            # While it is down, new requests go only to the worker that is left.
            chunks = [
                c
                async for c in stub.Generate(
                    build_request("after", max_tokens=3, include_timing=True)
                )
            ]
            assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert chunks[0].timing.worker != victim
            for call, first in zip(calls[1:], firsts[1:]):
                chunks = [first]
                try:
                    while (chunk := await call.read()) is not grpc.aio.EOF:
                        chunks.append(chunk)
                except grpc.aio.AioRpcError as exc:
                    assert first.timing.worker == victim
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                else:
                    assert first.timing.worker != victim
                    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
                    assert sum(len(c.token_ids) for c in chunks) == 150
            return victim

    victim = asyncio.run(run())
    # The worker is restarted; health shows the outage while it lasts.
    with Client(server.target) as client:
        assert client.health() == "SERVING"
        deadline = time.monotonic() + 20
        while client.health(f"cadence.worker.{victim}") != "SERVING":
            assert time.monotonic() < deadline, "the killed worker was not restarted"
            time.sleep(0.1)
        workers = {
            next(iter(client.generate(f"x{i}", max_tokens=1, include_timing=True))).timing.worker
            for i in range(8)
        }
    assert workers == {0, 1}


def test_silent_worker_is_stopped_and_restarted(server_factory) -> None:
    """A stopped process sends no heartbeat: noticed within the heartbeat timeout, with or
    without open requests."""
    server = server_factory("--devices", "cpu:2", "--step-ms", "10", "--heartbeat-timeout", "0.5")

    async def run() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            call = stub.Generate(build_request("hang", max_tokens=10_000, include_timing=True))
            first = await call.read()
            hung = psutil.Process(server.workers[first.timing.worker].pid)
            hung.suspend()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"worker {first.timing.worker} sent no heartbeat" in info.value.details()
            _, alive = psutil.wait_procs([hung], timeout=10)
            assert not alive

    asyncio.run(run())
    _wait_serving_workers(server.target, 2)


def test_hung_engine_is_stopped_and_restarted(server_factory) -> None:
    """A process that still beats but whose engine makes no step (a function blocked for
    good) is caught by --worker-timeout."""
    server = server_factory("--app", "tests.apps:sync_app", "--worker-timeout", "1.5")
    with Client(server.target) as client:
        stream = client.generate("block", max_tokens=100, timeout=30)
        next(stream)
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "worker 0 made no step" in info.value.details()
    _wait_serving_workers(server.target, 1)


@runs_once
def test_an_idle_spell_never_counts_against_the_next_prefill(server_factory) -> None:
    """The hang clock starts when the worker gets work, not at its last output before an
    idle spell: idle longer than --worker-timeout, then a prefill that takes most of it,
    served whole, twice."""
    server = server_factory(
        "--devices",
        "cpu:1",
        "--step-ms",
        "10",
        "--worker-timeout",
        "2",
        "--prefill-ms-per-token",
        "100",
    )
    prompt = "p" * 15  # 15 byte tokens: a 1.5 s prefill in one step
    with Client(server.target) as client:
        for _ in range(2):
            time.sleep(2.5)
            chunks = list(client.generate(prompt, max_tokens=4, timeout=30))
            assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert sum(len(c.token_ids) for c in chunks) == 4
    assert len(server.workers) == 1 and server.workers[0].is_running()


@runs_once
def test_a_restart_loop_backs_off_and_says_so(server_factory) -> None:
    """A worker that dies soon after each start is restarted after 1 s, then 2 s, then 4 s
    (not every second for ever), and the back-off is exported while it lasts."""
    port = free_port()
    server = server_factory("--devices", "cpu:1", "--step-ms", "10", "--metrics-port", str(port))
    seen: set[int] = set()
    gaps, killed = [], 0.0
    for restart in range(4):
        _wait_serving_workers(server.target, 1)
        worker = _new_worker(server, seen)
        if restart:
            gaps.append(time.monotonic() - killed)
        if restart == 3:
            break
        os.kill(worker.pid, signal.SIGKILL)
        killed = time.monotonic()
        if restart == 2:  # waiting out the third back-off: the gauge shows it

            def backoff_shown() -> bool:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return (
                        'cadence_worker_restart_backoff_seconds{worker="0"} 4.0'
                        in r.read().decode()
                    )

            wait_until(backoff_shown, 3.5, "the third back-off was not exported")
    assert 1.0 <= gaps[0] < 1.9 and 2.0 <= gaps[1] < 2.9 and 4.0 <= gaps[2] < 4.9, gaps
    with Client(server.target) as client:
        assert len(list(client.generate("back", max_tokens=3))) >= 1


def _new_worker(server, seen: set[int], timeout: float = 30.0) -> psutil.Process:
    """The server's one worker process not in `seen` (added to it)."""
    deadline = time.monotonic() + timeout
    while (worker := live_workers(server).get(0)) is None or worker.pid in seen:
        assert time.monotonic() < deadline, "no new worker process"
        time.sleep(0.02)
    seen.add(worker.pid)
    return worker


def _wait_serving_workers(target: str, workers: int, timeout: float = 30.0) -> None:
    """Until every worker's health says SERVING again (its replacement is ready)."""
    deadline = time.monotonic() + timeout
    with Client(target) as client:
        while not all(client.health(f"cadence.worker.{i}") == "SERVING" for i in range(workers)):
            assert time.monotonic() < deadline, "a replacement worker never became ready"
            time.sleep(0.1)


def test_sigterm_drains_open_streams_and_leaves_no_process(server_factory) -> None:
    server = server_factory("--devices", "cpu:2", "--step-ms", "20", "--drain-timeout", "1")
    with Client(server.target) as client:
        short = client.generate("short", max_tokens=20)
        long = client.generate("long", max_tokens=10_000)
        next(short), next(long)
        folder = _socket_folder(server)
        server.process.send_signal(signal.SIGTERM)
        # Draining: health says so at once, to every service a load balancer might watch.
        deadline = time.monotonic() + 5
        while client.health() != "NOT_SERVING":
            assert time.monotonic() < deadline, "health did not turn NOT_SERVING on SIGTERM"
            time.sleep(0.01)
        assert client.health("cadence.v1.Inference") == "NOT_SERVING"
        # A stream that can finish within the drain timeout finishes normally...
        assert list(short)[-1].finish_reason == pb.FINISH_REASON_LENGTH
        # ...new requests are refused...
        with pytest.raises(grpc.RpcError) as refused:
            list(client.generate("new", max_tokens=5))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # ...and the rest end with UNAVAILABLE once it has passed.
        with pytest.raises(grpc.RpcError) as ended:
            list(long)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shut down" in ended.value.details()
    assert server.stop() == 0
    assert not os.path.exists(folder)


def test_bad_settings_and_a_busy_port_fail_with_a_message(server_factory) -> None:
    server = server_factory()
    port = server.target.rsplit(":", 1)[1]
    for args, needle in [
        (["--port", port], "is the port in use"),
        (["--max-batch", "0"], "max_batch must be at least 1"),
        (["--devices", "gpu:1"], "--devices must be"),
    ]:
        out = serve_refused(*args)
        assert out.returncode != 0
        assert needle in out.stderr
        assert "Traceback" not in out.stderr


_WITHOUT = """
import sys
from importlib.abc import MetaPathFinder

class Hide(MetaPathFinder):  # as if these packages were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Hide())
from cadence.cli import main
main({args!r})
"""


@runs_once
@pytest.mark.parametrize(
    ("hidden", "args", "needle"),
    [
        (
            ["safetensors"],
            ["--engine", "torch", "--model", "tiny"],
            (
                "--engine torch needs the package 'safetensors', which is not installed; install it "
                "with: pip install 'cadence[torch]'"
            ),
        ),
        (
            ["ray"],
            ["--launcher", "ray"],
            (
                "--launcher ray needs the package 'ray', which is not installed; install it with: "
                "pip install 'cadence[ray]'"
            ),
        ),
        (
            ["opentelemetry"],
            ["--otlp-traces-endpoint", "http://127.0.0.1:4317"],
            (
                "--otlp-traces-endpoint needs the package 'opentelemetry.sdk', which is not installed; "
                "install it with: pip install 'cadence[otel]'"
            ),
        ),
    ],
)
def test_a_missing_extra_is_refused_at_once_in_one_line(hidden, args, needle) -> None:
    import subprocess
    import sys

    if "--engine" in args:  # the rest of the torch extra is there: only safetensors is missing
        pytest.importorskip("torch", reason="the torch extra: pip install 'cadence[torch]'")
    started = time.monotonic()
    code = _WITHOUT.format(hidden=hidden, args=["serve", "--port", "0", *args])
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == f"cadence serve: {needle}", out.stderr
    assert "Traceback" not in out.stderr and "worker" not in out.stderr
    assert time.monotonic() - started < 15


def test_killed_front_takes_its_workers_with_it(server_factory) -> None:
    server = server_factory("--devices", "cpu:2")
    folder = _socket_folder(server)
    server.process.kill()
    server.process.wait(10)
    _, alive = psutil.wait_procs(server.workers, timeout=10)
    assert not alive
    # The workers removed the dead front's sockets (with --grpc-server native the front in
    # Envoy outlives `cadence serve` for a moment: it stops its workers, then removes them).
    deadline = time.monotonic() + 5
    while os.path.exists(folder):
        assert time.monotonic() < deadline, f"{folder} outlived the front"
        time.sleep(0.02)


def _socket_folder(server) -> str:
    """The private folder of the server's ipc sockets, from a worker's spec."""
    spec = json.loads(server.workers[0].cmdline()[-1])
    folder = os.path.dirname(spec["output_address"][len("ipc://") :])
    assert os.path.isdir(folder)
    return folder


def test_worker_exits_when_the_front_falls_silent(server_factory) -> None:
    """A worker on another host gets no PDEATHSIG: it must leave on its own once the front's
    heartbeat stops (here the front is suspended; once resumed it restarts the workers)."""
    server = server_factory("--devices", "cpu:2", "--heartbeat-timeout", "0.5")
    front = server.front
    front.suspend()
    try:
        deadline = time.monotonic() + 10
        while not all(_exited(p) for p in server.workers):  # zombies: the front reaps them
            assert time.monotonic() < deadline, "a worker outlived its front's heartbeat"
            time.sleep(0.05)
    finally:
        front.resume()
    _wait_serving_workers(server.target, 2)
    with Client(server.target) as client:
        assert len(list(client.generate("again", max_tokens=5))) >= 1


def _exited(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_dead_worker_under_no_restart_is_said_once_and_the_rest_serve(tmp_path) -> None:
    """--no-restart: a worker that dies is failed and reported once, not again at every check
    of the supervisor (five times a second, forever), and the other worker serves."""
    log = tmp_path / "serve.log"
    server = start_server("--devices", "cpu:2", "--step-ms", "5", "--no-restart", log=log)
    try:
        os.kill(server.workers[1].pid, signal.SIGKILL)
        with Client(server.target) as client:
            deadline = time.monotonic() + 10
            while client.health("cadence.worker.1") != "NOT_SERVING":
                assert time.monotonic() < deadline, "the dead worker was not seen"
                time.sleep(0.05)
            time.sleep(1.5)  # several of the supervisor's checks
            assert client.health() == "SERVING"
            chunks = list(client.generate("after", max_tokens=3, include_timing=True))
            assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        server.stop()
    said = [line for line in log.read_text().splitlines() if "worker 1 stopped" in line]
    assert len(said) == 1, said
