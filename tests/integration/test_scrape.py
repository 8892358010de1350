"""`cadence bench --scrape URL` against real pages: a stand-in for a foreign server's metrics
endpoint written as vLLM writes its own (tests/vllm_metrics_page.py, a process of its own),
and a real cadence server's metrics port; and URLs that cannot be read."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.report.run import render_report
from cadence.lab.results import BenchResult
from tests.integration.conftest import start_server
from tests.integration.test_grpc_lab import python_server


def test_bench_scrapes_a_foreign_page_into_series_roles_and_the_diagnosis(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    with (
        python_server("tests/vllm_metrics_page.py", "--batch", "4") as page,
        start_server("--step-ms", "10") as server,
    ):
        url = f"http://{page}/metrics"
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
                "--duration",
                "2",
                "--max-tokens",
                "20",
                "--scrape",
                url,
                "--json",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert bench.returncode == 0, bench.stderr
    written = json.loads(out.read_text())
    scraped = written["scraped"]
    assert set(scraped) == {
        "interval_s",
        "started_ns",
        "run_window_s",
        "endpoints",
        "roles",
        "series",
    }
    (endpoint,) = scraped["endpoints"]
    assert endpoint["url"] == url and endpoint["server"] == "vllm"
    assert endpoint["scrapes"] >= 4 and endpoint["failed_scrapes"] == 0
    by_name = {(s["name"], s["kind"]): s for s in scraped["series"]}
    waiting = [v for _, v in by_name[("vllm:num_requests_waiting", "gauge")]["points"]]
    assert waiting == sorted(waiting) and waiting[-1] > waiting[0]  # it grows on the page
    tokens = [v for _, v in by_name[("vllm:generation_tokens_total", "rate")]["points"]]
    assert all(300 < v < 700 for v in tokens)  # 500 a second on the page's clock
    assert ("vllm:e2e_request_latency_seconds", "mean") in by_name
    roles = scraped["roles"]
    assert set(roles) == {"running", "waiting", "kv_cache_use"}
    assert roles["running"]["peak"] == 4 and roles["waiting"]["peak"] > 4
    start, end = scraped["run_window_s"]
    assert 0 < start < end and all(start - 1 < t for t, _ in roles["waiting"]["points"])
    # The page's batch is full and its queue grows: the foreign server's finding.
    result = msgspec.convert({k: v for k, v in written.items() if k != "records"}, BenchResult)
    assert "server_queue_grows" in {f.rule for f in result.diagnosis}
    assert f"scraped {url} (vllm): " in bench.stdout
    assert "the server's own metrics over the run: requests running peak 4" in bench.stdout
    page_html = render_report(written, tmp_path / "report").read_text()
    assert "own metrics (--scrape)" in page_html
    assert (tmp_path / "report" / "server_metrics.png").exists()


def test_bench_scrapes_cadence_own_metrics_port() -> None:
    with start_server("--devices", "cpu:2", "--step-ms", "10", "--metrics-port", "0") as server:
        host, port = re.search(r"metrics on (\S+):(\d+)", server.banner).groups()
        url = f"http://{host}:{port}/metrics"
        workload = Workload(requests=16, concurrency=8, shape=RequestShape(max_tokens=(40, 40)))
        result = run_bench(server.target, workload, scrape=[url])
    assert result.requests_ok == 16
    (endpoint,) = result.scraped.endpoints
    assert endpoint.server == "cadence" and endpoint.failed_scrapes == 0
    names = {(s.name, s.kind) for s in result.scraped.series}
    assert {
        ("cadence_worker_batch_size", "gauge"),
        ("cadence_output_tokens_total", "rate"),
        ("cadence_time_to_first_token_seconds", "mean"),
    } <= names
    running = result.scraped.roles["running"]
    assert running.metric == "cadence_worker_batch_size" and 1 <= running.peak <= 8
    # The lab's own reading of cadence's page (found from the server's command line) goes on
    # beside it.
    assert result.system.server_metrics.scrapes >= 1


@pytest.mark.shares_host
def test_a_page_that_cannot_be_read_stops_the_bench_before_the_run() -> None:
    with python_server("tests/vllm_metrics_page.py") as page:
        for url, why in (
            (f"http://{page}/nope", "HTTP 404"),
            ("http://127.0.0.1:1/metrics", "Connection refused"),
            ("127.0.0.1:9100/metrics", "expected an http:// or https:// URL"),
        ):
            bench = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "cadence.cli",
                    "bench",
                    "--target",
                    "127.0.0.1:1",
                    "--requests",
                    "1",
                    "--scrape",
                    url,
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert bench.returncode != 0
            (line,) = bench.stderr.strip().splitlines()
            assert line.startswith(f"cadence bench: --scrape {url}: ") and why in line


def test_a_sweep_of_a_running_server_scrapes_every_run(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    with (
        python_server("tests/vllm_metrics_page.py") as page,
        start_server("--step-ms", "5") as server,
    ):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "cadence.cli",
                "sweep",
                "--target",
                server.target,
                "--vary",
                "concurrency=1,2",
                "--requests",
                "4",
                "--max-tokens",
                "8",
                "--scrape",
                f"http://{page}/metrics",
                "--json",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    runs = [p["repeats"][0] for p in json.loads(out.read_text())["sweep"]["points"]]
    assert [r["scraped"]["endpoints"][0]["server"] for r in runs] == ["vllm", "vllm"]
    assert all(r["scraped"]["roles"]["waiting"]["points"] for r in runs)
