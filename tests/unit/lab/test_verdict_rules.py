"""The verdict on known numbers: healthy only when every tail is near its median, the output
whole and the failures few; a bad tail attributed to its findings, the rest unexplained."""

from __future__ import annotations

import pytest

from cadence.lab.analysis import tail_evidence
from cadence.lab.analysis.noise_floor import TIMER_RESOLUTION_MS, noise_floor
from cadence.lab.analysis.tail_bound import (
    ITL_TAIL_CAP_RATIO,
    MIN_FIRST_OUTPUTS,
    MIN_GAPS,
    itl_bound,
)
from cadence.lab.analysis.verdict import RULE_UNEXPLAINED_TAIL, judge
from cadence.lab.records import RequestRecord
from cadence.lab.results import (
    BenchResult,
    Client,
    Distribution,
    EngineOnly,
    Finding,
    HostCpu,
    Integrity,
    System,
    TtftSegments,
)

MS = 1_000_000


def dist(p50: float, p99: float, count: int = 1000) -> Distribution:
    return Distribution(count=count, mean=p50, p50=p50, p90=p50, p99=p99, max=p99, min=p50)


def run(itl=(10.0, 12.0), ttft=(20.0, 30.0), gaps=1000, requests=32, **fields) -> BenchResult:
    return BenchResult(
        requests=requests,
        requests_ok=requests,
        itl_ms=dist(*itl, count=gaps),
        ttft_ms=dist(*ttft, count=requests),
        **fields,
    )


def finding(rule: str, **evidence) -> Finding:
    return Finding(rule=rule, finding="...", evidence=evidence, look_at="...")


def test_near_medians_whole_and_no_failures_is_healthy() -> None:
    verdict, extra = judge(run())
    assert verdict.state == "healthy" and verdict.healthy and extra == []
    assert verdict.line.startswith("healthy: ITL p99 12.0 ms within 20.0")
    assert "output whole" in verdict.line


@pytest.mark.parametrize(
    "p50, bound", [(1.0, 3.0), (5.0, 10.0), (10.0, 20.0), (20.0, 35.0), (40.0, 65.0)]
)
def test_the_itl_bound(p50: float, bound: float) -> None:
    assert itl_bound(p50)[0] == pytest.approx(bound)
    assert itl_bound(p50)[0] <= max(ITL_TAIL_CAP_RATIO * p50, p50 + 2)


def test_any_itl_p99_over_twice_its_p50_and_the_noise_floor_is_a_finding() -> None:
    for p50 in (2.0, 5.0, 10.0, 30.0, 100.0):
        # A run that measured no wake-ups or client lag: its floor is the timers' 1 ms.
        p99 = 2.01 * p50 + TIMER_RESOLUTION_MS + 0.01
        verdict, extra = judge(run(itl=(p50, p99), ttft=(p50, p50)))
        if p99 - p50 > 2:  # beyond the timer-resolution floor
            assert verdict.state == "unhealthy", (p50, verdict.line)
            assert [(f.rule, f.evidence["tail"]) for f in extra] == [
                (RULE_UNEXPLAINED_TAIL, "itl_ms")
            ], (p50, verdict.line)


def noisy(
    wakeup_p99: float | None = None, client_lag_p99: float | None = None, behind: bool = False
) -> dict:
    """A result's fields for a run whose probe and open-loop client measured these."""
    fields: dict = {}
    if wakeup_p99 is not None:
        fields["system"] = System(host=HostCpu(wakeups=dist(0.1, wakeup_p99, count=2000)))
    if client_lag_p99 is not None:
        fields["client"] = Client(
            schedule_lag_ms=dist(0.1, client_lag_p99, count=500), behind_schedule=behind
        )
    return fields


def test_the_noise_floor_is_made_of_what_the_run_measured() -> None:
    bare = noise_floor(run())
    assert bare.terms_ms == {"timer_resolution": TIMER_RESOLUTION_MS}
    assert "host wake-ups not measured" in bare.describe()
    assert "client read lag not measured" in bare.describe()
    full = noise_floor(run(**noisy(wakeup_p99=2.0, client_lag_p99=0.5)))
    assert full.terms_ms == {"timer_resolution": 1.0, "host_wakeups": 6.0, "client_read_lag": 0.5}
    assert full.ms == pytest.approx(7.5)
    assert "3 x wake-up p99 2.0 ms (the run's wake-up probe)" in full.describe()
    assert "client lag p99 0.5 ms (its open-loop sends)" in full.describe()
    behind = noise_floor(run(**noisy(client_lag_p99=300.0, behind=True)))
    assert "client_read_lag" not in behind.terms_ms  # its own finding explains the tail
    # The client's loop's ticks measure its read lag in any loop; they come first.
    ticked = noise_floor(
        run(client=Client(loop_lag_ms=dist(0.1, 3.0, count=400), schedule_lag_ms=dist(0.1, 0.5)))
    )
    assert ticked.terms_ms["client_read_lag"] == 3.0
    assert "client loop lag p99 3.0 ms (its loop's timer)" in ticked.describe()


