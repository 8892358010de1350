"""Every input of the lab is bounded in time and memory, against peers that give it more than
it should take (tests/unbounded_peers.py, processes of their own, over real sockets):

- `--scrape` of a page that sends a byte a second stops at the scrape's time limit, from the
  first read (before the run) or from the middle of a run, and a page over the size cap is
  refused once that much has been read;
- `--otlp-receive` keeps spans by their size as well as their number;
- `--protocol grpc` keeps what the analysis reads of each response, not its bytes;
- a request that gets no message for the stall limit ends, so a server that stops answering
  cannot hold the bench.

Each was a hang or a run holding every byte before these bounds."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from cadence.lab.bench import STALL_LIMIT_S, Workload, run_bench
from cadence.lab.bench_cli import workload_from_args
from cadence.lab.load.grpc_schema import from_reflection
from cadence.lab.load.grpc_service import GrpcCodec, GrpcTarget, one_grpc
from cadence.lab.load.plan import RequestPlan, RequestShape
from cadence.lab.measure import prometheus
from cadence.lab.report.summary import scraped_lines, spans_line
from tests.integration.test_grpc_lab import TOKENS_METHOD, TOKENS_REQUEST, python_server

ROOT = Path(__file__).resolve().parents[2]
PEERS = "tests/unbounded_peers.py"
MIB = 2**20


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cadence.cli", "bench", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def grpc_args(target: str, *args: str) -> list[str]:
    return [
        "--target",
        target,
        "--protocol",
        "grpc",
        "--method",
        TOKENS_METHOD,
        "--request-json",
        TOKENS_REQUEST,
        "--index-field",
        "index",
        *args,
    ]


@pytest.mark.timeout(60)
def test_a_page_sending_a_byte_a_second_stops_the_bench_at_the_scrape_limit() -> None:
    with python_server(PEERS, "page", "--trickle-after", "0") as page:
        url = f"http://{page}/metrics"
        started = time.monotonic()
        done = bench("--target", "127.0.0.1:1", "--requests", "1", "--scrape", url, timeout=40)
        took = time.monotonic() - started
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        f"cadence bench: --scrape {url}: the page was not read within "
        f"{prometheus.SCRAPE_DEADLINE_S:g} s"
    ), line
    assert took < prometheus.SCRAPE_DEADLINE_S + 10


@pytest.mark.timeout(60)
def test_a_page_over_the_size_cap_is_refused_once_the_cap_is_read() -> None:
    # No Content-Length: the cap must hold while the page is read, not from its headers.
    with python_server(PEERS, "page", "--size", str(17 * MIB)) as page:
        url = f"http://{page}/metrics"
        started = time.monotonic()
        done = bench("--target", "127.0.0.1:1", "--requests", "1", "--scrape", url)
        took = time.monotonic() - started
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        f"cadence bench: --scrape {url}: the page is larger than 16 MiB, the most read of one page"
    ), line
    assert took < 10  # it was read to its end and parsed, for tens of seconds


@pytest.mark.timeout(90)
def test_a_page_that_starts_trickling_mid_run_is_read_no_more(monkeypatch) -> None:
    monkeypatch.setattr(prometheus, "SCRAPE_DEADLINE_S", 1.0, raising=False)
    with (
        python_server(PEERS, "page", "--trickle-after", "3") as page,
        python_server(PEERS, "grpc") as target,
    ):
        url = f"http://{page}/metrics"
        with grpc.insecure_channel(target) as channel:
            schema = from_reflection(channel, TOKENS_METHOD)
        protocol = GrpcTarget(schema=schema, request_json=TOKENS_REQUEST, index_field="index")
        workload = Workload(duration_s=3.0, concurrency=2, shape=RequestShape(max_tokens=(20, 20)))
        started = time.monotonic()
        result = run_bench(target, workload, protocol=protocol, scrape=[url])
        took = time.monotonic() - started
    assert result.requests_ok == result.requests > 0
    (endpoint,) = result.scraped.endpoints
    assert endpoint.scrapes == 3 and endpoint.failed_scrapes == 1
    assert endpoint.stopped == endpoint.first_error
    assert endpoint.stopped.startswith("the page was not read within 1 s, the limit of one scrape")
    assert took < 3.0 + 15
    (line, *_) = scraped_lines(result.scraped)
    assert line.startswith(f"scraped {url} (vllm): 3 scrapes") and line.endswith(
        "; then read no more"
    ), line


EXPORTER = """
import sys
import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

