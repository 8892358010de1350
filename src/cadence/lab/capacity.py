"""`cadence capacity`: the largest load (streams at once, or requests per second) a server
takes while a latency SLO holds, and what binds it there.

The search runs the bench at the top of the range, then at the bottom (bracketing), then
bisects between the largest passing and the smallest failing value: geometrically while they
are far apart (a knee can sit anywhere in a wide range), then by halves, to adjacent integers
(concurrency) or within 5% (rate). With `repeat` above 1 each value runs that many times
and passes only when every run does, so a value near the boundary is not judged on one
lucky run. A run the client limited (its load processes saturated, or behind the open
loop's schedule) does not count as the server's: the search stops and says so.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable

from cadence.lab.analysis.diagnosis import (
    RULE_CLIENT_BEHIND_SCHEDULE,
    RULE_CLIENT_SATURATED,
    RULE_UNDER_CAPACITY,
)
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
        value=value, passed=bool(goodput and goodput.passed) and not errors
        and not result.aborted,
        client_limited=bool(_CLIENT_LIMITED & set(rules)),
        ttft_p99_ms=result.ttft_ms.p99, itl_p99_ms=result.itl_ms.p99,
        tokens_per_s=result.tokens_per_s,
        goodput_tokens_per_s=goodput.tokens_per_s if goodput else math.nan,
        failed_terms=failed + ([f"errors ({errors})"] if errors else []),
        errors=errors, diagnosis=rules,
        ttft_p99_parts_ms={part: getattr(result.ttft_segments_ms, part).p99
                           for part in TTFT_SEGMENTS} if result.ttft_segments_ms else {})


def search(run: Callable[[float], BenchResult], kind: str, low: float, high: float,
           slo: list[SloTerm], repeat: int = 1,
           progress: Callable[[str], None] = print) -> Capacity:
    """The largest value in [low, high] whose runs meet the SLO; `run(value)` benches once."""
    started = time.monotonic()
    capacity = Capacity(search=kind, slo=slo)
    failing_runs: dict[float, BenchResult] = {}

    def judge(value: float) -> bool | None:
        """Whether `value` passes (every repeat); None when the client limited a run."""
        for _ in range(repeat):
            result = run(value)
            p = point(value, result)
            capacity.points.append(p)
            progress(f"{kind} {value:g}: " + ("passed" if p.passed else
                     f"failed ({', '.join(p.failed_terms)})")
                     + (" [client-limited]" if p.client_limited else ""))
            if p.client_limited:
                capacity.client_limited_at = value
                return None
            if not p.passed:
                failing_runs[value] = result
                return False
        return True

    def finish() -> Capacity:
        capacity.runs = len(capacity.points)
        capacity.elapsed_s = time.monotonic() - started
        failing = capacity.first_failing
        if failing is not None:
            first = next(p for p in capacity.points if p.value == failing and not p.passed)
            capacity.binding = first.failed_terms
            failed_run = failing_runs.get(failing)
            capacity.why = [f for f in (failed_run.diagnosis if failed_run else [])
                            if f.rule != RULE_UNDER_CAPACITY]
            if failed_run is not None:
                capacity.reasons = binding_reasons(first, failed_run)
            passing = [p for p in capacity.points
                       if p.value == capacity.max_passing and p.passed]
            if passing:
                capacity.knee = _knee(passing[-1], first)
        return capacity

    integer = kind == "concurrency"
    verdict = judge(high)
    if verdict is None:
        return finish()
    if verdict:
        capacity.max_passing = high
        return finish()
    capacity.first_failing = high
    verdict = judge(low)
    if verdict is None:
        return finish()
    if not verdict:
        capacity.first_failing = low
        return finish()
    lo, hi = low, high
    while (hi - lo > 1) if integer else (hi / lo > RATE_TOLERANCE):
        mid = math.sqrt(lo * hi) if hi / lo > 4 else (lo + hi) / 2
        mid = min(max(round(mid), lo + 1), hi - 1) if integer else mid
        verdict = judge(mid)
        if verdict is None:
            return finish()
        if verdict:
            lo = mid
        else:
            hi = mid
    capacity.max_passing, capacity.first_failing = lo, hi
    return finish()


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
            reasons[term] = (f"{point.errors} of {result.requests} requests failed; the first "
                             f"{first[0]}: {first[1] or '(no message)'}")
            continue
        metric = f"{match['metric']}_ms"
        measured = result.goodput.terms[term].measured_ms if result.goodput and \
            term in result.goodput.terms else math.nan
        head = f"{term} {measured:.1f}"
        tail = tails.get(metric)
        explaining = [f.rule for f in result.diagnosis
                      if f.rule in TAIL_RULES.get(metric, ())
                      or (f.rule == RULE_UNEXPLAINED_TAIL and f.evidence.get("tail") == metric)]
        if tail is not None and tail.state == "bad" and match["stat"] != "p50":
            reasons[term] = (f"{head}: the tail is bad (p99 {tail.value_ms:.1f} ms against a "
                             f"p50 of {tail.p50_ms:.1f}): " + attribution_words(tail))
            continue
        dist = getattr(result, metric, None)
        median = (f"the median is {dist.p50:.1f} ms and the p99 {dist.p99:.1f}"
                  if dist is not None and dist.count else "the run's values are all high")
        reasons[term] = (f"{head}: not a tail of a few: {median}, so most "
                         f"{_UNITS.get(metric, 'values')} are slow at this load"
                         + (f" ({', '.join(explaining)})" if explaining else
                            f": {_MEANS.get(metric, 'the server is slower at this load')}"))
    return reasons


_UNITS = {"itl_ms": "gaps between tokens", "ttft_ms": "first outputs",
          "tpot_ms": "requests' tokens", "e2e_ms": "requests", "token_delay_ms": "tokens"}
_MEANS = {
    "itl_ms": "each step (or the server's work per token) takes longer with more streams: "
              "a batch's cost, or a server that serves streams in turn",
    "ttft_ms": "every request waits before its first output: a queue, a pool, a stream "
               "limit, or prefill that grows with the load",
}


def _knee(passing: CapacityPoint, failing: CapacityPoint) -> str | None:
    """The part of TTFT (p99) that grew the most between the two loads, in one sentence."""
    parts = [(failing.ttft_p99_parts_ms[p] - passing.ttft_p99_parts_ms[p], p)
             for p in TTFT_SEGMENTS
             if p in passing.ttft_p99_parts_ms and p in failing.ttft_p99_parts_ms]
    if not parts:
        return None
    grew, part = max(parts)
    if not grew > 0:
        return None
    return (f"from {passing.value:g} to {failing.value:g}, TTFT's {part} grew the most at p99 "
            f"({passing.ttft_p99_parts_ms[part]:.1f} -> {failing.ttft_p99_parts_ms[part]:.1f} "
            f"ms): {_PART_MEANS[part]}")

