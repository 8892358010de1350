"""Users' real traffic through the lab, against real servers on 127.0.0.1: a small
Mooncake-style trace replayed on its times and a set of conversations, on cadence (synthetic
engine, over cadence.v1, KServe and OpenAI) and on a planted foreign gRPC service.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import msgspec
import pytest

from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.grpc_schema import from_reflection
from cadence.lab.load.grpc_service import GrpcTarget
from cadence.lab.load.kserve import KServeTarget
from cadence.lab.load.lengths import parse_lengths
from cadence.lab.load.openai_http import OpenAITarget
from cadence.lab.load.plan import Conversation, RequestShape
from cadence.lab.load.trace import read_trace
from cadence.lab.results import BenchResult
from tests.integration.conftest import start_server
from tests.integration.test_bench_honest import bench
from tests.integration.test_grpc_lab import TOKENS_METHOD, python_server

TRACE = [  # ms; blocks 0 and 1 shared by the first two rows, block 0 by the last
    {"timestamp": 0, "input_length": 40, "output_length": 4, "hash_ids": [0, 1]},
    {
        "timestamp": 20,
        "input_length": 60,
        "output_length": 5,
        "hash_ids": [0, 1, 2],
        "session_id": "a",
    },
    {"timestamp": 35, "input_length": 20, "output_length": 3, "hash_ids": [5]},
    {
        "timestamp": 90,
        "input_length": 30,
        "output_length": 4,
        "hash_ids": [0, 7],
        "session_id": "a",
    },
    {"timestamp": 100, "input_length": 25, "output_length": 2},
    {"timestamp": 140, "input_length": 50, "output_length": 6, "hash_ids": [0, 1, 9]},
]
BLOCK = 20
"""Tokens per hash block in these tests (Mooncake's are 512)."""
PROMPT_REQUEST = (
    '{"request_id": "{request_id}", "prompt": "{prompt}", "max_tokens": "{max_tokens}"}'
)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, str]]:
    """(gRPC target, http://HOST:PORT) of one synthetic cadence server."""
    with start_server(
        "--devices", "cpu:1", "--step-ms", "2", "--prefix-caching", http=True
    ) as server:
        yield server.target, server.base


@pytest.fixture
def trace_file(tmp_path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in TRACE))
    return path


def _assert_replayed(result: BenchResult) -> None:
    """Every row sent on its time, its lengths as the trace says; the schedule error kept."""
    assert result.requests_ok == len(TRACE), result.first_error_by_code
    records = sorted(result.records, key=lambda r: int(r.request_id.removeprefix("bench-")))
    first = records[0].scheduled_ns
    assert [round((r.scheduled_ns - first) / 1e6) for r in records] == [
        row["timestamp"] for row in TRACE
    ]
    assert [r.prompt_tokens for r in records] == [row["input_length"] for row in TRACE]
    assert [r.max_tokens for r in records] == [row["output_length"] for row in TRACE]
    assert result.client.schedule_lag_ms.count == len(TRACE)
    assert result.client.offered_rate_per_s == pytest.approx(len(TRACE) / 0.14)
    assert result.ttft_from_schedule_ms.count == len(TRACE)
    assert result.ttft_from_schedule_ms.p50 >= result.ttft_ms.p50
    assert result.workload.trace.with_hash_ids == 5


@pytest.mark.parametrize("protocol", ["cadence", "kserve", "openai"])
def test_a_mooncake_trace_replays_on_cadence(served, trace_file, protocol) -> None:
    target, http = served
    speaking = {
        "cadence": None,
        "kserve": KServeTarget("cadence"),
        "openai": OpenAITarget(http, "cadence"),
    }[protocol]
    rows = read_trace(str(trace_file))
    workload = Workload(requests=len(rows), shape=RequestShape(trace=rows, block_tokens=BLOCK))
    result = run_bench(target, workload, **({"protocol": speaking} if speaking else {}))
    _assert_replayed(result)
    assert {r.turn for r in result.records} == {0, 1, 2}  # session "a" has two turns
    # The shared blocks reach the server as shared prefixes: it says it had them cached.
    assert result.cached_tokens and result.cached_tokens.per_request.max >= BLOCK // 2


