"""The front's loop lag as the lab reads it from timed streams, and the rule front_loop_blocked
on recorded results: direct evidence (late wake-ups and a gap tail), client evidence (every
stream stalled while the engine's steps did not), and what a blocked loop explains away."""

from __future__ import annotations

import msgspec

from cadence.core.metrics import LoopLagTally
from cadence.lab.analysis import diagnosis as dx
from cadence.lab.analysis.stats import front_loop
from cadence.lab.records import RequestRecord
from cadence.lab.results import BenchResult


def tally(front: int, lags_ms: list[float]) -> str:
    t = LoopLagTally(front)
    for lag in lags_ms:
        t.observe(lag / 1e3)
    return t.encoded()


def record(start: int, end: int, at_start: str, at_end: str) -> RequestRecord:
    return RequestRecord(
        request_id="r", process=0, start_ns=start, end_ns=end, loop_lag=[at_start, at_end]
    )


def test_the_run_is_the_first_start_against_the_last_end_per_front():
    before = [1.0] * 5 + [300.0]  # a stall before the run must not count
    run0 = before + [1.0] * 8 + [40.0, 60.0]
    run1 = [2.0] * 4 + [30.0]
    records = [
        record(10, 50, tally(0, before), tally(0, before + [1.0] * 4)),
        record(20, 90, tally(0, before + [1.0] * 2), tally(0, run0)),
        record(15, 80, tally(1, []), tally(1, run1)),
    ]
    loop = front_loop(records)
    assert loop.fronts == 2 and loop.samples == 10 + 5
    assert loop.late_over_20ms == 3  # 40 and 60 on front 0, 30 on front 1
    assert loop.max_ms_at_most == 100.0 and loop.p99_ms_at_most == 100.0
    assert front_loop([RequestRecord(request_id="r", process=0, start_ns=0)]) is None


def test_a_stream_without_the_start_tally_counts_for_the_end_only():
    # The front sends a start tally only when it moved since a stream last carried it.
    run = [1.0] * 3 + [50.0]
    records = [
        record(10, 60, tally(0, []), tally(0, run[:2])),
        record(11, 90, "", tally(0, run)),  # the latest end, opened in the same burst
    ]
    loop = front_loop(records)
    assert loop.samples == 4 and loop.late_over_20ms == 1
    assert front_loop([record(11, 90, "", tally(0, run))]) is None


def dist(p50: float, p90: float, p99: float) -> dict:
    return {"count": 500, "mean": p50, "p50": p50, "p90": p90, "p99": p99, "max": p99, "min": p50}


def result(
    *,
    late: int = 0,
    samples: int = 30,
    gap_p99: float = 70.0,
    shared: int = 0,
    step_p90: float = 10.3,
) -> dict:
    return {
        "chunk_gap_ms": dist(10.5, 12.0, gap_p99),
        "itl_ms": dist(10.5, 12.0, gap_p99),
        "ttft_ms": dist(30.0, 40.0, 50.0),
        "segments_ms": {"engine_step": dist(10.0, step_p90, step_p90)},
        "front_loop": {
            "samples": samples,
            "late_over_20ms": late,
            "late_share": late / samples,
            "p99_ms_at_most": 100.0,
            "max_ms_at_most": 100.0,
            "fronts": 1,
        },
        "timeline": {
            "gap_p50_ms": 10.5,
            "stalls": {
                "shared": shared,
                "shared_ms_p50": 65.0,
                "shared_ms_max": 70.0,
                "shared_time_share": 0.2 if shared else 0.0,
                "streams_hit_min": 16,
                "streams_hit_p50": 16.0,
                "gaps": 1500,
                "long_gaps": 16 * shared,
                "long_gaps_in_shared": 16 * shared,
            },
        },
        "system": {"processes": {}},
    }


def rules(r: dict) -> set[str]:
    return {f.rule for f in dx.diagnose(msgspec.convert(r, BenchResult))}


def test_late_wakeups_with_a_gap_tail_are_a_blocked_loop():
    r = result(late=9)
    assert dx.RULE_FRONT_LOOP_BLOCKED in rules(r)
    finding = next(
        f
        for f in dx.diagnose(msgspec.convert(r, BenchResult))
        if f.rule == dx.RULE_FRONT_LOOP_BLOCKED
    )
    assert finding.evidence["loop_wakeups_late_over_20ms"] == "9 of 30"
    assert finding.evidence["loop_lag_max_ms_at_most"] == 100.0


def test_every_stream_stalling_while_steps_stay_steady_is_a_blocked_loop():
    assert dx.RULE_FRONT_LOOP_BLOCKED in rules(result(late=0, shared=4))


def test_a_busy_but_healthy_front_is_not_blocked():
    assert dx.RULE_FRONT_LOOP_BLOCKED not in rules(result(late=1, samples=12))
    # Late wake-ups that leave the gaps alone explain nothing.
    assert dx.RULE_FRONT_LOOP_BLOCKED not in rules(result(late=9, gap_p99=14.0))
    # Stalls of every stream while the engine's own steps stall are the engine's.
    assert dx.RULE_FRONT_LOOP_BLOCKED not in rules(result(shared=4, step_p90=60.0))


def test_a_blocked_loop_explains_an_in_front_engine_jittering():
    r = result(late=9, step_p90=60.0)
    r["segments_ms"]["engine_step"] = dist(10.0, 25.0, 60.0)
    r["itl_ms"] = dist(10.5, 25.0, 70.0)
    r["token_delay_ms"] = dist(2.0, 3.0, 5.0)
    in_front = rules(r)
    assert dx.RULE_FRONT_LOOP_BLOCKED in in_front
    assert dx.RULE_ITL_UNSTABLE_ENGINE not in in_front
    r["system"]["processes"] = {"worker0": {"samples": []}}  # the engine in its own process
    assert dx.RULE_ITL_UNSTABLE_ENGINE in rules(r)
