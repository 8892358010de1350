"""OpenTelemetry traces from outside: `cadence serve --otlp-traces-endpoint` sends one span per
request over every protocol, in the caller's trace, to a receiver built on opentelemetry-proto
(the lab's); `cadence bench --otlp-receive` joins the spans of cadence and of a grpc-python
service instrumented with opentelemetry-instrumentation-grpc to its requests."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import aiohttp
import grpc
import pytest

from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.cadence_v1 import generate_method, one_cadence
from cadence.lab.load.grpc_schema import from_reflection
from cadence.lab.load.grpc_service import GrpcTarget
from cadence.lab.load.kserve import KServeTarget, one_kserve, stub
from cadence.lab.load.openai_http import OpenAITarget, one_openai
from cadence.lab.load.plan import RequestPlan, RequestShape
from cadence.lab.measure.trace_receiver import TraceReceiver
from cadence.proto.v1 import inference_pb2 as pb
from tests.integration.conftest import runs_once, start_server
from tests.integration.test_grpc_lab import TOKENS_METHOD, TOKENS_REQUEST, python_server

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.instrumentation.grpc")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def receiver(monkeypatch) -> Iterator[TraceReceiver]:
    # Servers started by the test export every 0.1 s instead of the SDK's 5 s.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    found = TraceReceiver(0)
    found.start()
    yield found
    found.stop()


def _by_trace(receiver: TraceReceiver) -> dict[str, list]:
    out: dict[str, list] = {}
    for span in receiver.spans():
        out.setdefault(span.trace_id, []).append(span)
    return out


async def _each_protocol(server) -> dict[str, object]:
    """One request per protocol through the lab's own drivers (each sends a traceparent)."""
    plan = RequestPlan("traced", [72, 105], 6)
    records = {}
    async with grpc.aio.insecure_channel(server.target) as channel:
        records["cadence.v1"], _ = await one_cadence(generate_method(channel), plan, 0, True, 30)
        records["kserve"], _ = await one_kserve(
            KServeTarget(model="cadence"), stub(channel), plan, 0, False, 30
        )
        # Past its deadline mid-stream: a span that says so.
        late = RequestPlan("late", [72], 500)
        records["deadline"], _ = await one_cadence(generate_method(channel), late, 0, True, 0.3)
    async with aiohttp.ClientSession() as session:
        for endpoint in ("completions", "chat"):
            target = OpenAITarget(base_url=server.base, model="cadence", endpoint=endpoint)
            records[endpoint], _ = await one_openai(target, session, plan, 0, False, 30)
    return records


def test_one_span_per_request_on_every_protocol_in_the_callers_trace(receiver) -> None:
    server = start_server(
        "--step-ms", "5", "--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.port}", http=True
    )
    try:
        records = asyncio.run(_each_protocol(server))
        # A caller's own trace context: its span is the server span's parent.
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        with grpc.insecure_channel(server.target) as channel:
            call = channel.unary_stream(
                "/cadence.v1.Inference/Generate",
                request_serializer=pb.GenerateRequest.SerializeToString,
                response_deserializer=pb.GenerateChunk.FromString,
            )
            list(
                call(
                    pb.GenerateRequest(prompt="hi", max_tokens=3),
                    metadata=(("traceparent", parent),),
                )
            )
        ids = {r.trace_id for r in records.values()} | {"0af7651916cd43dd8448eb211c80319c"}
        receiver.wait_for(ids, timeout_s=20)
    finally:
        server.stop()
    spans = _by_trace(receiver)
    assert records["deadline"].code == "DEADLINE_EXCEEDED"
    for protocol, record in records.items():
        assert record.trace_id and len(spans.get(record.trace_id, [])) == 1, (protocol, spans)
        [span] = spans[record.trace_id]
        assert span.service == "cadence" and span.parent_id  # the lab's span is its parent
        attributes = span.attributes
        assert attributes["gen_ai.request.model"] == "cadence"
        if protocol == "deadline":
            assert span.error and "deadline" in span.error
            assert attributes["error.type"] == "DEADLINE_EXCEEDED"
            continue
        assert span.error is None, (protocol, span.error)
        assert span.name == ("chat cadence" if protocol == "chat" else "text_completion cadence")
        assert attributes["gen_ai.request.max_tokens"] == 6
        assert attributes["gen_ai.usage.output_tokens"] == 6
        assert attributes["cadence.protocol"] == protocol.replace("completions", "openai").replace(
            "chat", "openai"
        )
        # The hops, in order, inside the span.
        queue = attributes["gen_ai.latency.time_in_queue"]
        prefill = attributes["gen_ai.latency.time_in_model_prefill"]
        ttft = attributes["gen_ai.latency.time_to_first_token"]
        assert 0 <= queue and 0 < prefill and queue + prefill <= ttft
        assert ttft * 1e9 <= span.end_ns - span.start_ns
    [own] = spans["0af7651916cd43dd8448eb211c80319c"]
    assert own.parent_id == "b7ad6b7169203331"