def test_a_trace_replays_on_a_foreign_grpc_service(trace_file, tmp_path) -> None:
    out = tmp_path / "run.json"
    with python_server("tests/planted_server.py", "--gap-ms", "2") as target:
        done = bench(
            "--target",
            target,
            "--protocol",
            "grpc",
            "--method",
            TOKENS_METHOD,
            "--request-json",
            PROMPT_REQUEST,
            "--index-field",
            "index",
            "--trace",
            str(trace_file),
            "--trace-block-tokens",
            str(BLOCK),
            "--session-header",
            "X-Session",
            "--json",
            str(out),
        )
    assert done.returncode == 0, done.stderr
    assert re.search(
        r"schedule error \(actual − scheduled send\) p50 [\d.]+ ms, p99 [\d.]+ ms", done.stdout
    ), done.stdout
    assert "ttft_from_schedule_ms" in done.stdout
    _assert_replayed(msgspec.convert(json.loads(out.read_text()), BenchResult))


def test_trace_options_are_checked_before_the_run(trace_file) -> None:
    done = bench("--target", "127.0.0.1:1", "--trace", str(trace_file), "--trace-window", "5:6")
    assert done.returncode != 0
    assert done.stderr.strip().endswith("no request in the window 5:6 s (the trace spans 0.14 s)")
    done = bench("--target", "127.0.0.1:1", "--trace-speed", "2")
    assert "--trace-speed and --trace-window need --trace" in done.stderr


def _assert_conversations(result: BenchResult, sessions: int, turns: int) -> None:
    assert result.requests_ok == sessions * turns, result.first_error_by_code
    assert list(result.ttft_by_turn_ms) == [str(t) for t in range(1, turns + 1)]
    assert all(d.count == sessions for d in result.ttft_by_turn_ms.values())
    by_turn: dict[int, set[int]] = {}
    for r in result.records:
        by_turn.setdefault(r.turn, set()).add(r.prompt_tokens)
    # Each turn's prompt is the history: longer than every prompt of the turn before.
    for turn in range(2, turns + 1):
        assert min(by_turn[turn]) > max(by_turn[turn - 1])


