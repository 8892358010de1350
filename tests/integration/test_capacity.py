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
    done = subprocess.run([sys.executable, "-m", "cadence.cli", "capacity",
                           "--json", str(out), *args], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, check=False)
    return (json.loads(out.read_text())["capacity"] if out.exists() else {}), done


@pytest.mark.slow
def test_a_batch_limit_is_found_exactly_and_named_as_queueing(tmp_path) -> None:
    """--max-batch 4 with 40-token streams: a fifth stream waits a whole stream (400 ms) for
    a place. The SLO (200 ms) sits far from both sides of the knee: a loaded host's delays at
    four streams stay under it, and the fifth's wait is over it however fast the host."""
    with start_server("--devices", "cpu:1", "--step-ms", "10", "--max-batch", "4") as server:
        found, done = capacity(tmp_path, "--target", server.target, "--search", "concurrency",
                               "--slo", "ttft_p99_ms=200", "--low", "1", "--high", "32",
                               "--duration", "1", "--max-tokens", "40")
    assert done.returncode == 0, done.stderr
    assert (found["max_passing"], found["first_failing"]) == (4, 5)
    assert found["binding"] == ["ttft_p99_ms"] and found["runs"] <= 8
    assert "queue grew the most" in found["knee"]
    assert {p["value"] for p in found["points"]} >= {1, 4, 5, 32}
    assert "capacity: concurrency 4 meets the SLO" in done.stdout
    assert f"search: {found['runs']} runs in" in done.stdout
    # The load curve and every run, in the report.
    report = subprocess.run([sys.executable, "-m", "cadence.cli", "report",
                             str(tmp_path / "capacity.json"), "--out", str(tmp_path / "r")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "r" / "report.html").read_text()
    assert "Where capacity stops" in page and "queue grew the most" in page
    assert (tmp_path / "r" / "capacity.png").stat().st_size > 10_000


@pytest.mark.slow
def test_a_foreign_thread_pool_is_found_exactly(tmp_path) -> None:
    """The worked example's sync server with a pool of 4 threads: a fifth stream waits for a
    thread, a whole stream long (400 ms, against an SLO of 200 ms)."""
    with python_server(str(EXAMPLE), "--step-ms", "10", "--threads", "4",
                       "--design", "shared") as target:
        found, done = capacity(tmp_path, "--target", target, "--protocol", "grpc",
                               "--method", TOKENS_METHOD, "--request-json", TOKENS_REQUEST,
                               "--search", "concurrency", "--slo", "ttft_p99_ms=200",
                               "--low", "1", "--high", "16", "--duration", "1",
                               "--max-tokens", "40")
    assert done.returncode == 0, done.stderr
    assert (found["max_passing"], found["first_failing"]) == (4, 5)
    assert found["runs"] <= 8


def test_bad_arguments_are_one_line(tmp_path) -> None:
    for args, said in ((["--slo", "ttft_p95_ms=1"], "METRIC_STAT_ms=BOUND"),
                       (["--slo", "ttft_p99_ms=1", "--low", "8", "--high", "4"], "--low"),
                       (["--slo", "ttft_p99_ms=1", "--scrape", "http://127.0.0.1:1/metrics"],
                        "--scrape http://127.0.0.1:1/metrics: ")):
        _, done = capacity(tmp_path, "--target", "127.0.0.1:1", "--search", "concurrency",
                           "--requests", "4", *args)
        assert done.returncode != 0 and said in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
