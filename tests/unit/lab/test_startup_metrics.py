"""Start-up metrics: the front's gauges and restart counter, the lab's scrape of them (one
front and `--fronts N`), and the start-up lines of the bench summary and the HTML report."""

from __future__ import annotations

from pathlib import Path

import msgspec
from prometheus_client import generate_latest

from cadence.core.metrics import FrontMetrics
from cadence.lab.analysis.startup import worker_startup
from cadence.lab.analysis.stats import summarize
from cadence.lab.measure.scrape import scrape
from cadence.lab.report.run import render_report
from cadence.lab.report.summary import print_summary, startup_lines
from cadence.lab.results import BenchResult


def _started(workers: int = 2) -> FrontMetrics:
    m = FrontMetrics()
    for w in range(workers):
        m.worker_started(w, load_s=2.5 + w, warmup_s=0.4, first_step_s=0.3, warm_step_s=0.02)
    return m


def _scrape_of(m: FrontMetrics, others: list[tuple[int, str]] | None = None) -> dict[str, float]:
    port = m.serve(0, "127.0.0.1", (lambda: others) if others is not None else None)
    try:
        return scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        m.close()


def test_start_up_gauges_and_restarts_are_scraped_per_worker() -> None:
    m = _started()
    restarts, delays = [0, 0], [0.0, 0.0]
    m.watch_restarts(restarts, delays)
    restarts[1], delays[1] = 2, 4.0  # read at scrape time, as the supervisor changes them
    m.worker_started(1, load_s=1.25, warmup_s=0.5, first_step_s=0.25, warm_step_s=0.01)
    values = _scrape_of(m)
    assert values["cadence_worker_load_seconds{worker=0}"] == 2.5
    assert values["cadence_worker_load_seconds{worker=1}"] == 1.25  # the restart overwrote it
    assert values["cadence_worker_warmup_seconds{worker=1}"] == 0.5
    assert values["cadence_worker_first_step_seconds{worker=0}"] == 0.3
    assert values["cadence_worker_warm_step_seconds{worker=0}"] == 0.02
    assert values["cadence_worker_restarts_total{worker=0}"] == 0
    assert values["cadence_worker_restarts_total{worker=1}"] == 2
    backoff = m.registry.get_sample_value
    assert backoff("cadence_worker_restart_backoff_seconds", {"worker": "0"}) == 0
    assert backoff("cadence_worker_restart_backoff_seconds", {"worker": "1"}) == 4


def test_no_restart_samples_before_the_supervisor_is_handed_over() -> None:
    text = generate_latest(FrontMetrics().registry).decode()
    assert "# TYPE cadence_worker_restarts_total counter" in text
    assert "cadence_worker_restarts_total{" not in text


def test_start_up_over_fronts_is_the_workers_not_a_sum() -> None:
    front0 = _started()
    front0.watch_restarts([1, 0])
    front1 = _started()  # the same WorkerReady reached it; no supervisor, so no restarts
    values = _scrape_of(front0, [(1, generate_latest(front1.registry).decode())])
    assert values["cadence_worker_load_seconds{front=0,worker=0}"] == 2.5
    assert values["cadence_worker_load_seconds{front=1,worker=0}"] == 2.5
    assert values["cadence_worker_load_seconds{worker=0}"] == 2.5
    assert values["cadence_worker_load_seconds{worker=1}"] == 3.5
    assert values["cadence_worker_restarts_total{worker=0}"] == 1
    rows = worker_startup({"samples": [[0.0, values]]})
    assert [r["worker"] for r in rows] == [0, 1]  # per-front copies are not extra workers


