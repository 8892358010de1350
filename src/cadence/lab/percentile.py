"""Percentiles of sorted values, as every aggregate of the lab reports them, and the
`Distribution` of a quantity made from them. Below the stages: the measurements summarise
their own samples with it (`measure/wakeups.py`) as the analysis does the requests'."""

from __future__ import annotations

import math
from collections.abc import Iterable

from cadence.lab.results import Distribution


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, interpolating linearly between ranks."""
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution(values: Iterable[float]) -> Distribution:
    ordered = sorted(values)
    if not ordered:
        return Distribution()
    return Distribution(
        count=len(ordered),
        mean=sum(ordered) / len(ordered),
        p50=percentile(ordered, 50),
        p90=percentile(ordered, 90),
        p99=percentile(ordered, 99),
        max=ordered[-1],
        min=ordered[0],
        p999=percentile(ordered, 99.9),
    )
