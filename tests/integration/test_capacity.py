"""`cadence capacity` finds planted knees exactly, in a few runs, and names what binds them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import start_server
from tests.integration.test_grpc_lab import EXAMPLE, TOKENS_METHOD, TOKENS_REQUEST, python_server

ROOT = Path(__file__).resolve().parents[2]


def capacity(tmp_path: Path, *args: str) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / "capacity.json"
    done = subprocess.run(
        [sys.executable, "-m", "cadence.cli", "capacity", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        check=False,
    )
    return (json.loads(out.read_text())["capacity"] if out.exists() else {}), done


def batch_of_4(tmp_path: Path, high: int) -> tuple[dict, subprocess.CompletedProcess]:
    """`cadence capacity --search concurrency` from 1 to `high`, SLO TTFT p99 200 ms, 40-token
    streams, on a server of --max-batch 4 (10 ms steps)."""
    with start_server("--devices", "cpu:1", "--step-ms", "10", "--max-batch", "4") as server:
        return capacity(
            tmp_path,
            "--target",
            server.target,
            "--search",
            "concurrency",
            "--slo",
            "ttft_p99_ms=200",
            "--low",
            "1",
            "--high",
            str(high),
            "--duration",
            "1",
            "--max-tokens",
            "40",
        )


@pytest.mark.slow
def test_a_batch_limit_is_found_exactly_and_named_as_queueing(tmp_path) -> None:
    """--max-batch 4 with 40-token streams: a fifth stream waits a whole stream (400 ms) for
    a place. The SLO (200 ms) sits far from both sides of the knee: a loaded host's delays at
    four streams stay under it, and the fifth's wait is over it however fast the host."""
    found, done = batch_of_4(tmp_path, high=32)
    assert done.returncode == 0, done.stderr
    assert (found["max_passing"], found["first_failing"]) == (4, 5)
    assert found["binding"] == ["ttft_p99_ms"] and found["runs"] <= 16
    # Confirmed: 4 and 5, and the loads a step around them, on repeated runs.
    assert found["runs_by_value"]["4"] == [True] * 3 and found["runs_by_value"]["5"] == [False] * 3
    assert found["knee_spread"] == [4, 5] and found["range_edge"] is None
    assert "queue grew the most" in found["knee"]
    assert {p["value"] for p in found["points"]} >= {1, 4, 5, 32}
    assert "capacity: concurrency 4 meets the SLO" in done.stdout
    assert f"search: {found['runs']} runs in" in done.stdout
    # The load curve and every run, in the report.
    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "cadence.cli",
            "report",
            str(tmp_path / "capacity.json"),
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "r" / "report.html").read_text()
    assert "Where capacity stops" in page and "queue grew the most" in page
    assert (tmp_path / "r" / "capacity.png").stat().st_size > 10_000


@pytest.mark.slow
def test_a_foreign_thread_pool_is_found_exactly(tmp_path) -> None:
    """The worked example's sync server with a pool of 4 threads: a fifth stream waits for a
    thread, a whole stream long (400 ms, against an SLO of 200 ms)."""
    with python_server(
        str(EXAMPLE), "--step-ms", "10", "--threads", "4", "--design", "shared"
    ) as target:
        found, done = capacity(
            tmp_path,
            "--target",
            target,
            "--protocol",
            "grpc",
            "--method",
            TOKENS_METHOD,
            "--request-json",
            TOKENS_REQUEST,
            "--search",
            "concurrency",
            "--slo",
            "ttft_p99_ms=200",
            "--low",
            "1",
            "--high",
            "16",
            "--duration",
            "1",
            "--max-tokens",
            "40",
            "--confirm-runs",
            "1",  # the knee found, not confirmed: the batch-limit test holds the confirmation
        )
    assert done.returncode == 0, done.stderr
    assert (found["max_passing"], found["first_failing"]) == (4, 5)
    assert found["runs"] <= 16


def test_a_range_whose_top_passes_is_said_to_be_its_edge(tmp_path) -> None:
    """--high 3 on a server that takes 4: the answer is "at least 3", never "3" (issue 52:
    `--high 256` answered 256 after one run on a server whose knee was 46)."""
    found, done = batch_of_4(tmp_path, high=3)
    assert done.returncode == 0, done.stderr
    assert found["max_passing"] == 3 and found["range_edge"] == "high"
    assert found["runs_by_value"]["3"] == [True] * 3
    assert "at least 3: the top of the range searched; raise --high" in done.stdout


@pytest.mark.shares_host
def test_bad_arguments_are_one_line(tmp_path) -> None:
    for args, said in (
        (["--slo", "ttft_p95_ms=1"], "METRIC_STAT_ms=BOUND"),
        (["--slo", "ttft_p99_ms=1", "--low", "8", "--high", "4"], "--low"),
        (
            ["--slo", "ttft_p99_ms=1", "--scrape", "http://127.0.0.1:1/metrics"],
            "--scrape http://127.0.0.1:1/metrics: ",
        ),
    ):
        _, done = capacity(
            tmp_path, "--target", "127.0.0.1:1", "--search", "concurrency", "--requests", "4", *args
        )
        assert done.returncode != 0 and said in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_a_rising_rate_stops_at_the_knee_capacity_finds(tmp_path) -> None:
    """--max-batch 4, 10 steps of 10 ms a request: the server ends at most ~40 requests/s.
    A ramp with the over-saturation stop ends past the knee, within 25% of the rate that
    `cadence capacity` finds under a TTFT SLO (its queue takes off at the same load)."""
    from tests.integration.test_bench_honest import bench

    with start_server("--devices", "cpu:1", "--step-ms", "10", "--max-batch", "4") as server:
        out = tmp_path / "ramp.json"
        ramp = bench(
            "--target",
            server.target,
            "--rate",
            "20:80",
            "--ramp",
            "4",
            "--duration",
            "6",
            "--max-tokens",
            "10",
            "--saturation-stop",
            "0.5",
            "--json",
            str(out),
        )
        found, done = capacity(
            tmp_path,
            "--target",
            server.target,
            "--search",
            "rate",
            "--slo",
            "ttft_p99_ms=100",
            "--low",
            "30",
            "--high",
            "60",
            "--duration",
            "1",
            "--max-tokens",
            "10",
            "--confirm-runs",
            "1",
        )
    assert ramp.returncode == 0 and done.returncode == 0, ramp.stderr + done.stderr
    seen = json.loads(out.read_text())["saturation"]
    assert seen["stopped"] and seen["stopped_at_s"] < 5, seen
    assert "over-saturation stop: the server stopped keeping up at" in ramp.stdout
    assert 0.75 * found["max_passing"] <= seen["knee_rate_per_s"] <= 1.25 * found["max_passing"]
    # The run stopped sending at the knee: no request went out after it.
    assert seen["stopped_at_s"] < 6 and seen["peak_achieved_rate_per_s"] <= 50
