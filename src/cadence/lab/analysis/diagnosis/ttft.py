"""Rules on time to first token, from the server's timing of each request's first chunk:
`ttft_engine_start` (a slow admitting step among a worker's first after its start) and
`ttft_queueing` (waiting to be admitted)."""

from __future__ import annotations

import msgspec

from cadence.lab.analysis.diagnosis.facts import RunFacts, rounded
from cadence.lab.analysis.diagnosis.names import (
    RULE_FRONT_LOOP_BLOCKED,
    RULE_PREFILL_POOL_BOTTLENECK,
    RULE_TTFT_ENGINE_START,
    RULE_TTFT_QUEUEING,
)
from cadence.lab.analysis.diagnosis.rule import GiveWay, Rule
from cadence.lab.analysis.startup import worker_startup
from cadence.lab.results import Finding

TTFT_HIGH_STEPS = 5.0
"""TTFT is "high" from this many typical engine steps. A request normally waits for the
step in flight (up to one step), then its own step, plus the trip through the front: 1.5-4.5
steps measured on a 2-core machine with 1-64 streams opened at once, idle or running another
benchmark."""

TTFT_HIGH_MIN_MS = 100.0
"""...and from this many ms at least: opening 16-64 streams at once costs the client and the
front 10-70 ms on a 2-core machine shared with another benchmark, whatever the step; with a
5 ms step that is already 5-14 steps."""

STARTUP_STEP_FACTOR = 5.0
"""A step is a start-up stall when it takes this many times the p90 of the run's steps.
Jitter puts single steps near 3x the p90 even at a standard deviation of 80 % of the step;
loading a model, compiling kernels or warming a card costs 10-100 steps."""

STARTUP_MIN_MS = 20.0
"""...and at least this many ms more than the p90 step: with sub-millisecond steps a
scheduler hiccup of a few ms would otherwise look like a 10x stall."""

STARTUP_FIRST_STEPS = 3
"""A stall is a start-up's only on one of its worker's first this many steps in the run (the
first shapes a fresh engine meets: its first prefill, its first decode): a long step later in
the run is a long prompt's prefill or a hiccup, whatever its length."""

STARTUP_WORKER_AGE_S = 60.0
"""...and, where the lab saw the worker's process start, only when it had been running less
than this when the run began (the bench started right after the server): an older worker may
have served before the run, so its first steps in the run are not its first."""

STARTUP_TTFT_SHARE = 0.5
"""The stall explains the TTFT tail when it is at least this share of TTFT p99, and shows
in it when TTFT p99 is at least this share of the stall (the requests waited for it)."""

FIRST_STEP_SHARE = 0.5
"""TTFT is "mostly" the admitting step (first_step) from this share of its mean."""

WAIT_SHARE = 0.5
"""TTFT is "mostly" waiting (client_to_front + queue, less a start-up stall) from this share."""


def ttft_high(typical_step: float, value: float) -> bool:
    """`value` (ms) is a high TTFT for a run whose typical engine step is `typical_step`."""
    return value >= max(TTFT_HIGH_STEPS * typical_step, TTFT_HIGH_MIN_MS)


def _start_up_steps(facts: RunFacts) -> float | None:
    """The longest admitting step among its worker's first steps of the run after a start
    (STARTUP_FIRST_STEPS, STARTUP_WORKER_AGE_S), in ms; 0.0 when none was; None when the
    records carry no server timing to tell (then the run's longest admitting step stands)."""
    timed = [r for r in facts.result.records or [] if r.t_step_start_ns and r.t_step_end_ns]
    if not timed:
        return None
    steps: dict[int, set[int]] = {}
    for r in timed:
        steps.setdefault(r.worker, set()).update(r.t_step_start_ns)
    restarted = _restarted_in_run(facts)
    first: dict[int, set[int]] = {}
    for w, starts in steps.items():
        ordered = sorted(starts)
        process = facts.result.system.processes.get(f"worker{w}")
        age = process.age_s if process is not None else None
        fresh = not isinstance(age, float) or age < STARTUP_WORKER_AGE_S
        first[w] = set(ordered[:STARTUP_FIRST_STEPS]) if fresh else set()
        if w in restarted and len(ordered) > 1:
            # Its steps after the restart follow its longest pause (the new process's load).
            pause = max(range(1, len(ordered)), key=lambda k: ordered[k] - ordered[k - 1])
            first[w].update(ordered[pause : pause + STARTUP_FIRST_STEPS])
    longest = 0.0
    for r in timed:
        if r.t_step_start_ns[0] in first[r.worker]:
            longest = max(longest, (r.t_step_end_ns[0] - r.t_step_start_ns[0]) / 1e6)
    return longest


def _restarted_in_run(facts: RunFacts) -> set[int]:
    """The workers the server restarted during the run, from its scraped metrics (`--scrape`
    of cadence's own page); none where it was not scraped."""
    scraped = facts.result.system.server_metrics
    if scraped is None:
        return set()
    return {
        int(w["worker"])
        for w in worker_startup(msgspec.to_builtins(scraped))
        if w["restarts_during_run"]
    }


def startup_stall(facts: RunFacts) -> float | None:
    """The longest admitting step when it is a start-up stall (STARTUP_*): one of its worker's
    first steps after a start, STARTUP_STEP_FACTOR times the run's p90 step; else None."""
    if not (facts.step and facts.first_step and facts.typical_step):
        return None
    at_start = _start_up_steps(facts)
    longest = facts.first_step.max if at_start is None else at_start
    tail = facts.step.p90
    if longest >= STARTUP_STEP_FACTOR * tail and longest - tail >= STARTUP_MIN_MS:
        return longest
    return None