def test_conversations_over_openai_chat_report_ttft_by_turn(served, tmp_path) -> None:
    _, http = served
    out = tmp_path / "run.json"
    done = bench(
        "--target",
        http,
        "--protocol",
        "openai",
        "--endpoint",
        "chat",
        "--sessions",
        "3",
        "--turns",
        "3",
        "--think-ms",
        "10",
        "--prompt-tokens",
        "8",
        "--max-tokens",
        "4",
        "--session-header",
        "X-Session-Id",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert re.search(
        r"TTFT by turn \(p50 / p99 ms\): turn 1 [\d.]+ / [\d.]+ \(n=3\), turn 2 ", done.stdout
    ), done.stdout
    result = msgspec.convert(json.loads(out.read_text()), BenchResult)
    _assert_conversations(result, 3, 3)
    assert result.workload.conversation.session_header == "x-session-id"
    # Think time: a session's next turn goes no sooner than 10 ms after its last one ended.
    ordered = sorted(result.records, key=lambda r: int(r.request_id.removeprefix("bench-")))
    for earlier, later in itertools.pairwise(ordered):
        if later.turn > 1:
            assert later.start_ns - earlier.end_ns >= 10e6


def test_conversations_on_a_foreign_grpc_service() -> None:
    with python_server("tests/planted_server.py", "--gap-ms", "2") as target:
        with grpc.insecure_channel(target) as channel:
            schema = from_reflection(channel, TOKENS_METHOD)
        protocol = GrpcTarget(schema=schema, request_json=PROMPT_REQUEST, index_field="index")
        shape = RequestShape(
            conversation=Conversation(4, 2),
            prompt_tokens=(6, 6),
            output_lengths=parse_lengths("lognormal:4,2,1,8"),
            session_header="x-session",
        )
        result = run_bench(
            target, Workload(requests=8, concurrency=4, shape=shape), protocol=protocol
        )
    _assert_conversations(result, 4, 2)
    assert result.workload.output_length_distribution == "lognormal:4,2,1,8"
    assert {r.max_tokens for r in result.records} <= set(range(1, 9))
    assert [r.output_tokens for r in result.records] == [r.max_tokens for r in result.records]


def test_mixed_clients_are_reported_by_population(served, tmp_path) -> None:
    target, _ = served
    out = tmp_path / "run.json"
    done = bench(
        "--target",
        target,
        "--concurrency",
        "12",
        "--requests",
        "48",
        "--max-tokens",
        "20",
        "--read-delay-ms",
        "10@30%",
        "--cancel-ms",
        "25@30%",
        "--deadline-ms",
        "5000@20%",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert "by client population:" in done.stdout
    result = msgspec.convert(json.loads(out.read_text()), BenchResult)
    groups = result.by_population
    assert set(groups) == {"cancelling", "deadline", "plain", "slow_reader"}
    assert sum(p.requests for p in groups.values()) == 48
    assert groups["cancelling"].codes == {"CLIENT_CANCELLED": groups["cancelling"].requests}
    assert result.cancelled_by_client == groups["cancelling"].requests
    assert "CLIENT_CANCELLED" not in result.errors_by_code
    # A 10 ms wait per read, less up to 1 ms for the loop's timers, which wake that early.
    slow, plain = groups["slow_reader"].itl_ms.p50, groups["plain"].itl_ms.p50
    assert slow >= 9 and slow > plain, (slow, plain)
    assert groups["deadline"].requests_ok == groups["deadline"].requests


def test_rate_steps_with_a_warm_up_by_time(served, tmp_path) -> None:
    target, _ = served
    out = tmp_path / "run.json"
    done = bench(
        "--target",
        target,
        "--stages",
        "20:0.5,60:0.5",
        "--warmup-duration",
        "0.5",
        "--max-tokens",
        "4",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    result = msgspec.convert(json.loads(out.read_text()), BenchResult)
    assert result.workload.rate_stages == [[20.0, 20.0, 0.5], [60.0, 60.0, 0.5]]
    assert result.client.offered_rate_per_s == 40.0
    # The first step was the warm-up: only the second's ~30 requests were counted.
    assert 10 <= result.requests <= 55 and result.client.schedule_lag_ms.count == result.requests
    first = min(r.scheduled_ns for r in result.records)
    assert all(r.start_ns >= first for r in result.records)


def test_request_classes_in_a_mix_are_reported_by_class(served, tmp_path) -> None:
    target, _ = served
    out = tmp_path / "run.json"
    done = bench(
        "--target",
        target,
        "--concurrency",
        "8",
        "--requests",
        "40",
        "--class",
        "chat prompt=20 max=4 slo=ttft_p99_ms=10000",
        "--class",
        "summarize prompt=200:300 max=16 slo=ttft_p99_ms=0.001",
        "--mix",
        "chat:70%,summarize:30%",
        "--json",
        str(out),
        "--export",
        str(tmp_path / "rows.csv"),
    )
    assert done.returncode == 0, done.stderr
    assert "by request class:" in done.stdout
    result = msgspec.convert(json.loads(out.read_text()), BenchResult)
    groups = result.by_class
    assert set(groups) == {"chat", "summarize"}
    assert sum(g.requests for g in groups.values()) == 40 and groups["chat"].requests > 18
    assert {r.request_class for r in result.records} == {"chat", "summarize"}
    for r in result.records:  # each request made to its class's lengths
        if r.request_class == "chat":
            assert (r.prompt_tokens, r.max_tokens, r.output_tokens) == (20, 4, 4)
        else:
            assert 200 <= r.prompt_tokens <= 300 and r.max_tokens == 16
    # Each class judged on its own SLO: one easy, one impossible.
    assert groups["chat"].goodput.passed and groups["chat"].goodput.good_share == 1.0
    assert not groups["summarize"].goodput.passed
    assert [c.name for c in result.workload.mix] == ["chat", "summarize"]
    assert result.workload.mix[1].prompt_tokens == [200, 300]
    rows = (tmp_path / "rows.csv").read_text().splitlines()
    assert rows[0].endswith(",request_class") and sum(r.endswith(",chat") for r in rows) > 18
    # Bad definitions are one line each, before any load.
    for args, says in (
        (["--mix", "chat:70%,x:20%"], "add up to 90%"),
        (["--mix", "chat:100%"], "no --class defines it"),
        (
            ["--class", "chat max=4", "--mix", "chat:100%", "--sessions", "2"],
            "--mix makes the requests itself",
        ),
        (["--class", "chat size=4"], "expected 'NAME prompt=LEN"),
    ):
        bad = bench("--target", target, *args)
        assert bad.returncode != 0 and says in bad.stderr, bad.stderr


def test_prefix_cache_hit_rate_by_worker_is_scraped(tmp_path) -> None:
    """Conversations over two workers with prefix caching: the hit rate of each worker, from
    its counters, beside the cached tokens the server reported per request."""
    with start_server(
        "--metrics-port", "0", "--devices", "cpu:2", "--step-ms", "2", "--prefix-caching"
    ) as server:
        out = tmp_path / "run.json"
        done = bench(
            "--target",
            server.target,
            "--sessions",
            "4",
            "--turns",
            "3",
            "--prompt-tokens",
            "100",
            "--max-tokens",
            "4",
            "--scrape",
            server.metrics_url,
            "--json",
            str(out),
        )
    assert done.returncode == 0, done.stderr
    result = msgspec.convert(json.loads(out.read_text()), BenchResult)
    hits = result.scraped.prefix_cache
    assert [h.labels for h in hits] == [{"worker": "0"}, {"worker": "1"}]
    assert sum(h.hit_tokens for h in hits) > 0 and all(0 <= h.hit_rate <= 1 for h in hits)
    # The counters and the per-request counts tell the same: within the scrapes' edges.
    assert sum(h.hit_tokens for h in hits) <= result.cached_tokens.per_request.mean * 12 + 1
    assert "prefix cache hit rate (--scrape" in done.stdout and "worker 1" in done.stdout


def test_a_replay_says_its_length_and_a_row_far_ahead_is_refused(served, tmp_path) -> None:
    """A row 31 years after the others (a time in the wrong unit) is refused before the run,
    saying how to allow it; allowed by --duration, the run says at its start what it replays
    and ends on time, the far row left out."""
    target, _ = served
    path = tmp_path / "far.jsonl"
    path.write_text(
        "".join(
            json.dumps(row) + "\n"
            for row in [*TRACE, {"timestamp": 1e12, "input_length": 5, "output_length": 2}]
        )
    )
    refused = bench("--target", target, "--trace", str(path), timeout=60)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        (
            f"cadence bench: --trace {path}: the replay would take 1e+09 s; the longest pause: "
            "1e+09 s, before row 7; give --duration S to replay that long, or cut it with "
            "--trace-window, --trace-speed or --requests"
        )
    ]
    done = bench("--target", target, "--trace", str(path), "--duration", "5", timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[0] == (
        f"cadence bench: replaying {len(TRACE)} requests of {path} over 0.14 s "
        "(--duration 5 leaves out 1 later rows)"
    )
    assert f"{len(TRACE)}/{len(TRACE)} requests ok" in done.stdout, done.stdout
