"""`cadence serve --grpc-server native`: gRPC on Envoy's HTTP/2 through pyvoy, from outside.

What the rest of the gRPC tests check runs against it too (`.ci/run` runs them again with
CADENCE_TEST_SERVE_ARGS="--grpc-server native"); here, what only this path can get wrong:
a reset that must reach a stream that has sent nothing yet, what the ASGI layer refuses, and
the option it does not take.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cadence.client import Client
from cadence.lab.measure.run_context import run_context
from cadence.lab.report.summary import run_line
from cadence.proto.v1 import inference_pb2 as pb
from cadence.proto.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.conftest import serve_refused, start_server
from tests.integration.raw_h2 import framed, h2_call

pytestmark = pytest.mark.native
pytest.importorskip("pyvoy", reason="pyvoy is in the test extras (cadence[native])")

NATIVE = ("--grpc-server", "native")


def test_streams_whole_through_envoy(server_factory) -> None:
    server = server_factory(*NATIVE, "--devices", "cpu:2", "--step-ms", "5")
    assert server.front.name() == "envoy"
    with Client(server.target) as client:
        chunks = list(client.generate("hello", max_tokens=20, include_timing=True))
    # A stream that fell behind (a busy host) gets its waiting tokens in one message.
    assert [c.index for c in chunks] == list(
        itertools.accumulate([0] + [len(c.token_ids) for c in chunks[:-1]])
    )
    assert sum(len(c.token_ids) for c in chunks) == 20
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(c.timing.send_ns for c in chunks)
    # What `cadence bench` and `report` say of the server: `cadence serve`'s command line and
    # Envoy by name and role, not Envoy's command line (its whole generated config).
    run = run_context(datetime.now(UTC), server.front.pid)
    assert "serve" in run.server_cmdline and "--grpc-server" in run.server_cmdline
    assert not any("--config-yaml" in arg for arg in run.server_cmdline)
    assert run.server_process.startswith(f"envoy (pid {server.front.pid})")
    assert "port served by envoy" in run_line(run)


def test_a_reset_before_the_first_token_frees_the_slot_at_once(server_factory) -> None:
    """A stream in a long prefill (3 s here) sends nothing; when its client cancels, its
    admission slot must come free at once, not when its first token would have gone out."""
    server = server_factory(
        *NATIVE,
        "--devices",
        "cpu:1",
        "--step-ms",
        "5",
        "--prefill-ms-per-token",
        "30",
        "--max-concurrent",
        "1",
    )
    with grpc.insecure_channel(server.target) as channel:
        generate = pb_grpc.InferenceStub(channel).Generate
        slow = generate(pb.GenerateRequest(prompt="x" * 100, max_tokens=5))
        time.sleep(0.3)
        slow.cancel()
        cancelled = time.monotonic()
        while True:
            try:
                list(generate(pb.GenerateRequest(prompt="y", max_tokens=1), timeout=0.2))
                break
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    break  # admitted: it waits for the prefill step in progress
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            assert time.monotonic() - cancelled < 1.5, "the cancelled stream kept its slot"
    assert time.monotonic() - cancelled < 1.5


def test_what_the_asgi_layer_refuses_says_what_to_do(server_factory) -> None:
    server = server_factory(*NATIVE, "--devices", "cpu:1", "--step-ms", "5")
    with grpc.insecure_channel(server.target) as channel:
        unknown = channel.unary_unary("/cadence.v1.Inference/Nope")
        with pytest.raises(grpc.RpcError) as info:
            unknown(b"")
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        generate = pb_grpc.InferenceStub(channel).Generate
        for compression in (grpc.Compression.Gzip, grpc.Compression.Deflate):  # as grpc.aio reads
            chunks = generate(
                pb.GenerateRequest(prompt="hi", max_tokens=2), compression=compression
            )
            assert sum(len(c.token_ids) for c in chunks) == 2  # one message or two, merged
        bomb = pb.GenerateRequest(prompt="x" * (5 << 20), max_tokens=2)  # over 4 MiB inflated
        with pytest.raises(grpc.RpcError) as info:
            list(generate(bomb, compression=grpc.Compression.Gzip))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as info:
            list(generate(pb.GenerateRequest(prompt="hi", max_tokens=10**9)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-tokens-limit" in info.value.details()
    # A deadline ends with grpc.aio's status and words, not this layer's generic ones.
    got = h2_call(
        server.target,
        "/cadence.v1.Inference/Generate",
        [(b"grpc-timeout", b"300m")],
        framed(pb.GenerateRequest(prompt="hi", max_tokens=10_000)),
    )
    assert got.get(b"grpc-status") == b"4", got
    assert got[b"grpc-message"] == b"the request's deadline passed before generation finished"
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(f"http://{server.target}/", timeout=5)
    assert http.value.code == 415
    assert b"application/grpc" in http.value.read()


def test_ray_workers_are_refused_in_one_line() -> None:
    done = serve_refused(*NATIVE, "--launcher", "ray")
    assert done.returncode != 0
    assert "--grpc-server native runs local workers only" in done.stderr
    assert "Traceback" not in done.stderr


GRPC_MODULES = (
    "test_streaming.py",
    "test_kserve.py",
    "test_security.py",
    "test_lifecycle.py",
    "test_backpressure.py",
    "test_apps.py",
    "test_tracing.py",
    "test_fronts.py",
    "test_fronts_lab.py",
    "test_process_tree.py",
    "test_startup_health.py",
    "test_sick_workers.py",
)
"""The gRPC integration tests that run again with every server on Envoy (their tests whose
server would not be on Envoy are marked `runs_once`)."""


@pytest.mark.slow
@pytest.mark.timeout(660)  # the run below has its own limit (600 s), past pyproject's 180 s
@pytest.mark.parametrize("module", GRPC_MODULES)
def test_the_grpc_integration_tests_pass_on_envoy(module: str) -> None:
    """grpc.aio stays the default; this runs the tests of the gRPC path (cadence.v1, KServe,
    health, reflection, TLS, tokens, drain, cancellation, deadlines, backpressure, --fronts N)
    again with `--grpc-server native` added to every server they start, one module a test (so
    that `pytest -n` spreads them)."""
    here = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / module)],
        env={**os.environ, "CADENCE_TEST_SERVE_ARGS": " ".join(NATIVE)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=here.parents[1],
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    print(summary)
    assert done.returncode == 0, done.stdout[-6000:]


def test_a_grpc_js_client_reads_status_deadline_and_cancel(server_factory) -> None:
    """Node's own gRPC implementation (not the C core grpcio shares with grpc.aio) against the
    native path: messages in order, the status and its message from trailers, a deadline, a
    cancel."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    server = server_factory(*NATIVE, "--devices", "cpu:1", "--step-ms", "5")
    cases = [
        {
            "name": "ok",
            "request": pb.GenerateRequest(prompt="hi", max_tokens=5),
            "timeout_ms": 0,
            "cancel_after": 0,
        },
        {
            "name": "bad",
            "request": pb.GenerateRequest(prompt="hi", max_tokens=10**9),
            "timeout_ms": 0,
            "cancel_after": 0,
        },
        {
            "name": "deadline",
            "request": pb.GenerateRequest(prompt="hi", max_tokens=400),
            "timeout_ms": 300,
            "cancel_after": 0,
        },
        {
            "name": "cancel",
            "request": pb.GenerateRequest(prompt="hi", max_tokens=400),
            "timeout_ms": 0,
            "cancel_after": 2,
        },
    ]
    for case in cases:
        case["request_hex"] = case.pop("request").SerializeToString().hex()
    script = Path(__file__).parents[2] / "benchmarks" / "native_grpc_wire.js"
    done = subprocess.run(
        ["node", str(script), server.target, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    got = {r["name"]: r for r in map(json.loads, done.stdout.splitlines())}
    # Steps that reach the front together go out as one message: every token, in order.
    ok = [pb.GenerateChunk.FromString(bytes.fromhex(m)) for m in got["ok"]["messages_hex"]]
    assert got["ok"]["code"] == 0
    assert [c.index for c in ok] == list(
        itertools.accumulate([0] + [len(c.token_ids) for c in ok[:-1]])
    )
    assert sum(len(c.token_ids) for c in ok) == 5
    assert got["bad"]["code"] == 3 and "--max-tokens-limit" in got["bad"]["details"]
    assert got["deadline"]["code"] == 4
    assert got["deadline"]["ended_at_s"] - got["deadline"]["started_at_s"] < 1.0
    assert got["cancel"]["code"] == 1 and len(got["cancel"]["messages_hex"]) == 2


# --- bad input and stops (issue 35) -----------------------------------------------------------


def test_bad_client_bytes_end_the_call_in_one_status_and_log_nothing(tmp_path) -> None:
    """What a client sends that does not parse ends its call with one status and no traceback
    in the log (any client could flood it): a `-bin` header that is not base64 (INTERNAL in
    grpc.aio's words), a request message that does not parse on services whose handlers
    cadence does not write (INTERNAL, as grpc-go and grpc-java answer; grpc.aio answers UNKNOWN
    and logs a traceback), an empty or truncated body."""
    log = tmp_path / "server.log"
    server = start_server(
        *NATIVE, "--devices", "cpu:1", "--step-ms", "0", "--log-level", "INFO", log=log
    )
    try:
        request = framed(pb.GenerateRequest(prompt="hi", max_tokens=2))
        generate = "/cadence.v1.Inference/Generate"
        for value in (b"!!!notbase64", b"abcde", b"ab!c"):
            for _ in range(3):
                got = h2_call(server.target, generate, [(b"x-trace-bin", value)], request)
                assert got.get(b"grpc-status") == b"13", got
                assert got[b"grpc-message"] == (
                    b"Error parsing 'x-trace-bin' metadata: illegal base64 encoding"
                )
        for value in (b"YWJj", b"YQ==", b"YQ", b""):  # padded, unpadded, empty: served
            got = h2_call(server.target, generate, [(b"x-trace-bin", value)], request)
            assert got.get(b"grpc-status") == b"0", (value, got)
        for path in (
            "/grpc.health.v1.Health/Check",
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        ):
            got = h2_call(server.target, path, [], b"\0\0\0\0\3\xff\xff\xff")
            assert got.get(b"grpc-status") == b"13", got
            assert got[b"grpc-message"].startswith(b"could not parse the request message")
        for body in (b"", request[:-3]):
            got = h2_call(server.target, generate, [], body)
            assert got.get(b"grpc-status") == b"13", got
    finally:
        assert server.stop() == 0
    text = log.read_text()
    assert "Traceback" not in text
    # The stop's last line, as on grpc.aio: what was sent (a chunk per call served OK above).
    assert re.search(r"stopped: [1-9]\d* chunks, \d+ tokens", text), text[-2000:]


def test_a_stop_with_200_calls_open_ends_each_unavailable_in_one_log_line(tmp_path) -> None:
    """200 calls open at a stop, of the kinds the drain does not end: idle KServe streams (no
    request in flight) and health watches, beside streams in flight. Each ends UNAVAILABLE, as
    on grpc.aio, and the log says so once, with no traceback per call."""
    log = tmp_path / "server.log"
    server = start_server(
        *NATIVE,
        "--devices",
        "cpu:1",
        "--step-ms",
        "5",
        "--max-concurrent",
        "256",
        "--drain-timeout",
        "1",
        "--log-level",
        "INFO",
        log=log,
    )

    async def run() -> collections.Counter:
        kinds = [i % 3 for i in range(200)]
        idle_left = kinds.count(1)
        all_idle = asyncio.Event()

        async def idle():
            nonlocal idle_left
            idle_left -= 1
            if idle_left == 0:
                all_idle.set()
            await asyncio.sleep(3600)
            yield b""

        async with grpc.aio.insecure_channel(server.target) as channel:

            async def one(kind: int) -> str:
                try:
                    if kind == 0:
                        async for _ in health_pb2_grpc.HealthStub(channel).Watch(
                            health_pb2.HealthCheckRequest()
                        ):
                            pass
                    elif kind == 1:
                        await channel.stream_stream(
                            "/inference.GRPCInferenceService/ModelStreamInfer"
                        )(idle()).read()
                    else:
                        async for _ in pb_grpc.InferenceStub(channel).Generate(
                            pb.GenerateRequest(prompt="hi", max_tokens=4000)
                        ):
                            pass
                    return "OK"
                except grpc.RpcError as exc:
                    return exc.code().name

            calls = [asyncio.ensure_future(one(kind)) for kind in kinds]
            await asyncio.wait_for(all_idle.wait(), 20)
            await asyncio.sleep(1.0)  # the watches had their first answer, the streams tokens
            server.process.send_signal(signal.SIGTERM)
            return collections.Counter(await asyncio.wait_for(asyncio.gather(*calls), 60))

    try:
        ends = asyncio.run(run())
        server.process.wait(30)  # signalled once: a second SIGTERM would not be a clean stop
    finally:
        assert server.stop() == 0
    assert ends == {"UNAVAILABLE": 200}, ends
    text = log.read_text()
    assert "Traceback" not in text and "CancelledError" not in text
    lines = [line for line in text.splitlines() if "still open after the grace" in line]
    assert len(lines) == 1, lines


def _admin_answers(port: int, method: str, path: str) -> bytes:
    """What the TCP port answers to an HTTP/1.1 request for `path` (b"" when it closes or
    says nothing)."""
    with (
        contextlib.suppress(OSError),
        socket.create_connection(("127.0.0.1", port), timeout=3) as sock,
    ):
        sock.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        out = b""
        with contextlib.suppress(TimeoutError):
            while data := sock.recv(65536):
                out += data
        return out
    return b""


def test_envoys_admin_interface_is_on_no_tcp_port(server_factory) -> None:
    """Envoy's admin interface answers anyone who reaches it (stop, drain, log every header):
    none of the TCP ports Envoy's process holds (gRPC, HTTP front, metrics) may reach it."""
    server = server_factory(
        *NATIVE, "--devices", "cpu:1", "--step-ms", "5", "--metrics-port", "0", "--http-port", "0"
    )
    envoy = server.front
    ports = {c.laddr.port for c in envoy.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert len(ports) >= 3, ports  # gRPC, HTTP and metrics, at least
    for port in sorted(ports):
        for method, path in (("GET", "/stats"), ("GET", "/config_dump"), ("POST", "/quitquitquit")):
            answer = _admin_answers(port, method, path)
            assert b"server.live" not in answer and b"envoy.admin" not in answer, (port, path)
            assert b"bootstrap" not in answer and b"OK\n" != answer.split(b"\r\n\r\n")[-1], (
                port,
                path,
            )
    assert envoy.is_running()
    with Client(server.target) as client:
        assert client.health() == "SERVING"
    for sock in envoy.net_connections("unix"):  # one that can still be reached: private
        if sock.laddr and os.path.exists(sock.laddr):
            modes = os.stat(sock.laddr).st_mode, os.stat(os.path.dirname(sock.laddr)).st_mode
            assert any(mode & 0o077 == 0 for mode in modes), sock.laddr


def test_a_client_that_reads_nothing_is_cut_off_and_envoy_holds_little_for_it(
    server_factory,
) -> None:
    """--stall-timeout on Envoy: its buffer per stream is small (64 KiB, its least), so the
    front's write waits once the client's window and that buffer are full, and the stall
    sweep cuts the stream off and frees its slot, as on grpc.aio (with Envoy's default window
    of 16 MiB a stream of small messages would hold its slot for many minutes)."""
    server = server_factory(
        *NATIVE,
        "--step-ms",
        "2",
        "--stall-timeout",
        "2",
        "--max-concurrent",
        "1",
        "--max-tokens-limit",
        "1000000",
    )
    small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(server.target, options=small_window) as channel:
        stalled = pb_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(prompt="stall", max_tokens=1_000_000), timeout=120
        )
        next(stalled)
        with Client(server.target) as client:
            deadline = time.monotonic() + 60
            while True:  # admitted once the stalled stream has been cut off
                try:
                    assert sum(len(c.token_ids) for c in client.generate("next", max_tokens=3)) == 3
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    assert time.monotonic() < deadline, "the stalled stream kept its slot"
                    time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as info:  # what it was sent, then its end
            for _ in stalled:
                pass
        assert info.value.code() == grpc.StatusCode.CANCELLED


def test_a_stream_that_falls_behind_gets_every_token_in_order_merged(server_factory) -> None:
    """The output reader writes each chunk to Envoy without waking the stream's task; once
    Envoy's buffer for the stream is full the task waits, and then sends what waited as one
    message: nothing lost, nothing out of order."""
    server = server_factory(*NATIVE, "--step-ms", "1", "--max-tokens-limit", "100000")
    small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(server.target, options=small_window) as channel:
        stream = pb_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(prompt="behind", max_tokens=3000, include_timing=True), timeout=60
        )
        chunks = [next(stream)]
        time.sleep(4.0)  # Envoy's 64 KiB for the stream fill, then its writes wait
        chunks += list(stream)
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(tokens) == 3000
    assert [c.index for c in chunks] == list(
        itertools.accumulate([0] + [len(c.token_ids) for c in chunks[:-1]])
    )
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert max(len(c.token_ids) for c in chunks) > 1  # the steps that waited went out together
