"""The most a healthy run's ITL p99 may be: near its median, beside the run's own noise floor
(`cadence.lab.analysis.noise_floor`). The verdict judges the tail by it
(`cadence.lab.analysis.verdict`); a rule that reads a tail the verdict calls healthy stays
quiet by it (`diagnosis.itl`). Beside it, the least of a bad tail that the verdict calls
unexplained, which a rule that leaves the rest to the host reads too."""

from __future__ import annotations

from cadence.lab.analysis.noise_floor import NoiseFloor, noise_floor
from cadence.lab.results import BenchResult

ITL_TAIL_RATIO = 1.5
ITL_TAIL_SLACK_MS = 5.0
ITL_TAIL_CAP_RATIO = 2.0
"""ITL p99 of a healthy run: at most 1.5 x p50 + 5 ms, and never above 2 x p50 (a tail twice
the median is always a finding), each beside the run's own noise floor N: at most
1.5 x p50 + max(5 ms, N) and 2 x p50 + N. The 5 ms stays the least slack (what the floor does
not measure: the server's own collections, its threads); a fast step on a host whose
wake-ups are late gets what the host adds on top of twice its median, no more."""
TAIL_MIN_EXCESS_MS = 2.0
"""...but a p99 within 2 ms of the p50 is healthy whatever the ratio: sub-millisecond gaps
double on a timer's resolution and a busy host's scheduling."""
UNEXPLAINED_MIN_SHARE = 0.25
"""Findings whose shares leave this much of a bad tail or more leave it unexplained (shares
are estimates; a rest below this is their error)."""


def itl_bound(p50: float, noise: NoiseFloor | None = None) -> tuple[float, str]:
    """The most a healthy run's ITL p99 may be, and how it was made, in words (with the
    noise floor's terms and their sources when `noise` is given)."""
    n = noise.ms if noise is not None else 0.0
    slack = max(ITL_TAIL_SLACK_MS, n)
    ratio = ITL_TAIL_RATIO * p50 + slack
    cap = ITL_TAIL_CAP_RATIO * p50 + n
    floor = p50 + TAIL_MIN_EXCESS_MS
    bound = max(floor, min(ratio, cap))
    plus_noise = " + noise" if n else ""
    if bound == floor:
        words = f"p50 {p50:.1f} + {TAIL_MIN_EXCESS_MS:g} ms"
    elif bound == cap:
        words = f"{ITL_TAIL_CAP_RATIO:g} x p50 {p50:.1f}{plus_noise}"
    elif slack > ITL_TAIL_SLACK_MS:
        words = f"{ITL_TAIL_RATIO:g} x p50 {p50:.1f} + noise"
    else:
        words = f"{ITL_TAIL_RATIO:g} x p50 {p50:.1f} + {ITL_TAIL_SLACK_MS:g} ms"
    if noise is not None:
        words += f"; {noise.describe()}"
    return bound, words


def itl_tail_within_bound(result: BenchResult) -> bool:
    """The run's ITL p99 is within its bound (`itl_bound` with the run's noise floor): the
    tail the verdict would call healthy, however few gaps it was taken over."""
    itl = result.itl_ms
    if not itl.count or not itl.usable:
        return False
    return itl.p99 <= itl_bound(itl.p50, noise_floor(result))[0]