def engine_start(facts: RunFacts) -> list[Finding]:
    ttft, step, first = facts.ttft, facts.step, facts.first_step
    if not (ttft and step and first and facts.typical_step):
        return []
    typical = facts.typical_step
    evidence: dict = {
        "ttft_p50_ms": rounded(ttft.p50),
        "ttft_p99_ms": rounded(ttft.p99),
        "first_step_mean_ms": rounded(first.mean),
        "first_step_max_ms": rounded(first.max),
        "engine_step_p50_ms": rounded(typical),
        "engine_step_p90_ms": rounded(step.p90),
    }
    look_at = (
        "engine start-up: model load, kernel compilation or warm-up, or the first card's "
        "scheduling (not the serving layer's threads); warm each worker up before "
        "serving or measure with --warmup"
    )
    stall = startup_stall(facts)
    if (
        stall is not None
        and stall >= STARTUP_TTFT_SHARE * ttft.p99
        and ttft.p99 >= STARTUP_TTFT_SHARE * stall
        and ttft_high(typical, ttft.p99)
    ):
        queue = facts.segment("queue")
        if queue:
            evidence["queue_p50_ms"] = rounded(queue.p50)
        evidence["stall_over_step_p90"] = rounded(stall / step.p90, 1)
        return [
            Finding(
                rule=RULE_TTFT_ENGINE_START,
                finding=(
                    f"TTFT is high (p99 {ttft.p99:.0f} ms) because an engine step that "
                    f"admitted requests took {stall:.0f} ms, {stall / step.p90:.0f}x a "
                    "typical step; requests that arrived meanwhile queued behind it"
                ),
                evidence=evidence,
                look_at=look_at,
            )
        ]
    share = facts.share("ttft", "first_step")
    if (
        share is not None
        and share >= FIRST_STEP_SHARE
        and first.mean >= STARTUP_STEP_FACTOR * typical
        and ttft_high(typical, ttft.p50)
    ):
        evidence["ttft_share_first_step"] = rounded(share, 3)
        return [
            Finding(
                rule=RULE_TTFT_ENGINE_START,
                finding=(
                    f"TTFT is high (p50 {ttft.p50:.0f} ms) and {share:.0%} of it is the "
                    f"step that admits a request ({first.mean:.0f} ms on average, a typical "
                    f"step {typical:.1f} ms)"
                ),
                evidence=evidence,
                look_at=look_at + "; or the prefill cost of long prompts",
            )
        ]
    return []


def queueing(facts: RunFacts) -> list[Finding]:
    ttft, typical = facts.ttft, facts.typical_step
    to_front = facts.ttft_segment("client_to_front")
    queue = facts.ttft_segment("queue")
    if not (ttft and typical and to_front and queue and ttft.mean > 0):
        return []
    if not ttft_high(typical, ttft.p50):
        return []
    # Time spent waiting for a start-up stall is the stall's, not a backlog's.
    explained = startup_stall(facts) or 0.0
    wait = max(0.0, to_front.mean + queue.mean - explained)
    if wait < WAIT_SHARE * ttft.mean:
        return []
    evidence: dict = {
        "ttft_p50_ms": rounded(ttft.p50),
        "ttft_mean_ms": rounded(ttft.mean),
        "client_to_front_mean_ms": rounded(to_front.mean),
        "queue_mean_ms": rounded(queue.mean),
        "engine_step_p50_ms": rounded(typical),
        "wait_share": rounded(wait / ttft.mean, 3),
    }
    if explained:
        evidence["startup_stall_ms"] = rounded(explained)
    if queue.mean >= to_front.mean:
        where = "waiting for a worker to admit it (queue)"
        look_at = (
            "scheduling backlog: the workers' batches are full or busy; add workers, "
            "raise --max-batch, or lower the concurrency"
        )
    else:
        where = "reaching the front (client_to_front)"
        look_at = (
            "admission backlog: the front (or the client) is slow to accept new streams; "
            "check front and client CPU, open streams more gradually or lower the "
            "concurrency, add front or client processes"
        )
    return [
        Finding(
            rule=RULE_TTFT_QUEUEING,
            finding=(
                f"TTFT is high (p50 {ttft.p50:.0f} ms, {ttft.p50 / typical:.0f} engine "
                f"steps) and {wait / ttft.mean:.0%} of it is spent {where}"
            ),
            evidence=evidence,
            look_at=look_at,
        )
    ]


def _engine_in_front(finding: Finding, facts: RunFacts) -> bool:
    """No worker processes: the engine's steps wait for the front's loop too."""
    return not facts.workers


def _waiting_at_the_front(finding: Finding, facts: RunFacts) -> bool:
    """TTFT put on admission into the front: the blocked loop could not take the calls in."""
    return "client_to_front" in finding.finding


RULES = (
    Rule(
        RULE_TTFT_ENGINE_START,
        engine_start,
        # A full prefill pool makes long admitting steps (its batched prompts): that pool is
        # the finding, as it is of the queue before them.
        gives_way_to=(
            GiveWay(RULE_FRONT_LOOP_BLOCKED, _engine_in_front),
            GiveWay(RULE_PREFILL_POOL_BOTTLENECK),
        ),
    ),
    Rule(
        RULE_TTFT_QUEUEING,
        queueing,
        gives_way_to=(
            GiveWay(RULE_FRONT_LOOP_BLOCKED, _waiting_at_the_front),
            GiveWay(RULE_PREFILL_POOL_BOTTLENECK),
        ),
    ),
)
