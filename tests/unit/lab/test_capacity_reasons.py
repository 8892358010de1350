"""`cadence capacity`: every binding term comes with its reason (issue 36: `itl_p99_ms` was
named binding with an empty reason)."""

from __future__ import annotations

from cadence.lab.analysis.goodput import parse_term
from cadence.lab.analysis.verdict import judge
from cadence.lab.capacity import search
from cadence.lab.results import BenchResult, Distribution, Finding, Goodput, TermResult

SLO = [parse_term("itl_p99_ms=30")]


def run_at(itl_p50: float, itl_p99: float, findings: list[Finding] = (), errors: int = 0):
    def run(value: float) -> BenchResult:
        result = BenchResult(
            requests=64,
            requests_ok=64 - errors,
            errors_by_code={"UNAVAILABLE": errors} if errors else {},
            first_error_by_code={"UNAVAILABLE": "gone"} if errors else {},
            itl_ms=Distribution(
                count=2000, mean=itl_p50, p50=itl_p50, p90=itl_p99, p99=itl_p99, max=itl_p99
            ),
            diagnosis=list(findings),
        )
        met = itl_p99 <= 30 or value <= 1
        result.goodput = Goodput(
            passed=met,
            terms={
                "itl_p99_ms": TermResult(
                    bound_ms=30, measured_ms=itl_p99 if value > 1 else 10, met=met
                )
            },
        )
        result.verdict, unexplained = judge(result)
        result.diagnosis += unexplained
        return result

    return run


def test_a_median_over_the_bound_is_said_to_be_no_tail() -> None:
    capacity = search(
        run_at(itl_p50=40, itl_p99=44), "concurrency", 1, 2, SLO, progress=lambda _: None
    )
    assert capacity.binding == ["itl_p99_ms"]
    assert "not a tail of a few: the median is 40.0 ms" in capacity.reasons["itl_p99_ms"]


def test_a_bad_tail_no_rule_explains_is_said_to_be_unexplained() -> None:
    capacity = search(
        run_at(itl_p50=10, itl_p99=50), "concurrency", 1, 2, SLO, progress=lambda _: None
    )
    assert capacity.why and capacity.why[0].rule == "unexplained_tail"
    assert "100% unexplained (unexplained_tail)" in capacity.reasons["itl_p99_ms"]


def test_a_bad_tail_a_finding_explains_names_it_with_its_share() -> None:
    stall = Finding(
        rule="streams_stall_together",
        finding="...",
        look_at="...",
        evidence={"itl_tail_share": 0.8},
    )
    capacity = search(
        run_at(itl_p50=10, itl_p99=50, findings=[stall]),
        "concurrency",
        1,
        2,
        SLO,
        progress=lambda _: None,
    )
    reason = capacity.reasons["itl_p99_ms"]
    assert "streams_stall_together 80%" in reason and "unexplained" not in reason


def test_errors_say_how_many_and_the_first() -> None:
    capacity = search(
        run_at(itl_p50=10, itl_p99=12, errors=3), "concurrency", 1, 2, SLO, progress=lambda _: None
    )
    assert capacity.binding == ["errors (3)"]
    assert capacity.reasons["errors (3)"] == (
        "3 of 64 requests failed; the first UNAVAILABLE: gone"
    )
