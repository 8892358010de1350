"""`cadence bench --protocol grpc` and `cadence sweep --server-cmd` against servers cadence did
not write: a Node.js @grpc/grpc-js service with its own proto (tests/node), the worked
example's plain grpc-python service (examples/thread_pool), and a grpc.aio service with one
planted fault (tests/planted_server.py). Every command runs as a user would run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import msgspec
import pytest

from cadence.lab.analysis import diagnosis as dx
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.grpc_schema import from_reflection
from cadence.lab.load.grpc_service import GrpcTarget
from cadence.lab.load.plan import RequestShape
from cadence.lab.results import BenchResult, Integrity, SweepResult
from cadence.lab.servers.command_server import CommandServer
from tests import node_ticker
from tests.integration.host_load import assert_named
from tests.node_ticker import COUNT_METHOD, PROTO_FILE, PROTO_PATH, ticker_server

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "thread_pool" / "server.py"
TOKENS_METHOD = "tokens.v1.TokenService/Generate"
TOKENS_REQUEST = '{"request_id": "{request_id}", "max_tokens": "{max_tokens}"}'


def cadence(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`cadence ARGS` as a user runs it, from this checkout's `src` first (the code under test,
    not an installed copy) with the repository root importable too (tests.*)."""
    return subprocess.run(
        [sys.executable, "-m", "cadence.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT / "src"), str(ROOT)))},
    )


def bench_json(tmp_path: Path, target: str, *args: str, all_fail: bool = False) -> BenchResult:
    """The run's result; `all_fail`: every request is to fail, and the bench to say so and
    exit non-zero (its JSON still written)."""
    out = tmp_path / "run.json"
    done = cadence(
        "bench",
        "--target",
        target,
        "--protocol",
        "grpc",
        "--no-progress",
        "--json",
        str(out),
        *args,
    )
    if all_fail:
        assert done.returncode != 0 and "every request failed" in done.stderr, done.stderr
    else:
        assert done.returncode == 0, done.stderr
    return msgspec.convert(json.loads(out.read_text()), BenchResult)


def count_args(count: str = "{max_tokens}", **fields) -> list[str]:
    request = {
        "count": count,
        "first_delay_ms": 30,
        "gap_ms": 10,
        "label": "{request_id}",
        **fields,
    }
    return ["--method", COUNT_METHOD, "--request-json", json.dumps(request)]


def assert_clean(result: dict, requests: int) -> None:
    assert result.requests_ok == requests, result.first_error_by_code
    assert result.integrity == Integrity()


@pytest.fixture(scope="module")
def ticker() -> Iterator[str]:
    with ticker_server() as target:
        yield target


def test_node_service_by_reflection_counts_tokens_per_message(ticker, tmp_path):
    result = bench_json(
        tmp_path,
        ticker,
        *count_args(words_per_tick=3),
        "--tokens-field",
        "words",
        "--index-field",
        "first_word",
        "--concurrency",
        "16",
        "--max-tokens",
        "20",
        "--procs",
        "2",
    )
    assert_clean(result, 16)
    assert result.output_tokens == 16 * 20 * 3 and result.chunks == 16 * 20
    assert result.chunk_tokens.p50 == 3
    assert 30 <= result.ttft_ms.p50 < 200
    # Three tokens per 10 ms message: ITL is the gap over the tokens it carries.
    gap = result.chunk_gap_ms.p50
    assert 9 <= gap <= 20 and abs(result.itl_ms.p50 - gap / 3) < 0.5
    workload = result.workload
    assert workload.protocol == "grpc"
    assert workload.grpc.types_from.startswith("reflection")
    assert workload.grpc.method == f"/{COUNT_METHOD}"
    assert "server" in result.system.processes  # the Node process, found by its port


def test_node_bidirectional_method(ticker, tmp_path):
    result = bench_json(
        tmp_path,
        ticker,
        "--method",
        node_ticker.CHAT_METHOD,
        "--request-json",
        '{"count": "{max_tokens}", "gap_ms": 5}',
        "--index-field",
        "seq",
        "--concurrency",
        "8",
        "--max-tokens",
        "12",
    )
    assert_clean(result, 8)
    assert result.output_tokens == 8 * 12 and result.workload.grpc.bidirectional


@pytest.mark.shares_host
def test_reflection_that_serves_one_file_per_proto_is_followed_through_its_imports(tmp_path):
    """Servers built from protoc descriptors return the method's file alone; its import
    (ticker/v1/tick.proto, which holds the response type) is fetched by name."""
    with ticker_server(source_files=True) as target:
        result = bench_json(
            tmp_path,
            target,
            *count_args(words_per_tick=2),
            "--tokens-field",
            "words",
            "--index-field",
            "first_word",
            "--concurrency",
            "4",
            "--max-tokens",
            "6",
        )
    assert_clean(result, 4)
    assert result.output_tokens == 4 * 6 * 2


@pytest.mark.shares_host
@pytest.mark.slow
def test_without_reflection_the_protos_give_the_types(tmp_path):
    with ticker_server(reflection=False) as target:
        refused = cadence("bench", "--target", target, "--protocol", "grpc", *count_args())
        assert refused.returncode == 1
        assert refused.stderr.strip().splitlines() == [
            "cadence bench: the server offers no reflection service (grpc.reflection.v1 or "
            "v1alpha): give its protos with --proto FILE (and --proto-path DIR)"
        ]
        result = bench_json(
            tmp_path,
            target,
            *count_args(),
            "--proto",
            PROTO_FILE,
            "--proto-path",
            PROTO_PATH,
            "--index-field",
            "seq",
            "--concurrency",
            "4",
            "--max-tokens",
            "8",
        )
    assert_clean(result, 4)
    assert result.workload.grpc.types_from == "protos"


@pytest.mark.shares_host
@pytest.mark.slow
def test_headers_reach_the_service_and_errors_are_counted_by_code(tmp_path):
    with ticker_server(token="s3cret") as target:
        denied = bench_json(
            tmp_path,
            target,
            *count_args(),
            "--requests",
            "3",
            "--concurrency",
            "3",
            "--max-tokens",
            "4",
            all_fail=True,
        )
        allowed = bench_json(
            tmp_path,
            target,
            *count_args(),
            "--header",
            "Authorization=Bearer s3cret",
            "--requests",
            "3",
            "--concurrency",
            "3",
            "--max-tokens",
            "4",
        )
        failing = bench_json(
            tmp_path,
            target,
            *count_args(count="8", fail_after=2),
            "--header",
            "authorization=Bearer s3cret",
            "--requests",
            "3",
            "--concurrency",
            "3",
            all_fail=True,
        )
    assert denied.errors_by_code == {"UNAUTHENTICATED": 3}
    assert "bearer token" in denied.first_error_by_code["UNAUTHENTICATED"]
    assert allowed.requests_ok == 3 and allowed.errors_by_code == {}
    assert failing.errors_by_code == {"RESOURCE_EXHAUSTED": 3}


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--method", "ticker.v1.Ticker/Nope", "--request-json", "{}"],
            "cadence bench: service 'ticker.v1.Ticker' has no method 'Nope' (it has: Count, Chat, "
            "Once)",
        ),
        (
            ["--method", "ticker.v2.Ticker/Count", "--request-json", "{}"],
            "cadence bench: the server has no service 'ticker.v2.Ticker' (it offers: "
            "ticker.v1.Ticker)",
        ),
        (
            ["--method", COUNT_METHOD, "--request-json", '{"cuont": 3}'],
            'cadence bench: --request-json: Message type "ticker.v1.CountRequest" has no field '
            'named "cuont"',
        ),
        (
            ["--method", COUNT_METHOD, "--request-json", '{"count": "many"}'],
            "cadence bench: --request-json: Failed to parse count field",
        ),
        (
            ["--method", COUNT_METHOD, "--request-json", "{}", "--tokens-field", "letters"],
            "cadence bench: --tokens-field: ticker.v1.Tick has no field 'letters'",
        ),
        (
            ["--method", node_ticker.ONCE_METHOD, "--request-json", "{}"],
            "cadence bench: ticker.v1.Ticker/Once does not stream its response",
        ),
    ],
)
@pytest.mark.shares_host
def test_bad_input_is_one_clear_line(ticker, args, message):
    done = cadence("bench", "--target", ticker, "--protocol", "grpc", *args)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), done.stderr


