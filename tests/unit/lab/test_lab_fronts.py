"""The lab with `--fronts N`: front 0's all-fronts /metrics page read as whole-server values,
and the front_cpu_bound rule looking at every front."""

from __future__ import annotations

import msgspec
from prometheus_client import generate_latest

from cadence.core.metrics import FrontMetrics
from cadence.lab.analysis import diagnosis as dx
from cadence.lab.analysis.diagnosis.host import front_cpu_bound
from cadence.lab.measure.scrape import scrape
from cadence.lab.results import BenchResult


def _fronts_page(own: FrontMetrics, others: list[FrontMetrics]) -> tuple[FrontMetrics, str]:
    """Front 0's endpoint showing `others` as fronts 1, 2, ...; returns it and its URL."""
    texts = [(k, generate_latest(m.registry).decode()) for k, m in enumerate(others, 1)]
    port = own.serve(0, "127.0.0.1", lambda: texts)
    return own, f"http://127.0.0.1:{port}/metrics"


def _metrics(tokens: int, chunks: int, batch: int, active: float, deepest: float) -> FrontMetrics:
    m = FrontMetrics()
    m.tally.tokens += tokens
    m.tally.chunks += chunks
    m.batch_size.labels("0").set(batch)
    m.watch(active=lambda: active, deepest_buffer=lambda: deepest)
    return m


def test_scrape_of_all_fronts_keeps_each_front_and_combines_them() -> None:
    front0, url = _fronts_page(_metrics(100, 40, 3, 2, 5), [_metrics(60, 30, 4, 1, 9)])
    try:
        values = scrape(url)
    finally:
        front0.close()
    assert values["cadence_output_tokens_total{front=0}"] == 100
    assert values["cadence_output_tokens_total{front=1}"] == 60
    assert values["cadence_output_tokens_total"] == 160  # counters add up
    assert values["cadence_chunks_total"] == 70
    assert values["cadence_active_streams"] == 3  # each front counts its own streams
    assert values["cadence_worker_batch_size{worker=0}"] == 7  # each its share of the batch
    assert values["cadence_deepest_buffer_steps"] == 9  # the fullest buffer of any front


def test_scrape_of_one_front_has_no_front_label() -> None:
    m = _metrics(10, 5, 2, 1, 0)
    url = f"http://127.0.0.1:{m.serve(0, '127.0.0.1')}/metrics"
    try:
        values = scrape(url)
    finally:
        m.close()
    assert values["cadence_output_tokens_total"] == 10
    assert values["cadence_worker_batch_size{worker=0}"] == 2
    assert not any("front=" in key for key in values)


def _cpu(pct: float) -> dict:
    """An idle start (3 s) and then 0.6 s of run at `pct`, a sample every 0.1 s."""
    samples = [[round(0.1 * i, 1), 0.0] for i in range(1, 31)]
    samples += [[round(3.0 + 0.1 * i, 1), pct] for i in range(1, 7)]
    return {"pid": 1, "cpu_pct_mean": None, "cpu_pct_max": None, "samples": samples}


def _run(processes: dict) -> dx.RunFacts:
    return dx.RunFacts(
        msgspec.convert(
            {
                "wall_s": 0.6,
                "chunks_per_s": 900.0,
                "system": {"interval_s": 0.1, "processes": processes},
            },
            BenchResult,
        )
    )


def test_one_busy_front_of_two_is_front_cpu_bound() -> None:
    (finding,) = front_cpu_bound(
        _run({"front0": _cpu(20.0), "front1": _cpu(95.0), "worker0": _cpu(30.0)})
    )
    assert finding.rule == dx.RULE_FRONT_CPU_BOUND
    assert finding.evidence["front0_cpu_pct"] == 20.0
    assert finding.evidence["front1_cpu_pct"] == 95.0
    assert "front1 of 2 fronts" in finding.finding
    assert "--channels" in finding.look_at  # uneven connections, not too few fronts


def test_fronts_below_one_core_are_not_front_cpu_bound() -> None:
    assert (
        front_cpu_bound(
            _run({"front0": _cpu(60.0), "front1": _cpu(70.0), "frontend_proxy": _cpu(99.0)})
        )
        == []
    )


def test_one_front_keeps_its_evidence_name() -> None:
    (finding,) = front_cpu_bound(_run({"front": _cpu(90.0), "worker0": _cpu(10.0)}))
    assert finding.evidence == {"front_cpu_pct": 90.0, "chunks_per_s": 900.0}
    assert finding.finding.startswith("the front used 90% of a core")
