"""Runs that never lie: `cadence bench` against real servers on 127.0.0.1 that die, answer
only errors, speak another protocol or serve on three ports, and an open loop that falls
behind its schedule. Each result says what happened, or the bench exits non-zero in one line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.measure.discovery import metrics_url
from tests.integration.conftest import start_server
from tests.integration.test_grpc_lab import TOKENS_METHOD, TOKENS_REQUEST, python_server

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cadence.cli", "bench", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )


def test_metrics_are_scraped_beside_an_http_port(tmp_path) -> None:
    """Three listening ports (gRPC, HTTP, metrics): the metrics page is the one scraped."""
    with start_server(
        "--http-port", "0", "--metrics-port", "0", "--devices", "cpu:1", "--step-ms", "2"
    ) as server:
        [metrics_port] = re.findall(r"\(metrics on \S+:(\d+)\)", server.banner)
        assert metrics_url(server.target).endswith(f":{metrics_port}/metrics")
        out = tmp_path / "run.json"
        done = bench(
            "--target",
            server.target,
            "--requests",
            "8",
            "--concurrency",
            "4",
            "--max-tokens",
            "8",
            "--json",
            str(out),
        )
        assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["system"]["server_metrics"]["scrapes"] > 0
    assert result["run"]["server_cmdline"][-4:] == ["--devices", "cpu:1", "--step-ms", "2"]
    assert "run: " in done.stdout


@pytest.mark.shares_host
@pytest.mark.parametrize("fault", ["errors", "die"])
def test_a_server_failing_mid_run_stops_the_bench(tmp_path, fault) -> None:
    """The run would go on for a minute; it stops once the failures leave no doubt."""
    out = tmp_path / "run.json"
    with python_server(
        "tests/planted_server.py", "--fault", fault, "--after-calls", "12", "--gap-ms", "1"
    ) as target:
        done = bench(
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
            "--concurrency",
            "4",
            "--duration",
            "60",
            "--max-tokens",
            "5",
            "--json",
            str(out),
        )
    assert done.returncode != 0
    [line] = done.stderr.splitlines()
    assert line.startswith("cadence bench: stopped early: ")
    result = json.loads(out.read_text())
    assert result["aborted"] == line.removeprefix("cadence bench: ")
    assert result["requests_ok"] >= 8  # the calls before the fault (the probe took one)
    assert result["wall_s"] < 30


@pytest.mark.shares_host
def test_default_protocol_at_another_grpc_service_says_so_before_the_run() -> None:
    with python_server("tests/planted_server.py", "--fault", "none") as target:
        done = bench("--target", target, "--requests", "4")
    assert done.returncode != 0
    [line] = done.stderr.splitlines()
    assert f"{target} does not speak --protocol cadence" in line
    assert "UNIMPLEMENTED" in line and "--protocol kserve, grpc, openai" in line
    assert "nan" not in done.stdout


def test_open_loop_reports_its_schedule() -> None:
    """A rate the client keeps, and one no client could (a million requests a second): the
    second is named as behind its schedule, with the lag it measured."""
    shape = RequestShape(max_tokens=(2, 2), prompt_tokens=(4, 4))
    with start_server("--devices", "cpu:1", "--step-ms", "1") as server:
        kept = run_bench(server.target, Workload(requests=20, rate=40.0, shape=shape))
        flooded = run_bench(server.target, Workload(requests=400, rate=1e6, shape=shape))
    client = kept.client
    assert client.offered_rate_per_s == 40.0
    assert 10 < client.achieved_rate_per_s < 160  # twenty Poisson arrivals
    assert client.schedule_lag_ms.count == 20
    assert client.behind_schedule is False, client.schedule_lag_ms
    behind = flooded.client
    assert behind.behind_schedule is True
    assert behind.achieved_rate_per_s < 1e6 / 10
    assert behind.schedule_lag_ms.p90 > 10
    assert kept.aborted is None
    run = kept.run
    assert datetime.fromisoformat(run.started_at).utcoffset().total_seconds() == 0
    assert run.cadence_version and run.grpcio_version and run.python_version
    assert run.cpu_count >= 1 and run.host
    assert "serve" in run.server_cmdline
    assert "client_behind_schedule" in {f.rule for f in flooded.diagnosis}
    assert "client_behind_schedule" not in {f.rule for f in kept.diagnosis}


@pytest.mark.slow
def test_goodput_under_an_slo(tmp_path) -> None:
    """A generous SLO passes, a strict one fails and says which term; goodput in the JSON and
    the summary; a bad term is one line."""
    with start_server("--devices", "cpu:1", "--step-ms", "5") as server:
        runs = {}
        for name, slo in (
            ("generous", ["ttft_p99_ms=5000", "itl_p99_ms=1000"]),
            ("strict", ["ttft_p99_ms=5000", "itl_p50_ms=1"]),
        ):
            out = tmp_path / f"{name}.json"
            done = bench(
                "--target",
                server.target,
                "--requests",
                "16",
                "--concurrency",
                "8",
                "--max-tokens",
                "10",
                "--json",
                str(out),
                *(arg for term in slo for arg in ("--slo", term)),
            )
            assert done.returncode == 0, done.stderr
            runs[name] = (json.loads(out.read_text())["goodput"], done.stdout)
        bad = bench("--target", server.target, "--requests", "1", "--slo", "ttft_p95_ms=10")
    generous, out = runs["generous"]
    assert generous["passed"] and generous["good_share"] == 1.0
    assert set(generous["terms"]) == {"ttft_p99_ms", "itl_p99_ms"}
    assert generous["requests_per_s"] > 0 and generous["tokens_per_s"] > 0
    assert "SLO passed" in out
    strict, out = runs["strict"]
    assert not strict["passed"] and not strict["terms"]["itl_p50_ms"]["met"]
    assert strict["terms"]["ttft_p99_ms"]["met"] and strict["good_share"] == 0.0
    assert "SLO FAILED" in out and "itl_p50_ms" in out and "NOT met" in out
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
    assert "METRIC_STAT_ms=BOUND" in bad.stderr
