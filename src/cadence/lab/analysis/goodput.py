"""Goodput under a latency SLO (`cadence bench --slo ttft_p99_ms=150 --slo itl_p99_ms=40`).

A term is METRIC_STAT_ms=BOUND with METRIC one of ttft, itl, tpot, e2e, token_delay and STAT
one of p50, p90, p99, max. A request is good when it succeeded and its own value meets every
term: its TTFT, TPOT and end-to-end time as they are, its own ITL and token delays at the
term's percentile. The run passes when the run's percentiles (the result's distributions)
meet every term. Goodput is the good requests (and their tokens) per second of the run.
"""

from __future__ import annotations

import math
import re

from cadence.lab.analysis.stats import is_ok, itl_points, ttft_ms
from cadence.lab.percentile import percentile
from cadence.lab.records import RequestRecord
from cadence.lab.results import Distribution, Goodput, RunStats, SloTerm, TermResult

METRICS = ("ttft", "itl", "tpot", "e2e", "token_delay")
STATS = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0}
_TERM = re.compile(r"^(?P<metric>[a-z0-9_]+?)_(?P<stat>p50|p90|p99|max)_ms=(?P<bound>[0-9.]+)$")
_NS_PER_MS = 1e6


def parse_term(text: str) -> SloTerm:
    """`ttft_p99_ms=150` as a term; ValueError with what is accepted."""
    match = _TERM.match(text.strip())
    if match is None or match["metric"] not in METRICS:
        raise ValueError(
            f"--slo {text!r}: expected METRIC_STAT_ms=BOUND with METRIC one of "
            f"{', '.join(METRICS)} and STAT one of {', '.join(STATS)} "
            "(e.g. ttft_p99_ms=150)"
        )
    bound = float(match["bound"])
    if not bound > 0:
        raise ValueError(f"--slo {text!r}: the bound must be a positive number of ms")
    return SloTerm(metric=match["metric"], stat=match["stat"], bound_ms=bound)


def name(term: SloTerm) -> str:
    return f"{term.metric}_{term.stat}_ms"


def _own(r: RequestRecord, term: SloTerm) -> float:
    """The request's own value of the term's metric (NaN when it has none)."""
    if term.metric == "ttft":
        return ttft_ms(r)
    e2e = (r.arrival_ns[-1] - r.start_ns) / _NS_PER_MS
    if term.metric == "e2e":
        return e2e
    tokens = sum(r.tokens)
    if term.metric == "tpot":
        return (e2e - ttft_ms(r)) / (tokens - 1) if tokens > 1 else math.nan
    if term.metric == "itl":
        values = sorted(itl for _, itl in itl_points(r))
    else:  # token_delay: each chunk's arrival after the step that made it (server timing)
        values = sorted(
            (a - end) / _NS_PER_MS for a, end in zip(r.arrival_ns, r.t_step_end_ns) if end
        )
    return percentile(values, STATS[term.stat]) if values else math.nan


def _meets(value: float, term: SloTerm) -> bool:
    # A request without the value (one token: no ITL) cannot fail the term.
    return math.isnan(value) or value <= term.bound_ms


def goodput(records: list[RequestRecord], terms: list[SloTerm], stats: RunStats) -> Goodput:
    """Good requests per second and each term against the run's own percentile."""
    good = [r for r in records if is_ok(r) and all(_meets(_own(r, term), term) for term in terms)]
    wall_s = stats.wall_s
    results = {}
    for term in terms:
        dist = getattr(stats, f"{term.metric}_ms", None)
        measured = (
            getattr(dist, term.stat) if isinstance(dist, Distribution) and dist.count else math.nan
        )
        results[name(term)] = TermResult(
            bound_ms=term.bound_ms,
            measured_ms=measured,
            met=not math.isnan(measured) and measured <= term.bound_ms,
        )
    per_s = (lambda n: n / wall_s) if wall_s and math.isfinite(wall_s) else (lambda n: math.nan)
    return Goodput(
        terms=results,
        passed=all(t.met for t in results.values()),
        requests_per_s=per_s(len(good)),
        tokens_per_s=per_s(sum(r.output_tokens for r in good)),
        good_share=len(good) / len(records) if records else math.nan,
        good_requests=len(good),
    )


def slo_names(slo: list[SloTerm]) -> str:
    """The SLO's terms in words ("ttft_p99_ms <= 100, itl_p90_ms <= 20")."""
    return ", ".join(f"{name(t)} <= {t.bound_ms:g}" for t in slo)


def terms_words(goodput: Goodput) -> str:
    """Each SLO term against the run's value, in words ("ttft_p99_ms 80.1 <= 100 met")."""
    return ", ".join(
        f"{term} {t.measured_ms:.1f} <= {t.bound_ms:g} " + ("met" if t.met else "NOT met")
        for term, t in goodput.terms.items()
    )
