"""Goodput under a latency SLO: the terms, each request's own values, the run's percentiles."""

from __future__ import annotations

import math

import pytest

from cadence.lab.analysis.goodput import goodput, parse_term
from cadence.lab.analysis.stats import summarize
from cadence.lab.records import RequestRecord
from cadence.lab.results import SloTerm

MS = 1_000_000


def request(
    k: int, ttft_ms: float, gap_ms: float, tokens: int = 10, code: str = "OK"
) -> RequestRecord:
    arrival = [int((ttft_ms + i * gap_ms) * MS) for i in range(tokens)]
    return RequestRecord(
        request_id=f"r{k}",
        process=0,
        start_ns=0,
        end_ns=arrival[-1],
        code=code,
        max_tokens=tokens,
        finish_reason=1,
        arrival_ns=arrival,
        tokens=[1] * tokens,
        index=list(range(tokens)),
    )


def test_terms_parse_and_bad_ones_say_what_is_accepted() -> None:
    assert parse_term("ttft_p99_ms=150") == SloTerm(metric="ttft", stat="p99", bound_ms=150.0)
    assert parse_term("token_delay_max_ms=7.5") == SloTerm(
        metric="token_delay", stat="max", bound_ms=7.5
    )
    for bad in (
        "ttft_p95_ms=10",
        "latency_p99_ms=10",
        "ttft_p99=10",
        "ttft_p99_ms=0",
        "ttft_p99_ms=fast",
    ):
        with pytest.raises(ValueError, match="METRIC_STAT_ms=BOUND|positive"):
            parse_term(bad)


def test_a_request_is_good_when_its_own_values_meet_every_term() -> None:
    records = (
        [request(k, 50.0, 10.0) for k in range(6)]  # good
        + [request(6, 300.0, 10.0), request(7, 50.0, 60.0)]  # slow start; slow gaps
        + [request(8, 50.0, 10.0, code="UNAVAILABLE")]
    )  # failed
    terms = [parse_term("ttft_p99_ms=100"), parse_term("itl_p90_ms=20")]
    stats = summarize(records)
    result = goodput(records, terms, stats)
    assert result.good_requests == 6
    assert result.good_share == pytest.approx(6 / 9)
    assert result.tokens_per_s == pytest.approx(60 / stats.wall_s)
    ttft = result.terms["ttft_p99_ms"]
    assert ttft.bound_ms == 100 and ttft.measured_ms == stats.ttft_ms.p99 and not ttft.met
    assert not result.passed


def test_the_run_passes_when_its_percentiles_meet_every_term() -> None:
    records = [request(k, 50.0, 10.0) for k in range(20)]
    result = goodput(
        records, [parse_term("ttft_p99_ms=60"), parse_term("e2e_max_ms=200")], summarize(records)
    )
    assert result.passed and result.good_share == 1.0
    assert all(t.met for t in result.terms.values())


def test_a_term_without_data_does_not_pass_the_run() -> None:
    records = [request(k, 50.0, 10.0) for k in range(4)]  # no server timing: no token delay
    result = goodput(records, [parse_term("token_delay_p99_ms=5")], summarize(records))
    assert math.isnan(result.terms["token_delay_p99_ms"].measured_ms)
    assert not result.passed and result.good_share == 1.0
