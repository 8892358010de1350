"""Run-to-run noise: `cadence bench --repeat N` runs the workload N times and keeps, for each
of the figures below, every run's value, their mean and the 95% confidence interval of the
mean (Student's t with N − 1 degrees of freedom: the runs' spread, not one run's samples).

`cadence report a.json b.json --fail-if 'ttft_p99_ms>1.1x'` then judges a regression only
outside that noise: when both results hold the figure's repeats, the later run fails when
its interval lies wholly beyond the bound the first run's interval makes (for `>`, its low
end above FACTOR times the first's high end); a mean past the bound with the intervals
overlapping is "within noise" and passes, saying so.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from cadence.lab.results import BenchResult, RepeatedFigure, Repeats

FIGURES = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "ttft_p999_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "tpot_p50_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "tokens_per_s",
    "requests_per_s",
)
"""The figures whose noise a repeated run keeps: DIST_STAT_ms of a distribution, or a rate."""

_T95 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
"""Student's t, two-sided 95%, for 1..30 degrees of freedom (1.96 beyond)."""


def t95(df: int) -> float:
    return _T95[df - 1] if df <= len(_T95) else 1.96


def figure(result: BenchResult, name: str) -> float:
    """A run's value of one of FIGURES (NaN when it lacks it)."""
    if not name.endswith("_ms"):
        return float(getattr(result, name))
    dist, _, stat = name.removesuffix("_ms").rpartition("_")
    d = getattr(result, f"{dist}_ms", None)
    value = getattr(d, stat, None) if d else None
    return float(value) if isinstance(value, int | float) and d and d.count else math.nan


def spread(values: Sequence[float]) -> RepeatedFigure:
    """The values' mean and the 95% confidence interval of the mean (NaN ones left out)."""
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return RepeatedFigure(values=list(values))
    mean = statistics.fmean(kept)
    stdev = statistics.stdev(kept) if len(kept) > 1 else math.nan
    half = t95(len(kept) - 1) * stdev / math.sqrt(len(kept)) if len(kept) > 1 else math.nan
    return RepeatedFigure(
        values=list(values), mean=mean, stdev=stdev, ci95_low=mean - half, ci95_high=mean + half
    )


def repeats(runs: Sequence[BenchResult]) -> Repeats:
    """Each figure over the runs."""
    return Repeats(
        runs=len(runs), figures={name: spread([figure(r, name) for r in runs]) for name in FIGURES}
    )


def beyond_noise(base: RepeatedFigure, run: RepeatedFigure, factor: float, above: bool) -> bool:
    """Whether `run` is past FACTOR times `base` by more than their noise: its interval wholly
    beyond the bound made from the base's interval."""
    if above:
        return run.ci95_low > factor * base.ci95_high
    return run.ci95_high < factor * base.ci95_low
