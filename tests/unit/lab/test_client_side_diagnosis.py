"""The client-side rules (no server timing): streams_stall_together and ttft_grows_with_streams.

Records are built by hand as a load process would record them from a service that sends one
token every 20 ms: clean, paused for everyone at once, with single streams stalling on their
own, taking calls in one at a time, capped at a few streams, and with a long but even TTFT.
Each result goes through `summarize` and `diagnose` as `run_bench` would send it.
"""

from __future__ import annotations

import msgspec

from cadence.lab.analysis.diagnosis import (
    RULE_STREAMS_STALL_TOGETHER,
    RULE_TTFT_GROWS_WITH_STREAMS,
    diagnose,
)
from cadence.lab.analysis.stats import summarize
from cadence.lab.records import RequestRecord
from cadence.lab.results import BenchResult, Segments

MS = 1_000_000
GAP = 20 * MS


def stream(
    k: int,
    start: int,
    first: int,
    tokens: int = 50,
    gap: int = GAP,
    shifts: list[tuple[int, int]] = (),
) -> RequestRecord:
    """Stream k: sent at `start`, first token at `first`, then one per `gap`; every arrival at
    or after time t is delayed by d for each (t, d) in `shifts` (a pause)."""
    arrival = []
    for i in range(tokens):
        t = first + i * gap
        t += sum(d for at, d in shifts if t >= at)
        arrival.append(t)
    return RequestRecord(
        request_id=f"bench-{k}",
        process=0,
        start_ns=start,
        end_ns=arrival[-1],
        max_tokens=tokens,
        finish_reason=2,
        arrival_ns=arrival,
        tokens=[1] * tokens,
        index=list(range(tokens)),
    )


def as_bench(records: list[RequestRecord]) -> BenchResult:
    return BenchResult(**msgspec.structs.asdict(summarize(records)))


def diagnosed(records: list[RequestRecord]) -> tuple[BenchResult, list[str]]:
    result = as_bench(records)
    return result, [f.rule for f in diagnose(result)]


def burst(n: int, ttft=lambda k: 25 * MS, **kw) -> list[RequestRecord]:
    """n streams opened together (0.1 ms apart)."""
    return [stream(k, k * MS // 10, k * MS // 10 + ttft(k), **kw) for k in range(n)]


def test_clean_run_fires_nothing():
    result, fired = diagnosed(burst(32))
    assert fired == []
    stalls = result.timeline.stalls
    assert stalls.shared == 0 and stalls.long_gaps == 0


def test_a_pause_of_the_whole_server_stalls_every_stream_together():
    pauses = [(t * MS, 120 * MS) for t in (200, 500, 800)]
    result, fired = diagnosed(burst(32, shifts=pauses))
    assert fired == [RULE_STREAMS_STALL_TOGETHER]
    stalls = result.timeline.stalls
    assert stalls.shared == 3
    assert stalls.streams_hit_min == 32
    assert stalls.long_gaps_in_shared == stalls.long_gaps == 3 * 32
    finding = diagnose(result)[0]
    assert finding.evidence["stall_max_ms"] > 120


def test_single_streams_stalling_on_their_own_are_not_a_server_pause():
    records = burst(32)
    # Four streams each stall 150 ms three times, at different instants: their own stalls.
    for k in range(4):
        pauses = [((150 + 40 * k + 250 * j) * MS, 150 * MS) for j in range(3)]
        records[k] = stream(k, records[k].start_ns, records[k].arrival_ns[0], shifts=pauses)
    result, fired = diagnosed(records)
    assert RULE_STREAMS_STALL_TOGETHER not in fired
    stalls = result.timeline.stalls
    assert stalls.long_gaps == 12 and stalls.long_gaps_in_shared == 0


def test_two_machine_hiccups_are_not_enough():
    pauses = [(300 * MS, 100 * MS), (700 * MS, 100 * MS)]
    _, fired = diagnosed(burst(32, shifts=pauses))
    assert RULE_STREAMS_STALL_TOGETHER not in fired


def test_calls_taken_in_one_at_a_time_make_ttft_grow_with_the_burst():
    result, fired = diagnosed(burst(32, ttft=lambda k: 25 * MS + 15 * MS * k))
    assert fired == [RULE_TTFT_GROWS_WITH_STREAMS]
    finding = diagnose(result)[0]
    assert "one at a time" in finding.finding
    assert finding.evidence["largest_burst"] == 32


def test_a_cap_on_streams_keeps_the_others_waiting():
    """16 streams opened at once against 4 slots: each wave waits for the one before."""
    duration = 50 * GAP
    records = burst(16, ttft=lambda k: 25 * MS + (k // 4) * duration)
    result, fired = diagnosed(records)
    assert fired == [RULE_TTFT_GROWS_WITH_STREAMS]
    concurrency = result.timeline.concurrency
    assert concurrency.peak_open == 16 and concurrency.peak_receiving == 4
    finding = diagnose(result)[0]
    assert finding.finding.startswith("at most 4 streams received output at once")


def test_a_long_even_ttft_is_not_growth():
    """A slow start that is the same for every stream (a long prefill) is not a start-up
    limit: nothing grows with the streams opened at once. It is a slow first message."""
    _, fired = diagnosed(burst(32, ttft=lambda k: 400 * MS))
    assert fired == ["slow_first_message"]


def test_runs_with_server_timing_leave_these_rules_to_the_segments():
    result = as_bench(burst(32, ttft=lambda k: 25 * MS + 15 * MS * k))
    result.segments_ms = Segments()
    assert RULE_TTFT_GROWS_WITH_STREAMS not in [f.rule for f in diagnose(result)]