@pytest.mark.parametrize(
    "p50, wakeup_p99, bound",
    [
        (2.7, 0.1, 2 * 2.7 + 1.3),  # quiet host: twice the median + 1.3 ms of noise
        (2.7, 3.4, 1.5 * 2.7 + 1 + 3 * 3.4),  # late wake-ups: 1.5 x p50 + the measured floor
        (10.0, 0.1, 20.0),  # a slower step: the fixed 5 ms slack still rules
        (100.0, 3.4, 150 + 1 + 3 * 3.4),
    ],
)
def test_the_itl_bound_allows_for_the_runs_measured_noise(p50, wakeup_p99, bound) -> None:
    result = run(itl=(p50, p50), **noisy(wakeup_p99=wakeup_p99))
    [itl, _] = judge(result)[0].tails
    assert itl.bound_ms == pytest.approx(bound)
    assert itl.noise_ms == pytest.approx(1 + 3 * wakeup_p99)
    assert itl.noise_terms_ms["host_wakeups"] == pytest.approx(3 * wakeup_p99)
    # Never stricter than the bound without noise.
    assert itl.bound_ms >= itl_bound(p50)[0]


def test_a_fast_step_is_judged_by_what_the_host_delivers() -> None:
    """ITL p50 2.7 ms: one late wake-up on a host whose probe saw 3 ms p99 no longer fails
    the run; a planted 60 ms pause and a stall still do."""
    fast = {"itl": (2.7, 9.0), "ttft": (12.0, 22.0)}
    late_wakeup = run(**fast, **noisy(wakeup_p99=3.0, client_lag_p99=0.4))
    assert judge(run(**fast))[0].state == "unhealthy"  # the fixed bounds: 5.4 and 18.5 ms
    verdict, extra = judge(late_wakeup)
    assert verdict.state == "healthy" and extra == [], verdict.line
    assert (
        "within 14.5 (1.5 x p50 2.7 + noise; noise 10.4 ms: timer 1 ms (epoll's "
        "milliseconds) + 3 x wake-up p99 3.0 ms (the run's wake-up probe) + client lag "
        "p99 0.4 ms (its open-loop sends))"
    ) in verdict.line
    assert "TTFT p99 22.0 ms within 23.9 (5 x ITL p50 2.7 + noise 10.4 ms)" in verdict.line
    for pause in (60.0, 250.0):
        verdict, extra = judge(run(itl=(2.7, pause), ttft=(12.0, 22.0), **noisy(wakeup_p99=3.0)))
        assert verdict.state == "unhealthy", verdict.line
        assert [f.rule for f in extra] == [RULE_UNEXPLAINED_TAIL]


def test_a_ttft_p90_over_five_itl_p50_is_a_finding() -> None:
    verdict, extra = judge(run(itl=(10.0, 11.0), ttft=(40.0, 60.0)))
    assert verdict.state == "unhealthy"
    [f] = extra
    assert f.evidence["tail"] == "ttft_ms" and f.evidence["itl_p50_ms"] == 10.0


def test_the_engines_own_first_output_time_raises_the_ttft_bound() -> None:
    slow_prefill = TtftSegments(first_step=dist(50.0, 58.0))
    verdict, _ = judge(run(ttft=(60.0, 100.0), ttft_segments_ms=slow_prefill))
    [ttft] = [t for t in verdict.tails if t.metric == "ttft_ms"]
    assert ttft.state == "healthy" and ttft.bound_ms == pytest.approx(58 + 50 + 5)
    baseline = EngineOnly(ttft_ms=dist(70.0, 80.0, count=32))
    verdict, _ = judge(run(ttft=(90.0, 130.0), baseline=baseline))
    assert "baseline" in verdict.tails[1].bound and verdict.tails[1].state == "healthy"


def test_tiny_runs_are_inconclusive_not_healthy() -> None:
    verdict, extra = judge(run(gaps=MIN_GAPS - 1, requests=MIN_FIRST_OUTPUTS - 1))
    assert verdict.state == "inconclusive" and extra == []
    assert "not judged" in verdict.line


def test_integrity_failures_and_aborts_make_a_run_unhealthy() -> None:
    verdict, _ = judge(run(integrity=Integrity(reordered_chunks=1)))
    assert verdict.state == "unhealthy"
    assert verdict.problems == ["integrity_faults: reordered_chunks 1"]
    failing = run(errors_by_code={"UNAVAILABLE": 2})
    assert judge(failing)[0].problems == ["requests_failing: 2 of 32 requests failed"]
    assert judge(run(aborted="the server went away"))[0].state == "unhealthy"