@pytest.mark.shares_host
def test_a_server_that_is_down_is_one_clear_line():
    with ticker_server() as target:
        pass  # stopped: nothing listens on its port any more
    done = cadence("bench", "--target", target, "--protocol", "grpc", *count_args())
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"cadence bench: no gRPC server answers at {target}")


# -- servers of the worked example and with planted faults ------------------------------------


@contextmanager
def python_server(*args: str) -> Iterator[str]:
    """A plain Python gRPC server that prints `listening on HOST:PORT`; yield the target."""
    process = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = process.stdout.readline().strip()
        assert line.startswith("listening on "), f"{args} printed {line!r}"
        yield line.removeprefix("listening on ")
    finally:
        process.terminate()
        process.wait(10)


def tokens_bench(
    target: str, streams: int = 16, requests: int | None = None, max_tokens: int = 40
) -> dict:
    with grpc.insecure_channel(target) as channel:
        schema = from_reflection(channel, TOKENS_METHOD)
    grpc_target = GrpcTarget(schema=schema, request_json=TOKENS_REQUEST, index_field="index")
    workload = Workload(
        requests=requests or streams,
        concurrency=streams,
        shape=RequestShape(max_tokens=(max_tokens, max_tokens)),
    )
    return run_bench(target, workload, protocol=grpc_target)


