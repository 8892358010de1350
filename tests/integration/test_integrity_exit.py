"""A server whose output is not whole: counted right, named, and `cadence bench` exits non-zero
(issue 36: a swap once read as one lost, one repeated and one reordered, and the run exited 0)."""

from __future__ import annotations

import json

import msgspec

from cadence.lab.bench_cli import EXIT_INTEGRITY
from cadence.lab.results import BenchResult
from tests.engine_shaped_servers import MODEL
from tests.integration.test_grpc_lab import TOKENS_METHOD, TOKENS_REQUEST, cadence, python_server


def bench(tmp_path, target: str, *args: str):
    out = tmp_path / "run.json"
    done = cadence(
        "bench",
        "--target",
        target,
        "--protocol",
        "grpc",
        "--no-progress",
        "--method",
        TOKENS_METHOD,
        "--request-json",
        TOKENS_REQUEST,
        "--index-field",
        "index",
        "--concurrency",
        "4",
        "--max-tokens",
        "10",
        "--json",
        str(out),
        *args,
    )
    return done, msgspec.convert(json.loads(out.read_text()), BenchResult)


def test_a_swap_of_two_outputs_is_one_reorder_and_a_non_zero_exit(tmp_path) -> None:
    with python_server("tests/planted_server.py", "--fault", "swap", "--gap-ms", "5") as target:
        done, result = bench(tmp_path, target)
    integrity = result.integrity
    assert (integrity.lost_tokens, integrity.repeated_tokens, integrity.reordered_chunks) == (
        0,
        0,
        1,
    )
    assert done.returncode == EXIT_INTEGRITY, done.stderr
    assert "the output was not whole: reordered_chunks 1" in done.stderr
    [finding] = [f for f in result.diagnosis if f.rule == "integrity_faults"]
    assert finding.evidence["reordered_chunks"] == 1
    assert finding.evidence["streams_with_position_faults"] == 1
    assert "reordered 1" in done.stdout  # the summary's integrity line


def test_a_whole_output_exits_0(tmp_path) -> None:
    with python_server("tests/planted_server.py", "--gap-ms", "5") as target:
        done, result = bench(tmp_path, target)
    assert done.returncode == 0, done.stderr
    assert not [f for f in result.diagnosis if f.rule == "integrity_faults"]


def sse_bench(tmp_path, *server: str):
    """`cadence bench --protocol openai` on the engine-shaped SSE server (one event per token,
    then its usage), 8 streams of 10 tokens, the planted fault in each."""
    out = tmp_path / "run.json"
    with python_server(
        "tests/engine_shaped_servers.py", "--front", "sse", "--decode-ms", "2", *server
    ) as target:
        done = cadence(
            "bench",
            "--target",
            f"http://{target}",
            "--protocol",
            "openai",
            "--model",
            MODEL,
            "--no-progress",
            "--concurrency",
            "4",
            "--requests",
            "8",
            "--max-tokens",
            "10",
            "--json",
            str(out),
        )
    return done, msgspec.convert(json.loads(out.read_text()), BenchResult)


def test_an_sse_event_sent_twice_is_an_extra_event_whatever_usage_says(tmp_path) -> None:
    done, result = sse_bench(tmp_path, "--duplicate-event", "4")
    integrity = result.integrity
    assert (
        integrity.extra_events,
        integrity.lost_tokens,
        integrity.repeated_tokens,
        integrity.short_streams,
        integrity.usage_above_events,
    ) == (8, 0, 0, 0, 0)
    assert done.returncode == EXIT_INTEGRITY, done.stderr
    assert "the output was not whole: extra_events 8" in done.stderr
    [finding] = [f for f in result.diagnosis if f.rule == "integrity_faults"]
    assert finding.evidence["extra_events"] == 8
    assert "extra events 8" in done.stdout  # the summary's integrity line
    # Each text event is one position: the usage (10) is not spread over the 11 events.
    assert [len(r.tokens) for r in result.records] == [11] * 8
    assert {r.usage_outputs for r in result.records} == {10}


def test_an_sse_event_missing_is_reported_against_usage_not_spread_over(tmp_path) -> None:
    """Without positions of the server's own, one event missing and one event of two tokens
    look alike: the lab says usage counts 10 where 9 events arrived, as information."""
    done, result = sse_bench(tmp_path, "--drop-event", "4")
    integrity = result.integrity
    assert (integrity.usage_above_events, integrity.usage_above_events_streams) == (8, 8)
    assert (integrity.extra_events, integrity.lost_tokens, integrity.short_streams) == (0, 0, 0)
    assert done.returncode == 0, done.stderr
    [finding] = [f for f in result.diagnosis if f.rule == "usage_above_events"]
    assert "usage counts 80 outputs where 72 text events arrived" in finding.finding
    assert finding.evidence["first_such_request"]
    assert "usage counts 8 outputs more than the text events in 8 streams" in done.stdout
    # Positions are the events, not usage spread over them; the count of outputs delivered
    # (tokens/s) is the server's own where it says more.
    assert [sum(r.tokens) for r in result.records] == [9] * 8
    assert [r.output_tokens for r in result.records] == [10] * 8


def test_a_whole_sse_stream_stays_clean(tmp_path) -> None:
    done, result = sse_bench(tmp_path, "--jitter", "0.3", "--flush-events", "3")
    assert done.returncode == 0, done.stderr
    integrity = result.integrity
    assert (
        integrity.extra_events,
        integrity.usage_above_events,
        integrity.short_streams,
        integrity.lost_tokens,
        integrity.repeated_tokens,
    ) == (0, 0, 0, 0, 0)
    assert not [f for f in result.diagnosis if f.rule in ("integrity_faults", "usage_above_events")]
    assert "extra events 0" in done.stdout
