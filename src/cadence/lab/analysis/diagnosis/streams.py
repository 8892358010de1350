"""Rules on the streams read together (`cadence.lab.analysis.timeline`, and read by read in
`coincidence`), the evidence a run without server timing still has: `streams_stall_together`,
`ttft_grows_with_streams`, and `front_loop_blocked` (which also reads the front's own
loop-lag tallies)."""

from __future__ import annotations

import itertools

from cadence.lab.analysis.diagnosis.coincidence import attribution
from cadence.lab.analysis.diagnosis.facts import RunFacts, finite, rounded, steps_vary
from cadence.lab.analysis.diagnosis.names import (
    RULE_FRONT_LOOP_BLOCKED,
    RULE_KV_CACHE_FULL,
    RULE_SERVER_QUEUE_GROWS,
    RULE_SERVER_STREAM_LIMIT,
    RULE_STREAMS_STALL_TOGETHER,
    RULE_TTFT_DEPENDS_ON,
    RULE_TTFT_GROWS_WITH_STREAMS,
)
from cadence.lab.analysis.diagnosis.rule import GiveWay, Rule
from cadence.lab.analysis.diagnosis.signatures import (
    TTFT_GROWTH_GAPS,
    TTFT_GROWTH_MIN_MS,
    BurstSpread,
    FollowsOwnSize,
    SharedStalls,
    WaitsForSlot,
)
from cadence.lab.analysis.timeline import MIN_BURST
from cadence.lab.results import Finding, Stalls, StreamConcurrency, Timeline

SHARED_STALLS_MIN = 3
"""Stalls that hit every open stream at once count from this many: one or two are what a
busy 2-core machine gives a run now and then (a process descheduled for ~100 ms)."""

SHARED_TIME_SHARE = 0.05
"""...and when they hold at least this share of the run: a server pausing 100 ms every
0.5 s stalls 20 % of it; machine hiccups stay near 1-2 %."""

SHARED_LONG_GAP_SHARE = 0.5
"""...and when at least this share of the streams' long gaps fall inside them (the rest are
single streams' own stalls)."""

STALL_MIN_SHARE = 0.2
"""...and, read from the raw records, when they explain at least this share of the gaps' tail
time (`coincidence`; a writer that holds output back leaves every stream silent together too,
but the held outputs explain those silences first)."""

STALL_PERIOD_SPREAD = 0.25
"""Stalls come regularly when the spread between their intervals' quartiles is at most this
share of the median interval."""

CAP_RECEIVING_SHARE = 0.8
CAP_TIME_SHARE = 0.5
"""A hard cap on streams: at most this share of the open streams ever received output at
once, and the receiving count sat at its peak, with streams waiting, for at least this share
of the run. A server that is merely slow to start streams (a long prefill) lets the
receiving count wander below its peak instead of holding it."""


def _receiving_capped(cap: StreamConcurrency) -> bool:
    """The streams receiving output sat at a hard cap (CAP_RECEIVING_SHARE, CAP_TIME_SHARE)."""
    return (
        cap.peak_receiving <= CAP_RECEIVING_SHARE * cap.peak_open
        and cap.capped_share >= CAP_TIME_SHARE
    )


SLOT_MIN_SHARE = 0.2
"""Streams waited for a slot, read from the raw records whatever the gaps do, when first
outputs that came right after another stream ended (`signatures.WaitsForSlot`) hold at
least this share of the first outputs' tail time."""

GAPS_NORMAL_RATIO = 2.5
"""...while the gaps stay normal: chunk-gap p90 within this many times its p50 (below it a
busy machine is not told apart from uneven delivery, as for `itl.NETWORK_UNSTABLE_P90_RATIO`)."""