def test_a_bad_tail_is_attributed_to_its_findings() -> None:
    stall = finding("streams_stall_together", itl_tail_share=0.6)
    verdict, extra = judge(run(itl=(10.0, 50.0), diagnosis=[stall]))
    [itl] = [t for t in verdict.tails if t.metric == "itl_ms"]
    assert itl.explained_by == {"streams_stall_together": 0.6}
    assert itl.unexplained_share == pytest.approx(0.4)
    [f] = extra
    assert f.rule == RULE_UNEXPLAINED_TAIL and f.evidence["unexplained_share"] == 0.4
    assert "streams_stall_together 60%" in verdict.line and "40% unexplained" in verdict.line


def test_shares_that_leave_little_leave_nothing_unexplained() -> None:
    verdict, extra = judge(
        run(
            itl=(10.0, 50.0),
            diagnosis=[
                finding("streams_stall_together", itl_tail_share=0.5),
                finding("a_rule_added_later", itl_tail_share=0.3),
            ],
        )
    )
    assert extra == [] and verdict.tails[0].unexplained_share == pytest.approx(0.2)


def test_a_finding_without_a_share_explains_without_inventing_one() -> None:
    verdict, extra = judge(run(itl=(10.0, 50.0), diagnosis=[finding("itl_unstable_engine")]))
    assert extra == [] and verdict.tails[0].explained_by == {"itl_unstable_engine": None}
    assert verdict.tails[0].unexplained_share is None
    assert "explained by itl_unstable_engine;" in verdict.line


def test_information_explains_no_tail_and_does_not_make_a_run_unhealthy() -> None:
    """A CPU engine's worker filling its core is the engine's nature: said as information, it
    leaves a bad tail unexplained (the tail is not its doing) and a healthy run healthy."""
    busy = Finding(
        rule="server_one_core_bound",
        finding="...",
        evidence={"pid": 7},
        look_at="...",
        severity="information",
    )
    verdict, extra = judge(run(itl=(10.0, 50.0), diagnosis=[busy]))
    assert verdict.tails[0].explained_by == {} and verdict.tails[0].unexplained_share == 1.0
    assert [f.rule for f in extra] == [RULE_UNEXPLAINED_TAIL]
    verdict, extra = judge(run(diagnosis=[busy]))
    assert verdict.state == "healthy" and extra == []
    # The same finding raised as an alarm explains the tail.
    busy.severity = "alarm"
    verdict, _ = judge(run(itl=(10.0, 50.0), diagnosis=[busy]))
    assert verdict.tails[0].explained_by == {"server_one_core_bound": None}


def test_a_rule_of_the_other_tail_does_not_explain_this_one() -> None:
    _, extra = judge(run(itl=(10.0, 50.0), diagnosis=[finding("ttft_queueing")]))
    assert [f.evidence["tail"] for f in extra] == ["itl_ms"]
    _, extra = judge(run(itl=(10.0, 50.0), diagnosis=[finding("integrity_faults")]))
    assert [f.evidence["tail"] for f in extra] == ["itl_ms"]


def record(k: int, start_ms: float, arrivals_ms: list[float]) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{k}",
        process=0,
        start_ns=int(start_ms * MS),
        end_ns=int(arrivals_ms[-1] * MS),
        finish_reason=1,
        max_tokens=len(arrivals_ms),
        arrival_ns=[int(a * MS) for a in arrivals_ms],
        tokens=[1] * len(arrivals_ms),
        index=list(range(len(arrivals_ms))),
    )


def steady(k: int, start: float, n: int = 50, gap: float = 10.0, late: dict | None = None):
    arrivals, t = [], start
    for i in range(n):
        t += gap + (late or {}).get(i, 0.0)
        arrivals.append(t)
    return record(k, start, arrivals)


def test_one_streams_own_delay_is_told_from_a_stall_of_all() -> None:
    own = [steady(0, 0.0, late={20: 100.0}), *(steady(k, 0.0) for k in range(1, 4))]
    evidence = tail_evidence.slow_gaps(own, 20.0)
    assert evidence["slow_gaps"] == 1 and evidence["streams_with_slow_gaps"] == 1
    assert evidence["slow_gaps_others_received_share"] == 1.0
    assert evidence["slow_gaps_at_s"] == "0.31 (1)"
    everyone = [steady(k, 0.0, late={20: 100.0}) for k in range(4)]
    evidence = tail_evidence.slow_gaps(everyone, 20.0)
    assert evidence["streams_with_slow_gaps"] == 4
    assert evidence["slow_gaps_others_received_share"] == 0.0
    assert evidence["slow_gaps_in_tenths_of_run"] == 1


def test_slow_gaps_while_streams_start_are_counted_against_chance() -> None:
    # Streams 4-7 start at 205 ms, inside stream 0-3's 100 ms late gap.
    records = [steady(k, 0.0, late={20: 100.0}) for k in range(4)]
    records += [steady(k, 205.0) for k in range(4, 8)]
    evidence = tail_evidence.slow_gaps(records, 20.0)
    assert evidence["streams_started_during_slow_gaps"] == 4 * 4
    assert evidence["streams_started_by_chance"] < 16