def test_bench_joins_cadences_spans_to_its_requests(receiver) -> None:
    server = start_server(
        "--step-ms", "10", "--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.port}", http=True
    )
    try:
        workload = Workload(requests=24, concurrency=8, shape=RequestShape(max_tokens=(8, 8)))
        result = run_bench(server.target, workload, traces=receiver, traces_wait_s=20)
    finally:
        server.stop()
    spans = result.server_spans
    assert spans.sent == 24 and spans.matched == 24 and spans.services == ["cadence"]
    assert spans.clock_suspect == 0
    split = spans.ttft_split_ms
    # The span's edges are the front's own timestamps: before it is client_to_front, and
    # the parts add up to TTFT request by request.
    first = result.ttft_segments_ms
    assert abs(split["before"].mean - first.client_to_front.mean) < 0.5
    assert abs(split["queue"].mean - first.queue.mean) < 0.5
    for r in spans.requests:
        assert abs(r.before_ms + r.inside_ms + r.after_ms - r.ttft_ms) < 1e-6
        assert r.prefill_ms > 0 and r.after_ms >= 0
    assert (
        abs(split["before"].mean + split["inside"].mean + split["after"].mean - result.ttft_ms.mean)
        < 0.5
    )


def test_bench_joins_an_instrumented_grpc_python_services_spans(receiver, tmp_path) -> None:
    with python_server(
        "tests/planted_server.py",
        "--fault",
        "first",
        "--first-ms",
        "120",
        "--gap-ms",
        "5",
        "--otlp-endpoint",
        f"http://127.0.0.1:{receiver.port}",
    ) as target:
        with grpc.insecure_channel(target) as channel:
            schema = from_reflection(channel, TOKENS_METHOD)
        protocol = GrpcTarget(schema=schema, request_json=TOKENS_REQUEST, index_field="index")
        workload = Workload(requests=8, concurrency=4, shape=RequestShape(max_tokens=(5, 5)))
        result = run_bench(target, workload, protocol=protocol, traces=receiver, traces_wait_s=20)
    spans = result.server_spans
    assert spans.matched == 8 and spans.services == ["planted"], spans
    for r in spans.requests:
        assert r.name.endswith("TokenService/Generate"), r.name
        assert [c.name for c in r.children] == ["queue"]
        # No first-send mark on a plain gRPC span: inside and after stay one.
        assert r.inside_ms is None and r.inside_or_after_ms > r.queue_ms >= 115
    fired = {f.rule for f in result.diagnosis}
    # The spans name the wait: the server's queue, not a fixed cost before every first message.
    assert "ttft_server_queue" in fired and "slow_first_message" not in fired, result.diagnosis
    # The terminal summary and the report say it too.
    path = tmp_path / "run.json"
    from cadence.lab.results import to_builtins

    path.write_text(json.dumps(to_builtins(result)))
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "cadence.cli",
            "report",
            str(path),
            "--out",
            str(tmp_path / "report"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    page = (tmp_path / "report" / "report.html").read_text()
    assert "Server spans" in page and "slowest requests to first token" in page


@pytest.mark.shares_host
@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("notaport", "--otlp-receive takes [HOST:]PORT, got 'notaport'"),
        ("taken", "cannot receive traces on 127.0.0.1:"),
    ],
)
def test_a_receiver_that_cannot_listen_is_one_line(receiver, where, said) -> None:
    where = f"127.0.0.1:{receiver.port}" if where == "taken" else where
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cadence.cli",
            "bench",
            "--target",
            "127.0.0.1:1",
            "--otlp-receive",
            where,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"cadence bench: {said}"), out.stderr


@pytest.mark.shares_host
@runs_once
def test_an_unreachable_collector_neither_fails_requests_nor_holds_the_stop() -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    server = start_server("--step-ms", "5", "--otlp-traces-endpoint", f"http://127.0.0.1:{port}")
    try:
        with grpc.insecure_channel(server.target) as channel:
            call = channel.unary_stream(
                "/cadence.v1.Inference/Generate",
                request_serializer=pb.GenerateRequest.SerializeToString,
                response_deserializer=pb.GenerateChunk.FromString,
            )
            for _ in range(3):
                chunks = list(call(pb.GenerateRequest(prompt="hi", max_tokens=3)))
                assert sum(len(c.token_ids) for c in chunks) == 3  # in 1 to 3 messages
    finally:
        started = time.monotonic()
        code = server.stop(timeout=60)
    # The SDK would wait out its retries (several seconds); the stop gives up after 2 s.
    assert code == 0 and time.monotonic() - started < 15
