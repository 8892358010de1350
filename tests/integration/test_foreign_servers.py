"""A server cadence did not write, explained: planted grpc-python servers, each with one limit
or fault, and the rule that must name it (and no other rule that would mislead)."""

from __future__ import annotations

import grpc
import pytest

from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.grpc_schema import from_reflection
from cadence.lab.load.grpc_service import GrpcTarget
from cadence.lab.load.plan import RequestShape
from cadence.lab.measure.http2 import read_settings
from cadence.lab.results import BenchResult
from tests.integration.test_grpc_lab import TOKENS_METHOD, TOKENS_REQUEST, python_server


def tokens_bench(
    target: str,
    streams: int,
    channels: int = 1,
    tokens_field: str = "",
    requests: int | None = None,
) -> BenchResult:
    with grpc.insecure_channel(target) as channel:
        schema = from_reflection(channel, TOKENS_METHOD)
    protocol = GrpcTarget(
        schema=schema, request_json=TOKENS_REQUEST, index_field="index", tokens_field=tokens_field
    )
    workload = Workload(
        requests=requests or streams, concurrency=streams, shape=RequestShape(max_tokens=(20, 20))
    )
    return run_bench(target, workload, channels=channels, protocol=protocol)


def rules(result: BenchResult) -> set[str]:
    return {f.rule for f in result.diagnosis}


def test_a_stream_limit_below_the_streams_per_connection_is_named() -> None:
    with python_server("tests/planted_server.py", "--max-streams", "4", "--gap-ms", "10") as target:
        limited = tokens_bench(target, streams=16)
        spread = tokens_bench(target, streams=16, channels=4)
    assert limited.http2.max_concurrent_streams == 4 and limited.http2.error is None
    assert "server_stream_limit" in rules(limited), limited.diagnosis
    assert "ttft_grows_with_streams" not in rules(limited)  # the limit, not call set-up
    [finding] = [f for f in limited.diagnosis if f.rule == "server_stream_limit"]
    assert finding.evidence["streams_per_connection"] == 16
    assert "--channels 4" in finding.look_at
    # grpc-python's server refuses some calls over its limit (RST_STREAM, REFUSED_STREAM):
    # counted, and said to be the limit's doing.
    refused = finding.evidence["refused_calls"]
    assert limited.requests_ok + refused == 16
    assert ("REFUSED_STREAM" in finding.finding) == (refused > 0)
    assert "server_stream_limit" not in rules(spread), spread.diagnosis  # 4 per connection


def test_settings_of_a_server_without_limits() -> None:
    with python_server("tests/planted_server.py") as target:
        settings = read_settings(target)
    assert settings.error is None and settings.max_concurrent_streams is None
    assert settings.initial_window_size and settings.max_frame_size


def test_a_port_that_is_not_http2_is_said_so() -> None:
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    settings = read_settings(f"127.0.0.1:{port}")
    assert settings.error and "refused" in settings.error.lower()


@pytest.mark.alone  # a thread at its core is seen only where no other test takes the cores
def test_a_server_held_to_one_core_by_its_event_loop_is_named() -> None:
    with python_server(
        "tests/planted_server.py", "--fault", "cpu", "--cpu-ms", "2", "--gap-ms", "10"
    ) as target:
        result = tokens_bench(target, streams=16)
    threads = result.server_threads
    assert threads is not None and threads.threads >= 2
    [process] = threads.processes
    assert process.python
    assert process.busiest_thread_cpu_pct + process.busiest_thread_wait_pct > 80
    assert "server_one_core_bound" in rules(result), result.diagnosis
    [finding] = [f for f in result.diagnosis if f.rule == "server_one_core_bound"]
    assert finding.evidence["pid"] == process.pid


def test_a_clean_foreign_server_names_nothing_about_its_threads() -> None:
    with python_server("tests/planted_server.py", "--gap-ms", "10") as target:
        result = tokens_bench(target, streams=16)
    assert result.server_threads is not None and result.server_threads.groups
    assert not rules(result) & {
        "server_one_core_bound",
        "server_threads_wait_for_cpu",
        "server_stream_limit",
    }, result.diagnosis