LOOP_LATE_SHARE = 0.05
LOOP_LATE_MIN = 3
"""The front's loop is blocked when at least this share of its heartbeat wake-ups (one per
0.1 s) came more than 20 ms late, and at least this many: a busy but healthy front (256
streams of 10 ms steps on a 2-core machine) was late in 1 of 12; user code that blocks the
loop for 60 ms every 0.3 s makes about 13% of them late, 100 ms every second 8%."""

LOOP_GAP_TAIL_MS = 20.0
"""...and when the gaps have a tail it can explain: chunk-gap p99 this many ms above p50
(a blocked loop delays the next chunk of every stream by the time it was blocked)."""


STALL_LOOK_AT = (
    "what can pause the whole server: a blocking call on its event loop, a "
    "thread pool or one queue that every stream waits on, the GIL held by "
    "compute, garbage collection (a regular period points at a timer or a "
    "periodic job: gc, a metrics flush, a health check), an engine (or its "
    "producer) blocked on a full queue; run the server under a profiler (py-spy) "
    "during the stalls, or give the lab --server-pid to read its threads"
)


def _client_side(facts: RunFacts) -> Timeline | None:
    """The timeline, for runs without server timing (with it, the segment rules speak)."""
    if facts.result.segments_ms:
        return None
    return facts.result.timeline


def stalled_together(stalls: Stalls | None) -> bool:
    """Enough stalls of every open stream at once to explain the gap tail (SHARED_*)."""
    return (
        stalls is not None
        and stalls.shared >= SHARED_STALLS_MIN
        and stalls.shared_time_share >= SHARED_TIME_SHARE
        and stalls.long_gaps > 0
        and stalls.long_gaps_in_shared / stalls.long_gaps >= SHARED_LONG_GAP_SHARE
    )