port, requests, size = (int(a) for a in sys.argv[1:])
with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
    export = pb_grpc.TraceServiceStub(channel).Export
    for i in range(requests):
        span = Span(trace_id=i.to_bytes(16, "big"), span_id=(i + 1).to_bytes(8, "big"),
                    parent_span_id=b"\\1" * 8, name="request", start_time_unix_nano=1,
                    end_time_unix_nano=2, attributes=[
                        KeyValue(key="prompt", value=AnyValue(string_value="p" * size)),
                        KeyValue(key="gen_ai.latency.time_in_queue",
                                 value=AnyValue(double_value=0.25))])
        export(pb.ExportTraceServiceRequest(resource_spans=[ResourceSpans(
            scope_spans=[ScopeSpans(spans=[span])])]), timeout=10)
    try:
        span.attributes[0].value.string_value = "p" * (5 * 2**20)
        export(pb.ExportTraceServiceRequest(resource_spans=[ResourceSpans(
            scope_spans=[ScopeSpans(spans=[span])])]), timeout=10)
    except grpc.RpcError as exc:
        print(exc.code().name)
"""


def _export(port: int, requests: int, size: int) -> str:
    done = subprocess.run(
        [sys.executable, "-c", EXPORTER, str(port), str(requests), str(size)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.timeout(90)
def test_the_trace_receiver_keeps_spans_by_size_not_only_by_number() -> None:
    pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")
    from cadence.lab.analysis.server_spans import join_spans
    from cadence.lab.measure.trace_receiver import TraceReceiver

    receiver = TraceReceiver(0, "127.0.0.1")
    receiver.start()
    try:
        # Spans of almost 4 MB each (the largest export taken): kept as a few hundred bytes.
        assert _export(receiver.port, 24, int(3.9 * MIB)) == "RESOURCE_EXHAUSTED"
        spans = receiver.spans()
    finally:
        receiver.stop()
    assert len(spans) == 24 and receiver.dropped == 0
    assert all(
        span.attributes == {"prompt": "p" * 256, "gen_ai.latency.time_in_queue": 0.25}
        for span in spans
    )

    from cadence.lab.measure.trace_receiver import span_bytes

    assert receiver.kept_bytes == sum(span_bytes(s) for s in spans) < 24 * 2000

    # Past the bytes the receiver keeps, spans are counted as dropped, and the run says so.
    small = TraceReceiver(0, "127.0.0.1", max_bytes=10 * span_bytes(spans[0]))
    small.start()
    try:
        _export(small.port, 24, 10_000)
    finally:
        small.stop()
    assert len(small.spans()) == 10 and small.dropped == 14
    line = spans_line(join_spans([], small.spans(), 0, small.port, small.dropped))
    assert (
        "; 14 more spans dropped, past what the receiver keeps (500,000 spans or 256 MiB)" in line
    ), line


MAXRSS = """
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
sys.exit(done.returncode)
"""


@pytest.mark.timeout(120)
def test_grpc_responses_of_a_megabyte_are_not_kept_whole(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    with python_server(PEERS, "grpc", "--message-bytes", str(MIB)) as target:
        # 384 messages of 1 MiB; the bench and its load process, at their largest.
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                MAXRSS,
                sys.executable,
                "-m",
                "cadence.cli",
                "bench",
                "--no-progress",
                *grpc_args(
                    target,
                    "--requests",
                    "4",
                    "--concurrency",
                    "4",
                    "--max-tokens",
                    "96",
                    "--json",
                    str(out),
                ),
            ],
            capture_output=True,
            text=True,
            timeout=100,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    assert done.returncode == 0, done.stderr
    peak_mb = int(done.stdout.strip().splitlines()[-1])
    result = json.loads(out.read_text())
    assert result["requests_ok"] == 4 and result["output_tokens"] == 384
    assert result["integrity"] == {
        "lost_tokens": 0,
        "repeated_tokens": 0,
        "reordered_chunks": 0,
        "short_streams": 0,
    }
    # Kept whole, the messages alone took 384 MiB.
    assert peak_mb < 220, peak_mb


@pytest.mark.timeout(60)
@pytest.mark.parametrize("index_field", ["", "index"])
def test_grpc_messages_past_the_unparsed_bytes_are_read_as_they_come(index_field: str) -> None:
    async def one(target: str) -> tuple:
        with grpc.insecure_channel(target) as channel:
            schema = from_reflection(channel, TOKENS_METHOD)
        codec = GrpcCodec(
            GrpcTarget(schema=schema, request_json=TOKENS_REQUEST, index_field=index_field)
        )
        codec.unparsed_limit = int(3.5 * MIB)
        async with grpc.aio.insecure_channel(target) as channel:
            method = codec.method(channel)
            first = await one_grpc(codec, method, RequestPlan("a", [1], 2), 0, False, 10)
            second = await one_grpc(codec, method, RequestPlan("b", [1], 8), 0, False, 10)
        return codec, first, second

    with python_server(PEERS, "grpc", "--message-bytes", str(MIB)) as target:
        codec, (first, kept_first), (second, kept_second) = asyncio.run(one(target))
    # The first request's two messages fit and wait for the run's end, and so does the
    # second's first; its second does not: its first is read then, and every later one as
    # it comes.
    assert len(kept_first) == 2 and first.tokens == []
    assert kept_second == [] and codec.unparsed == sum(map(len, kept_first))
    assert second.code == "OK" and len(second.arrival_ns) == 8
    assert second.tokens == [1] * 8 and second.index == list(range(8))
    codec.decode(first, kept_first)
    assert first.tokens == [1, 1] and first.index == [0, 1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("then", [0, 2])
def test_a_server_that_stops_answering_ends_each_request_at_the_stall_limit(then: int) -> None:
    # The first call (the bench's probe) is answered; every later one gets `then` messages.
    with python_server(PEERS, "grpc", "--silent-after", "1", "--then", str(then)) as target:
        started = time.monotonic()
        done = bench(
            *grpc_args(
                target,
                "--requests",
                "4",
                "--concurrency",
                "4",
                "--max-tokens",
                "10",
                "--stall-limit",
                "1",
            )
        )
        took = time.monotonic() - started
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == "cadence bench: every request failed (STALLED)"
    assert (
        f"  STALLED: no message for 1 s (after {then}): ended by the stall limit "
        "(cadence bench --stall-limit)"
    ) in done.stdout
    assert took < 20


def test_the_stall_limit_is_on_unless_a_deadline_bounds_each_request() -> None:
    import argparse

    from cadence.lab.bench_cli import add_bench

    parser = argparse.ArgumentParser()
    add_bench(parser.add_subparsers())

    def limit(*args: str) -> float | None:
        return workload_from_args(
            parser.parse_args(["bench", "--target", "x:1", *args])
        ).stall_limit_s

    assert limit() == STALL_LIMIT_S == 60
    assert limit("--timeout", "300") is None
    assert limit("--timeout", "300", "--stall-limit", "5") == 5
    assert limit("--stall-limit", "0") is None


def test_a_stream_that_never_pauses_for_the_stall_limit_outlives_it() -> None:
    with python_server(PEERS, "grpc") as target:
        with grpc.insecure_channel(target) as channel:
            schema = from_reflection(channel, TOKENS_METHOD)
        codec = GrpcCodec(GrpcTarget(schema=schema, request_json=TOKENS_REQUEST))

        async def one() -> tuple:
            async with grpc.aio.insecure_channel(target) as channel:
                return await one_grpc(
                    codec,
                    codec.method(channel),
                    RequestPlan("a", [1], 100),
                    0,
                    False,
                    None,
                    stall_s=0.2,
                )

        record, kept = asyncio.run(one())
    assert record.code == "OK" and len(kept) == 100
    assert (record.end_ns - record.start_ns) / 1e9 > 0.4  # longer than the limit, in all
