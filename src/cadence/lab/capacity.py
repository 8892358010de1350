"""`cadence capacity`: the largest load (streams at once, or requests per second) a server
takes while a latency SLO holds, and what binds it there.

The search runs the bench at the top of the range, then at the bottom (bracketing), then
bisects between the largest passing and the smallest failing value: geometrically while they
are far apart (a knee can sit anywhere in a wide range), then by halves, to adjacent integers
(concurrency) or within 5% (rate). With `repeat` above 1 each value runs that many times
and passes only when every run does. Then the knee is confirmed: the largest passing and the
smallest failing value get CONFIRM_RUNS runs each, and so do a value 10% under the first
and one 10% over the second; a passing value that fails on a repeat sends the search back below it. A top of the range that passes is said to be the
edge ("at least --high"), never the capacity itself. A run the client limited (its load
processes saturated, or behind the open loop's schedule) does not count as the server's:
the search stops and says so.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable

from cadence.lab.analysis.diagnosis import RULE_CLIENT_BEHIND_SCHEDULE, RULE_CLIENT_SATURATED
from cadence.lab.analysis.stats import TTFT_SEGMENTS
from cadence.lab.analysis.verdict import (
    RULE_UNEXPLAINED_TAIL,
    TAIL_RULES,
    attribution_words,
    judge,
)
from cadence.lab.bench import Workload
from cadence.lab.results import BenchResult, Capacity, CapacityPoint, SloTerm

RATE_TOLERANCE = 1.05
"""A rate search ends when the failing rate is within this factor of the passing one."""
_CLIENT_LIMITED = {RULE_CLIENT_SATURATED, RULE_CLIENT_BEHIND_SCHEDULE}
_PART_MEANS = {
    "client_to_front": "reaching the server: its intake of new calls (accept, thread pool), "
    "or the network",
    "queue": "waiting for a place in an engine step: a batch limit (--max-batch, KV-cache "
    "capacity) or --max-concurrent",
    "first_step": "the first engine step itself: prefill grows with the batch",
    "transfer": "the step's output reaching the front",
    "buffer": "the front sending: its CPU or its event loop",
    "send": "the network or the client reading",
}


def at_load(workload: Workload, search: str, value: float) -> Workload:
    """`workload` at `value` streams (closed loop) or requests/s (open loop)."""
    if search == "concurrency":
        return dataclasses.replace(workload, concurrency=int(value), rate=None)
    return dataclasses.replace(workload, rate=value)


def point(value: float, result: BenchResult) -> CapacityPoint:
    goodput = result.goodput or None
    rules = [f.rule for f in result.diagnosis]
    failed = [n for n, t in goodput.terms.items() if not t.met] if goodput else []
    errors = sum(result.errors_by_code.values())
    return CapacityPoint(
        value=value,
        passed=bool(goodput and goodput.passed) and not errors and not result.aborted,
        client_limited=bool(_CLIENT_LIMITED & set(rules)),
        ttft_p99_ms=result.ttft_ms.p99,
        itl_p99_ms=result.itl_ms.p99,
        tokens_per_s=result.tokens_per_s,
        goodput_tokens_per_s=goodput.tokens_per_s if goodput else math.nan,
        failed_terms=failed + ([f"errors ({errors})"] if errors else []),
        errors=errors,
        diagnosis=rules,
        ttft_p99_parts_ms={
            part: getattr(result.ttft_segments_ms, part).p99 for part in TTFT_SEGMENTS
        }
        if result.ttft_segments_ms
        else {},
    )


CONFIRM_RUNS = 3
"""Runs each load beside the knee (the largest passing, the smallest failing) gets before the
answer is given: near a knee one run passes or fails by luck (a capacity of 46 whose 54 and
76 failed once was answered 256 after one lucky run at the top of a narrower range)."""

SETTLE_ROUNDS = 6
"""Times the search goes back down when the largest passing load fails on a repeat, before
it answers with what it has."""


class _ClientLimited(Exception):
    """A run the client limited: the search stops (the server was not what was measured)."""


def search(
    run: Callable[[float], BenchResult],
    kind: str,
    low: float,
    high: float,
    slo: list[SloTerm],
    repeat: int = 1,
    progress: Callable[[str], None] = print,
    confirm: int = CONFIRM_RUNS,
) -> Capacity:
    """The largest value in [low, high] whose runs meet the SLO; `run(value)` benches once.

    Bracket and bisect (each load judged on `repeat` runs, failing at its first failed run),
    then confirm: the largest passing load, a load UNDER_STEP below it, the smallest failing
    load and one UNDER_STEP above it get `confirm` runs each. A passing load that fails on a repeat sends the
    search back below it. Every run
    stays in `runs_by_value`; the answer is the largest load that, with every load tried
    below it, met the SLO in all its runs, so it never sits above a failure (a lower load
    that failed where a higher one passed is retried and reported in `non_monotone`).
    """
    started = time.monotonic()
    capacity = Capacity(search=kind, slo=slo, confirm_runs=max(confirm, repeat))
    confirm = capacity.confirm_runs
    failing_runs: dict[float, BenchResult] = {}
    outcomes: dict[float, list[bool]] = {}
    integer = kind == "concurrency"

    def bench(value: float) -> bool:
        """One run at `value`: whether it met the SLO."""
        result = run(value)
        p = point(value, result)
        capacity.points.append(p)
        progress(
            f"{kind} {value:g}: "
            + ("passed" if p.passed else f"failed ({', '.join(p.failed_terms)})")
            + (" [client-limited]" if p.client_limited else "")
        )
        if p.client_limited:
            capacity.client_limited_at = value
            raise _ClientLimited
        outcomes.setdefault(value, []).append(p.passed)
        if not p.passed:
            failing_runs.setdefault(value, result)
        return p.passed

    def judge(value: float) -> bool:
        """Whether `value` passes `repeat` runs (stopping at the first failure)."""
        return all(bench(value) for _ in range(repeat))

    def top_up(value: float, stop_at_failure: bool) -> bool:
        """Run `value` until it has `confirm` runs; whether every run passed."""
        while len(outcomes.get(value, [])) < confirm:
            if not bench(value) and stop_at_failure:
                break
        return all(outcomes[value])

    def bisect(lo: float, hi: float) -> tuple[float, float]:
        while (hi - lo > 1) if integer else (hi / lo > RATE_TOLERANCE):
            mid = math.sqrt(lo * hi) if hi / lo > 4 else (lo + hi) / 2
            mid = min(max(round(mid), lo + 1), hi - 1) if integer else mid
            if judge(mid):
                lo = mid
            else:
                hi = mid
        return lo, hi

    try:
        if judge(high) and top_up(high, stop_at_failure=True):
            # The top of the range passed every run: the bottom must too (a server that
            # fails less load than it passes is not answered by its top alone).
            if judge(low):
                capacity.range_edge = "high"
        elif not judge(low):
            capacity.range_edge = "low"
        else:
            lo, hi = low, high
            for _ in range(SETTLE_ROUNDS):
                lo, hi = bisect(lo, hi)
                # The largest passing load, and one a step under it, on repeated runs: near
                # a noisy knee a load passes once by luck, and the search must go below it.
                under = _step_under(lo, low, integer)
                failed = next(
                    (
                        v
                        for v in (lo, under)
                        if v is not None and not top_up(v, stop_at_failure=True)
                    ),
                    None,
                )
                if failed is None:
                    # The smallest failing load, and one a step over it, on repeated runs
                    # too: how far up runs still meet the SLO is the knee's spread.
                    top_up(hi, stop_at_failure=False)
                    over = _step_over(hi, high, integer)
                    if over is not None:
                        top_up(over, stop_at_failure=False)
                    break
                below = _max_passing(outcomes, below=failed)
                if below is None:
                    capacity.range_edge = "low"
                    break
                lo, hi = below, failed
        _retry_non_monotone(outcomes, top_up)
    except _ClientLimited:
        pass
    return _finish(capacity, outcomes, failing_runs, started)


UNDER_STEP = 0.1
"""The loads around the knee that are confirmed too: this share below the largest passing
load and above the smallest failing one (at least one stream)."""


def _step_under(value: float, low: float, integer: bool) -> float | None:
    """A load UNDER_STEP below `value`, not under `low`; None when `value` is `low`."""
    if value <= low:
        return None
    under = value - max(1, round(UNDER_STEP * value)) if integer else value / (1 + UNDER_STEP)
    return max(under, low)


def _step_over(value: float, high: float, integer: bool) -> float | None:
    """A load UNDER_STEP above `value`, not over `high`; None when `value` is `high`."""
    if value >= high:
        return None
    over = value + max(1, round(UNDER_STEP * value)) if integer else value * (1 + UNDER_STEP)
    return min(over, high)


def _max_passing(outcomes: dict[float, list[bool]], below: float = math.inf) -> float | None:
    """The largest load tried below `below` that passed every run, as did every load tried
    below it."""
    best = None
    for v in sorted(outcomes):
        if v >= below or not all(outcomes[v]):
            break
        best = v
    return best


def _retry_non_monotone(outcomes: dict[float, list[bool]], top_up: Callable[..., bool]) -> None:
    """A load that failed below one that passed every run gets its full runs again."""
    for value in sorted(outcomes):
        if not all(outcomes[value]) and any(all(outcomes[w]) for w in outcomes if w > value):
            top_up(value, stop_at_failure=False)


def _finish(
    capacity: Capacity,
    outcomes: dict[float, list[bool]],
    failing_runs: dict[float, BenchResult],
    started: float,
) -> Capacity:
    """The answer from every run: the largest load that passed all its runs with every load
    tried below it; the knee's spread; the non-monotone pairs; why the first failing load
    failed."""
    capacity.runs = len(capacity.points)
    capacity.elapsed_s = time.monotonic() - started
    capacity.runs_by_value = {f"{v:g}": list(outcomes[v]) for v in sorted(outcomes)}
    values = sorted(outcomes)
    failed = [v for v in values if not all(outcomes[v])]
    capacity.max_passing = _max_passing(outcomes)
    above = [v for v in failed if capacity.max_passing is None or v > capacity.max_passing]
    capacity.first_failing = above[0] if above else None
    capacity.non_monotone = [[v, w] for v in failed for w in values if w > v and all(outcomes[w])]
    if capacity.max_passing is not None and capacity.first_failing is not None:
        met = [v for v in values if any(outcomes[v])]
        capacity.knee_spread = [capacity.max_passing, max(capacity.first_failing, met[-1])]
    failing = capacity.first_failing
    if failing is not None:
        first = next(p for p in capacity.points if p.value == failing and not p.passed)
        capacity.binding = first.failed_terms
        failed_run = failing_runs.get(failing)
        # Information (a light load, a CPU engine's full core) is no reason to stop there.
        capacity.why = [f for f in (failed_run.diagnosis if failed_run else []) if f.alarm]
        if failed_run is not None:
            capacity.reasons = binding_reasons(first, failed_run)
        passing = [p for p in capacity.points if p.value == capacity.max_passing and p.passed]
        if passing:
            capacity.knee = _knee(passing[-1], first)
    return capacity


_TERM = re.compile(r"^(?P<metric>[a-z_]+)_(?P<stat>p50|p90|p99|max)_ms$")


def binding_reasons(point: CapacityPoint, result: BenchResult) -> dict[str, str]:
    """Why the run at `point` missed each of its failed terms, one sentence each."""
    verdict = result.verdict or judge(result)[0]
    tails = {t.metric: t for t in verdict.tails}
    reasons = {}
    for term in point.failed_terms:
        match = _TERM.match(term)
        if match is None:  # "errors (N)"
            first = next(iter(result.first_error_by_code.items()), ("?", ""))
            reasons[term] = (
                f"{point.errors} of {result.requests} requests failed; the first "
                f"{first[0]}: {first[1] or '(no message)'}"
            )
            continue
        metric = f"{match['metric']}_ms"
        measured = (
            result.goodput.terms[term].measured_ms
            if result.goodput and term in result.goodput.terms
            else math.nan
        )
        head = f"{term} {measured:.1f}"
        tail = tails.get(metric)
        explaining = [
            f.rule
            for f in result.diagnosis
            if (f.alarm and f.rule in TAIL_RULES.get(metric, ()))
            or (f.rule == RULE_UNEXPLAINED_TAIL and f.evidence.get("tail") == metric)
        ]
        if tail is not None and tail.state == "bad" and match["stat"] != "p50":
            reasons[term] = (
                f"{head}: the tail is bad (p99 {tail.value_ms:.1f} ms against a "
                f"p50 of {tail.p50_ms:.1f}): " + attribution_words(tail)
            )
            continue
        dist = getattr(result, metric, None)
        median = (
            f"the median is {dist.p50:.1f} ms and the p99 {dist.p99:.1f}"
            if dist is not None and dist.count
            else "the run's values are all high"
        )
        reasons[term] = (
            f"{head}: not a tail of a few: {median}, so most "
            f"{_UNITS.get(metric, 'values')} are slow at this load"
            + (
                f" ({', '.join(explaining)})"
                if explaining
                else f": {_MEANS.get(metric, 'the server is slower at this load')}"
            )
        )
    return reasons


_UNITS = {
    "itl_ms": "gaps between tokens",
    "ttft_ms": "first outputs",
    "tpot_ms": "requests' tokens",
    "e2e_ms": "requests",
    "token_delay_ms": "tokens",
}
_MEANS = {
    "itl_ms": "each step (or the server's work per token) takes longer with more streams: "
    "a batch's cost, or a server that serves streams in turn",
    "ttft_ms": "every request waits before its first output: a queue, a pool, a stream "
    "limit, or prefill that grows with the load",
}


def _knee(passing: CapacityPoint, failing: CapacityPoint) -> str | None:
    """The part of TTFT (p99) that grew the most between the two loads, in one sentence."""
    parts = [
        (failing.ttft_p99_parts_ms[p] - passing.ttft_p99_parts_ms[p], p)
        for p in TTFT_SEGMENTS
        if p in passing.ttft_p99_parts_ms and p in failing.ttft_p99_parts_ms
    ]
    if not parts:
        return None
    grew, part = max(parts)
    if not grew > 0:
        return None
    return (
        f"from {passing.value:g} to {failing.value:g}, TTFT's {part} grew the most at p99 "
        f"({passing.ttft_p99_parts_ms[part]:.1f} -> {failing.ttft_p99_parts_ms[part]:.1f} "
        f"ms): {_PART_MEANS[part]}"
    )