def stall_together(facts: RunFacts) -> list[Finding]:
    timeline = _client_side(facts)
    if timeline is None:
        return []
    tail = attribution(facts)
    if tail is None:  # no raw records: the timeline's tallies alone
        return _stalled_by_timeline(facts, timeline)
    signature = tail.signature(SharedStalls)
    assert signature is not None  # SharedStalls.detect always gives one; its claims decide
    stalls = signature.stalls()
    span_ms = (
        max(s.end_ns for s in tail.reads.streams) - min(s.start_ns for s in tail.reads.streams)
    ) / 1e6
    stalled_ms = sum(length for _, length in stalls)
    share = tail.itl_share(RULE_STREAMS_STALL_TOGETHER)
    if (
        len(stalls) < SHARED_STALLS_MIN
        or stalled_ms < SHARED_TIME_SHARE * span_ms
        or share < STALL_MIN_SHARE
    ):
        return []
    lengths = sorted(length for _, length in stalls)
    evidence: dict = {
        "shared_stalls": len(stalls),
        "stall_p50_ms": rounded(lengths[len(lengths) // 2]),
        "stall_max_ms": rounded(lengths[-1]),
        "run_share_stalled": rounded(stalled_ms / span_ms, 3),
        **tail.shares(RULE_STREAMS_STALL_TOGETHER),
    }
    if timeline.stalls.shared:
        evidence["streams_hit_p50"] = rounded(timeline.stalls.streams_hit_p50, 1)
    period = _period_ms(stalls)
    if period is not None:
        evidence["stall_every_ms"] = rounded(period, 0)
    every = f", about every {period:.0f} ms" if period is not None else ""
    ttft = (
        f" and {tail.ttft_share(RULE_STREAMS_STALL_TOGETHER):.0%} of the first outputs'"
        if tail.ttft_ms.get(RULE_STREAMS_STALL_TOGETHER)
        else ""
    )
    return [
        Finding(
            rule=RULE_STREAMS_STALL_TOGETHER,
            finding=(
                f"every open stream stalled at the same instants: {len(stalls)} times"
                f"{every} (up to {lengths[-1]:.0f} ms, {stalled_ms / span_ms:.0%} of the run) "
                "no stream got anything while others were open; the pause is on the "
                f"server's side, not any one stream's. It explains {share:.0%} of the gaps' "
                f"tail{ttft}"
            ),
            evidence=evidence,
            look_at=STALL_LOOK_AT,
        )
    ]


def _period_ms(stalls: list[tuple[int, float]]) -> float | None:
    """The stalls' period when they come regularly (STALL_PERIOD_SPREAD), else None."""
    intervals = sorted((b - a) / 1e6 for (a, _), (b, _) in itertools.pairwise(stalls))
    if len(intervals) < 2:
        return None
    mid = intervals[len(intervals) // 2]
    q1, q3 = intervals[len(intervals) // 4], intervals[(3 * len(intervals)) // 4]
    return mid if mid > 0 and (q3 - q1) <= STALL_PERIOD_SPREAD * mid else None


def _stalled_by_timeline(facts: RunFacts, timeline: Timeline) -> list[Finding]:
    if not stalled_together(timeline.stalls):
        return []
    stalls = timeline.stalls
    evidence: dict = {
        "shared_stalls": stalls.shared,
        "stall_p50_ms": rounded(stalls.shared_ms_p50),
        "stall_max_ms": rounded(stalls.shared_ms_max),
        "run_share_stalled": rounded(stalls.shared_time_share, 3),
        "streams_hit_p50": rounded(stalls.streams_hit_p50, 1),
        "streams_hit_min": stalls.streams_hit_min,
        "long_gaps_in_shared_stalls": f"{stalls.long_gaps_in_shared} of {stalls.long_gaps}",
        "gap_p50_ms": rounded(timeline.gap_p50_ms),
    }
    if facts.gaps:
        evidence["gap_p99_ms"] = rounded(facts.gaps.p99)
    return [
        Finding(
            rule=RULE_STREAMS_STALL_TOGETHER,
            finding=(
                f"every open stream stalled at the same instants: {stalls.shared} times "
                f"(up to {stalls.shared_ms_max:.0f} ms, {stalls.shared_time_share:.0%}"
                f" of the run) no stream got anything although a median of "
                f"{stalls.streams_hit_p50:.0f} were open; the pause is on the server's "
                "side, not any one stream's"
            ),
            evidence=evidence,
            look_at=STALL_LOOK_AT,
        )
    ]


def ttft_grows(facts: RunFacts) -> list[Finding]:
    timeline, gaps = _client_side(facts), facts.gaps
    if timeline is None or not gaps:
        return []
    tail = attribution(facts)
    slot = tail.signature(WaitsForSlot) if tail else None
    slot_share = (
        tail.ttft_share(RULE_TTFT_GROWS_WITH_STREAMS)
        if tail is not None and slot is not None
        else 0.0
    )
    waited_for = slot if slot is not None and slot_share >= SLOT_MIN_SHARE else None
    waited = waited_for is not None
    # With uneven gaps a spread of TTFTs may be theirs; a stream that starts the moment
    # another ends waited for it whatever the gaps do (`waited`).
    normal = gaps.p50 > 0 and gaps.p90 <= GAPS_NORMAL_RATIO * gaps.p50
    high = max(TTFT_GROWTH_GAPS * timeline.gap_p50_ms, TTFT_GROWTH_MIN_MS)
    bursts, cap = timeline.bursts, timeline.concurrency
    capped = normal and _receiving_capped(cap) and facts.ttft is not None and facts.ttft.p90 >= high
    spread = bursts.ttft_p90_ms - bursts.ttft_p10_ms
    # Read from the raw records, the spread must be call set-up's: what the engine's steps
    # took beyond their pace while the streams waited is not (`BurstSpread`).
    set_up = tail is None or tail.signature(BurstSpread) is not None
    burst = normal and set_up and bursts.largest >= MIN_BURST and finite(spread) and spread >= high
    if not (capped or burst or waited):
        return []
    evidence: dict = {
        "largest_burst": bursts.largest,
        "burst_ttft_p10_ms": rounded(bursts.ttft_p10_ms),
        "burst_ttft_p90_ms": rounded(bursts.ttft_p90_ms),
        "peak_open_streams": cap.peak_open,
        "peak_receiving_streams": cap.peak_receiving,
        "share_at_cap_with_streams_waiting": rounded(cap.capped_share, 3),
        "gap_p50_ms": rounded(gaps.p50),
        "gap_p90_ms": rounded(gaps.p90),
    }
    if bursts.opened_alone:
        evidence["ttft_p50_opened_alone_ms"] = rounded(bursts.alone_ttft_p50_ms)
    if tail is not None:
        evidence.update(tail.shares(RULE_TTFT_GROWS_WITH_STREAMS))
    for signature in (slot, tail.signature(BurstSpread) if tail else None):
        if signature is not None:
            evidence.update(signature.evidence)
    explains = (
        f"; waiting for a slot is {slot_share:.0%} of the first outputs' tail" if waited else ""
    )
    if waited_for is not None and not capped:
        ev = waited_for.evidence
        finding = (
            f"{ev['first_output_right_after_another_stream_ended']} of the "
            f"{ev['slow_first_outputs']} slow first outputs came within "
            f"{ev['slot_window_ms']:.0f} ms of another stream's last output, which "
            f"ended after they were sent: streams waited for others to end before "
            f"they started (at most {cap.peak_receiving} received at once of up to "
            f"{cap.peak_open} open){explains}"
        )
        look_at = (
            "a limit on the streams served at once: a thread pool (max_workers, a sync "
            "handler that holds its thread while it waits for output), the server's "
            "max concurrent streams, an engine batch limit (vLLM --max-num-seqs, "
            "SGLang --max-running-requests); raise it or forward output without holding "
            "a slot per stream; --scrape of the server's metrics shows its queue"
        )
        return [
            Finding(
                rule=RULE_TTFT_GROWS_WITH_STREAMS,
                finding=finding,
                evidence=evidence,
                look_at=look_at,
            )
        ]
    if capped:
        assert facts.ttft is not None  # `capped` holds only with it
        finding = (
            f"at most {cap.peak_receiving} streams received output at once while up "
            f"to {cap.peak_open} were open: the others waited for their first output "
            f"(TTFT p90 {facts.ttft.p90:.0f} ms) although gaps stay normal (p50 "
            f"{gaps.p50:.1f} ms); something holds one slot per stream{explains}"
        )
        look_at = (
            "a thread per stream (a ThreadPoolExecutor's max_workers, a sync handler "
            "that holds its thread while it waits for output), the server's max "
            "concurrent streams, an engine batch limit; forward output without holding a "
            "thread (an async server, per-request queues)"
        )
    else:
        finding = (
            f"of {bursts.largest} streams opened at once, the first tenth got output "
            f"within {bursts.ttft_p10_ms:.0f} ms and the last tenth after "
            f"{bursts.ttft_p90_ms:.0f} ms, while gaps stay normal (p50 "
            f"{gaps.p50:.1f} ms): new streams are taken in one at a time{explains}"
        )
        look_at = (
            "call set-up: a server that accepts calls one at a time, a lock or a slow "
            "step at the start of each call (authentication, a per-call model lookup), "
            "an engine that admits one request per step, too few threads for new calls"
        )
    return [
        Finding(
            rule=RULE_TTFT_GROWS_WITH_STREAMS, finding=finding, evidence=evidence, look_at=look_at
        )
    ]


def front_loop_blocked(facts: RunFacts) -> list[Finding]:
    gaps = facts.gaps
    if not gaps:
        return []
    lag = facts.loop_lag()
    late = lag.late_over_20ms if lag else 0
    direct = (
        lag is not None
        and late >= LOOP_LATE_MIN
        and late / lag.samples >= LOOP_LATE_SHARE
        and gaps.p99 - gaps.p50 >= LOOP_GAP_TAIL_MS
    )
    stalls = facts.result.timeline.stalls if facts.result.timeline else None
    step = facts.step
    together = (
        stalled_together(stalls)
        and step is not None
        and facts.typical_step is not None
        and not steps_vary(step.p50, step.p90)
    )
    if not (direct or together):
        return []
    evidence: dict = {"gap_p50_ms": rounded(gaps.p50), "gap_p99_ms": rounded(gaps.p99)}
    if lag is not None:
        evidence["loop_wakeups_late_over_20ms"] = f"{late:.0f} of {lag.samples:.0f}"
        for key in ("p99_ms_at_most", "max_ms_at_most"):
            if hasattr(lag, key):
                evidence[f"loop_lag_{key}"] = getattr(lag, key)
    if stalls and stalls.shared:
        evidence["stalls_of_every_stream"] = stalls.shared
        evidence["streams_hit_per_stall_p50"] = rounded(stalls.streams_hit_p50, 1)
    if step is not None:
        evidence["engine_step_p50_ms"] = rounded(step.p50)
        evidence["engine_step_p90_ms"] = rounded(step.p90)
    if direct:
        assert lag is not None  # `direct` holds only with it
        finding = (
            f"the front's event loop was blocked: {late:.0f} of its "
            f"{lag.samples:.0f} timer wake-ups came more than 20 ms late, and the "
            f"streams' gaps have a tail of the same size (p99 {gaps.p99:.0f} ms "
            f"against p50 {gaps.p50:.0f} ms)"
        )
    else:
        assert stalls is not None  # `together` holds only with them (`stalled_together`)
        finding = (
            f"every open stream stalled at the same instants ({stalls.shared} "
            f"times, a median of {stalls.streams_hit_p50:.0f} streams each) while "
            "the engine's steps did not: the front stopped sending"
        )
    return [
        Finding(
            rule=RULE_FRONT_LOOP_BLOCKED,
            finding=finding,
            evidence=evidence,
            look_at=(
                "blocking calls in async code on the front (time.sleep, file or network "
                "I/O, a lock, heavy Python between awaits), user code running in the front "
                "(--app-in-front: move it to workers or make it await), garbage "
                "collection pauses, a front at a full core (front_cpu_bound); py-spy dump "
                "of the front during a stall shows the culprit"
            ),
        )
    ]


def _ordered_by_own_size(finding: Finding, facts: RunFacts) -> bool:
    """The first outputs follow the request's own size (`signatures.FollowsOwnSize`: its
    prompt, its output budget), no cap on the streams receiving was seen, and what the size
    left to a slot is under SLOT_MIN_SHARE: a burst spread by its prompts or by a length
    order is not streams taken in one at a time."""
    tail, timeline = attribution(facts), _client_side(facts)
    cap = timeline.concurrency if timeline is not None else None
    return (
        tail is not None
        and tail.signature(FollowsOwnSize) is not None
        and not (cap is not None and _receiving_capped(cap))
        and tail.ttft_share(RULE_TTFT_GROWS_WITH_STREAMS) < SLOT_MIN_SHARE
    )


RULES = (
    Rule(RULE_STREAMS_STALL_TOGETHER, stall_together),
    # A stream limit per connection makes the late streams wait for a free stream, and the
    # server's own queue (its metrics, --scrape) shows them waiting for a place in its batch
    # or cache: those are the causes to name, not call set-up or a slot per stream.
    Rule(
        RULE_TTFT_GROWS_WITH_STREAMS,
        ttft_grows,
        gives_way_to=(
            GiveWay(RULE_SERVER_STREAM_LIMIT),
            GiveWay(RULE_SERVER_QUEUE_GROWS),
            GiveWay(RULE_KV_CACHE_FULL),
            GiveWay(RULE_TTFT_DEPENDS_ON, _ordered_by_own_size),
        ),
    ),
    Rule(RULE_FRONT_LOOP_BLOCKED, front_loop_blocked),
)