@pytest.mark.shares_host
def test_a_lost_token_is_seen_with_index_field():
    with python_server("tests/planted_server.py", "--fault", "skip", "--gap-ms", "5") as target:
        result = tokens_bench(target, streams=4, max_tokens=10)
    assert result.integrity.lost_tokens == 4


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, rule",
    [
        ("pause", dx.RULE_STREAMS_STALL_TOGETHER),
        ("setup", dx.RULE_TTFT_GROWS_WITH_STREAMS),
        ("none", None),
    ],
)
def test_planted_faults_without_server_timing(fault, rule):
    """A blocked event loop stalls every stream at once; a per-call lock makes TTFT grow
    across a burst; a clean server trips nothing."""
    with python_server("tests/planted_server.py", "--fault", fault) as target:
        result = tokens_bench(target, streams=32, requests=64, max_tokens=50)
    assert_clean(result, 64)
    assert_named(result, {rule} if rule else set())


@pytest.mark.slow
def test_worked_example_designs():
    """The note's "before" (16 streams on 4 threads) makes streams wait for a thread, which
    the lab names; the "after" design serves all 16 at once and trips nothing."""
    example = [str(EXAMPLE), "--step-ms", "10", "--threads", "4"]
    with python_server(*example, "--design", "shared") as target:
        shared = tokens_bench(target, streams=16, max_tokens=30)
    with python_server(*example, "--design", "per-request") as target:
        per_request = tokens_bench(target, streams=16, max_tokens=30)
    assert_clean(shared, 16)
    assert_clean(per_request, 16)
    assert_named(shared, {dx.RULE_TTFT_GROWS_WITH_STREAMS})
    assert shared.timeline.concurrency.peak_receiving == 4
    assert_named(per_request, set())
    assert per_request.ttft_ms.max < shared.ttft_ms.max / 3


@pytest.mark.slow
def test_sweep_of_a_server_command(tmp_path):
    out = tmp_path / "sweep.json"
    started = time.monotonic()
    done = cadence(
        "sweep",
        "--server-cmd",
        f"{sys.executable} {EXAMPLE} --design shared --step-ms 10 --threads {{threads}} "
        "--port {port}",
        "--vary",
        "threads=2,oops,16",
        "--protocol",
        "grpc",
        "--method",
        TOKENS_METHOD,
        "--request-json",
        TOKENS_REQUEST,
        "--index-field",
        "index",
        "--concurrency",
        "8",
        "--max-tokens",
        "20",
        "--ready-timeout",
        "20",
        "--json",
        str(out),
        "--report",
        str(tmp_path / "report"),
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 90
    sweep = msgspec.convert(json.loads(out.read_text()), SweepResult).sweep
    assert sweep.variable == "threads" and "{threads}" in sweep.server_cmd
    by_value = {p.value: p for p in sweep.points}
    assert by_value["oops"].repeats == []
    assert "exited with status 2 before it was ready" in by_value["oops"].failures[0]
    two, sixteen = by_value["2"].repeats[0], by_value["16"].repeats[0]
    assert two.requests_ok == sixteen.requests_ok == 8
    # 8 streams on 2 threads wait for each other; on 16 threads none waits.
    assert two.ttft_ms.p99 > 3 * sixteen.ttft_ms.p99
    assert "oops" in done.stdout and (tmp_path / "report" / "report.html").is_file()
    html = (tmp_path / "report" / "report.html").read_text()
    assert "Runs that failed" in html


def _group_gone(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.shares_host
def test_a_server_command_is_stopped_with_its_whole_process_group():
    """The command's shell starts a child that ignores SIGTERM: after the grace it is killed
    with the rest of the group."""
    command = (
        f"trap '' TERM; sleep 300 & exec {sys.executable} tests/planted_server.py --port {{port}}"
    )
    server = CommandServer(command, {}, ready_timeout=20, grace_s=1.0)
    server.start()
    group = server.process.pid
    assert not _group_gone(group)
    started = time.monotonic()
    server.stop()
    assert _group_gone(group)
    assert 1.0 <= time.monotonic() - started < 5


@pytest.mark.shares_host
def test_a_server_command_that_never_answers_is_given_up():
    server = CommandServer("echo starting; sleep 300", {}, ready_timeout=1.0, grace_s=1.0)
    with pytest.raises(RuntimeError, match=r"not ready within 1 s .*its last output: starting"):
        server.start()