SHAPE_RULES = {"output_held_back", "slow_stream_group", "slow_first_message"}


def test_output_held_back_and_sent_in_batches_is_named() -> None:
    with python_server(
        "tests/planted_server.py", "--fault", "batch", "--batch", "4", "--gap-ms", "5"
    ) as target:
        result = tokens_bench(target, streams=8, tokens_field="count")
    assert result.integrity.lost_tokens == 0 and result.chunk_tokens.p50 == 4
    assert rules(result) & SHAPE_RULES == {"output_held_back"}, result.diagnosis


def test_a_slower_subset_of_streams_is_named() -> None:
    with python_server(
        "tests/planted_server.py", "--fault", "slow-subset", "--gap-ms", "8"
    ) as target:
        result = tokens_bench(target, streams=16)
    assert rules(result) & SHAPE_RULES == {"slow_stream_group"}, result.diagnosis
    [finding] = [f for f in result.diagnosis if f.rule == "slow_stream_group"]
    assert finding.evidence["slow_streams"] == 4 and finding.evidence["streams"] == 16


def test_a_long_wait_before_every_first_message_is_named() -> None:
    with python_server(
        "tests/planted_server.py", "--fault", "first", "--first-ms", "150", "--gap-ms", "5"
    ) as target:
        result = tokens_bench(target, streams=8)
    assert rules(result) & SHAPE_RULES == {"slow_first_message"}, result.diagnosis
    assert "ttft_grows_with_streams" not in rules(result)


def test_a_clean_server_has_no_shape_finding() -> None:
    with python_server("tests/planted_server.py", "--gap-ms", "8") as target:
        plain = tokens_bench(target, streams=16)
        counted = tokens_bench(target, streams=16, tokens_field="count")
    assert not rules(plain) & SHAPE_RULES, plain.diagnosis
    assert not rules(counted) & SHAPE_RULES, counted.diagnosis


def test_a_grpc_js_server_is_explained_the_same_way(tmp_path) -> None:
    """Another gRPC implementation (Node's grpc-js): a long first wait, then three words per
    message on a 10 ms timer."""
    from tests.integration.test_grpc_lab import bench_json, count_args
    from tests.node_ticker import ticker_server

    with ticker_server() as target:
        result = bench_json(
            tmp_path,
            target,
            "--method",
            count_args()[1],
            "--request-json",
            '{"count": "{max_tokens}", "first_delay_ms": 300, "gap_ms": 10, '
            '"words_per_tick": 3, "label": "{request_id}"}',
            "--tokens-field",
            "words",
            "--index-field",
            "first_word",
            "--concurrency",
            "8",
            "--max-tokens",
            "20",
        )
    assert rules(result) & SHAPE_RULES == {"output_held_back", "slow_first_message"}, (
        result.diagnosis
    )
    assert result.server_threads is not None and result.http2.error is None


def test_py_spy_says_what_a_python_servers_threads_are_doing() -> None:
    """The worked example's sync pool: every handler thread sits in the shared queue's wait,
    called from the handler's own code."""
    import subprocess

    import pytest

    from cadence.lab.measure.stacks import py_spy
    from tests.integration.test_grpc_lab import EXAMPLE

    command = py_spy()
    if command is None:
        pytest.skip("py-spy is not installed (pip install 'cadence[lab]')")
    probe = subprocess.run(
        [command, "dump", "--pid", str(__import__("os").getpid())],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"py-spy cannot read processes here (ptrace): {probe.stderr.strip()[:200]}")
    with python_server(
        str(EXAMPLE), "--step-ms", "10", "--threads", "4", "--design", "shared"
    ) as target:
        result = tokens_bench(target, streams=16, requests=48)
    stacks = {g.name: g for g in result.server_threads.stacks or []}
    handlers = stacks["handler_N"]
    assert handlers.threads == 4 and handlers.samples >= 4
    assert any(s.code and "next_token" in s.code for s in handlers.spots), handlers
