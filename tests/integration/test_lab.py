"""The lab against real servers: bench, baseline, sweep and report, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.load.processes import RequestCounter
from cadence.lab.results import BenchResult, to_builtins
from cadence.lab.sweep import Load, grid, run_sweep
from tests.integration.conftest import start_server, wait_until


def test_bench_measures_the_step_time_of_a_synthetic_server() -> None:
    with start_server("--devices", "cpu:2", "--step-ms", "20", "--metrics-port", "0") as server:
        workload = Workload(requests=16, concurrency=16, shape=RequestShape(max_tokens=(30, 30)))
        result = run_bench(server.target, workload, baseline=True)
    # Behaviour, not speed: the median gap is the engine's step, loosely.
    assert 15.0 < result.itl_ms.p50 < 30.0
    assert result.requests_ok == 16 and result.errors_by_code == {}
    assert result.output_tokens == 16 * 30
    assert all(v == 0 for v in msgspec.structs.asdict(result.integrity).values())
    segments = result.ttft_segments_ms
    assert sum(s.mean for s in msgspec.structs.asdict(segments).values()) == pytest.approx(
        result.ttft_ms.mean
    )
    assert {"front", "worker0", "worker1", "client0"} <= set(result.system.processes)
    scraped = result.system.server_metrics
    assert scraped.during_run["cadence_output_tokens_total"] == 16 * 30
    assert scraped.front_loop.samples >= 1  # the front's event-loop lag, per heartbeat
    assert 0 <= scraped.front_loop.late_over_20ms <= scraped.front_loop.samples
    assert result.baseline.workers == 2
    assert result.baseline.output_tokens == 16 * 30
    assert 15.0 < result.baseline.itl_ms.p50 < 30.0
    assert set(result.overhead_ms) == {"ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"}
    json.dumps(to_builtins(result))


def test_open_loop_sends_the_scheduled_requests() -> None:
    with start_server("--step-ms", "5") as server:
        workload = Workload(rate=40.0, duration_s=1.0, shape=RequestShape(max_tokens=(5, 5)))
        result = run_bench(server.target, workload, processes=2)
    assert result.requests == result.requests_ok > 10
    assert result.workload.rate == 40.0


def test_the_progress_counter_reaches_the_requests_the_result_reports() -> None:
    with start_server("--step-ms", "5") as server:
        workload = Workload(
            requests=12, concurrency=4, warmup=2, shape=RequestShape(max_tokens=(5, 5))
        )
        counter = RequestCounter()
        result = run_bench(server.target, workload, processes=2, counter=counter)
        plain = run_bench(server.target, workload, processes=2)
    # Every process's slot summed, warm-up requests not counted, like the records.
    assert counter.completed == result.requests == len(result.records) == 12
    assert counter.started_ns is not None
    # Counting leaves no trace in the result (nor so in --json).
    assert set(to_builtins(result)) == set(to_builtins(plain)) and result.workload == plain.workload


@pytest.mark.slow
def test_bench_and_report_commands(tmp_path) -> None:
    out = tmp_path / "run.json"
    with start_server("--step-ms", "5") as server:
        bench = subprocess.run(
            [
                sys.executable,
                "-m",
                "cadence.cli",
                "bench",
                "--target",
                server.target,
                "--concurrency",
                "4",
                "--requests",
                "8",
                "--max-tokens",
                "10",
                "--json",
                str(out),
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
    # stderr is a pipe here: no progress bar on it.
    assert "/8 requests" not in bench.stderr and "cadence bench" not in bench.stderr
    result = msgspec.convert(json.loads(out.read_text()), BenchResult)
    assert result.requests_ok == 8 and len(result.records) == 8
    report = subprocess.run(
        [sys.executable, "-m", "cadence.cli", "report", str(out), "--out", str(tmp_path / "r")],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (tmp_path / "r" / "report.html").exists()
    assert "report.html" in report.stdout


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a full disk)")
def test_a_result_the_disk_cannot_take_is_one_line_after_the_summary() -> None:
    """--json and --export pass the check before the run (/dev/full can be opened) and fail
    when written (no space left): the summary is printed, then one line, exit 1."""
    with start_server("--step-ms", "5") as server:
        for flag in ("--export", "--json"):
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "cadence.cli",
                    "bench",
                    "--target",
                    server.target,
                    "--concurrency",
                    "2",
                    "--requests",
                    "4",
                    "--max-tokens",
                    "4",
                    flag,
                    "/dev/full",
                ],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert done.returncode == 1, done.stderr
            assert done.stderr.strip().splitlines() == [
                f"cadence bench: {flag} /dev/full: cannot write it: No space left on device"
            ]
            assert "4/4 requests ok" in done.stdout, done.stdout


def test_sweep_starts_a_fresh_server_per_value() -> None:
    workload = Workload(requests=4, concurrency=4, shape=RequestShape(max_tokens=(8, 8)))
    result = run_sweep(
        grid([("workers", ["1", "2"])], Load(workload)), ["--step-ms", "5"], progress=lambda _: None
    )
    points = result.sweep.points
    assert [p.value for p in points] == ["1", "2"]
    workers = [sum(n.startswith("worker") for n in p.repeats[0].system.processes) for p in points]
    assert workers == [1, 2]
    assert [row.value for row in result.sweep.table] == ["1", "2"]


def test_the_front_exports_its_event_loop_lag() -> None:
    import urllib.request

    with start_server(
        "--step-ms", "5", "--metrics-port", "0", "--heartbeat-interval", "0.05"
    ) as server:

        def samples() -> float:
            text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
            return next(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("cadence_event_loop_lag_seconds_count")
            )

        wait_until(lambda: samples() >= 5, 10, "fewer than 5 samples")  # one per heartbeat