def test_worker_startup_reads_the_last_scrape_and_restarts_during_the_run() -> None:
    first = {
        "cadence_worker_load_seconds{worker=0}": 3.0,
        "cadence_worker_restarts_total{worker=0}": 1.0,
        "cadence_output_tokens_total": 0.0,
    }
    last = {
        "cadence_worker_load_seconds{worker=0}": 2.0,
        "cadence_worker_warmup_seconds{worker=0}": 0.5,
        "cadence_worker_restarts_total{worker=0}": 3.0,
        "cadence_worker_restarts_total{worker=1}": 0.0,
        "cadence_output_tokens_total": 90.0,
    }
    rows = worker_startup({"samples": [[0.0, first], [1.0, last]]})
    assert rows[0] == {
        "worker": 0,
        "load_s": 2.0,
        "warmup_s": 0.5,
        "first_step_s": None,
        "warm_step_s": None,
        "restarts": 3.0,
        "restarts_during_run": 2.0,
    }
    assert rows[1]["load_s"] is None and rows[1]["restarts_during_run"] == 0.0
    assert worker_startup(None) == [] and worker_startup({"samples": []}) == []
    assert worker_startup({"samples": [[0.0, {"cadence_active_streams": 1.0}]]}) == []


def test_startup_lines_show_load_warm_up_and_cold_against_warm_step() -> None:
    rows = [
        {
            "worker": 0,
            "load_s": 2.5,
            "warmup_s": 0.4,
            "first_step_s": 0.3125,
            "warm_step_s": 0.0021,
            "restarts": 0.0,
            "restarts_during_run": 0.0,
        },
        {
            "worker": 1,
            "load_s": 1.25,
            "warmup_s": 0.05,
            "first_step_s": 0.0004,
            "warm_step_s": None,
            "restarts": 2.0,
            "restarts_during_run": 1.0,
        },
        {
            "worker": 2,
            "load_s": None,
            "warmup_s": None,
            "first_step_s": None,
            "warm_step_s": None,
            "restarts": 0.0,
            "restarts_during_run": 0.0,
        },
    ]
    assert startup_lines(rows) == [
        "start-up worker 0: load 2500 ms, warm-up 400 ms (first step 312 ms vs warm step 2.1 ms)",
        (
            "start-up worker 1: load 1250 ms, warm-up 50.0 ms (first step 0.40 ms vs warm step ?); "
            "2 restarts, 1 during the run (the values are of the last start)"
        ),
    ]


def _result_with_startup() -> dict:
    result = msgspec.to_builtins(summarize([]))
    result["workload"] = {"target": "127.0.0.1:1", "requests": 0}
    result["client"] = {
        "processes": 1,
        "cpu_s": 0.0,
        "cpu_per_chunk_us": 0.0,
        "busiest_process_cpu_share": 0.1,
    }
    values = {
        "cadence_worker_load_seconds{worker=0}": 2.5,
        "cadence_worker_warmup_seconds{worker=0}": 0.4,
        "cadence_worker_first_step_seconds{worker=0}": 0.3,
        "cadence_worker_warm_step_seconds{worker=0}": 0.02,
        "cadence_worker_restarts_total{worker=0}": 0.0,
    }
    result["system"] = {
        "processes": {},
        "gpus": [],
        "flags": [],
        "server_metrics": {
            "url": "http://127.0.0.1:2/metrics",
            "scrapes": 1,
            "peaks": {},
            "during_run": {
                "cadence_merged_steps_total": 0.0,
                "cadence_buffer_overflows_total": 0.0,
            },
            "samples": [[0.0, values]],
        },
    }
    return result


def test_bench_summary_prints_a_start_up_line(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at the terminal's width
    result = _result_with_startup()
    result["integrity"] = {
        "lost_tokens": 0,
        "repeated_tokens": 0,
        "reordered_chunks": 0,
        "short_streams": 0,
    }
    print_summary(msgspec.convert(result, BenchResult))
    out = capsys.readouterr().out
    assert (
        "start-up worker 0: load 2500 ms, warm-up 400 ms (first step 300 ms vs warm step "
        "20.0 ms)" in out
    )


def test_report_has_a_start_up_row_per_worker(tmp_path: Path) -> None:
    page = render_report(_result_with_startup(), tmp_path / "rep").read_text()
    assert "<h3>Worker start-up</h3>" in page
    assert "<td>worker 0</td><td>2500.00</td><td>400.00</td><td>300.00</td><td>20.00</td>" in page
    # an older result, without the gauges: no section
    older = _result_with_startup()
    older["system"]["server_metrics"]["samples"] = [[0.0, {}]]
    assert "Worker start-up" not in render_report(older, tmp_path / "old").read_text()
