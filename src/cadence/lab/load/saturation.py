"""The over-saturation stop (`cadence bench --rate LO:HI --ramp S --saturation-stop`, or
`--stages`): end a rising load once the server no longer keeps up, and say at what rate.

The load process cuts its run into windows of `window_s` and judges each finished one by
the requests that ended in it: the rate they ended at (the achieved rate) against the rate
the schedule offered over it, and their TTFT p50. A window is saturated when the achieved
rate falls short of the offered one by more than `SHORTFALL`, and the TTFT p50 is above
`GROWTH` times the lowest window's and above the window's before it (TTFT still growing: a
queue that builds). A window in which requests were sent and none ended counts as saturated
when one before it was not empty. `STREAK` saturated windows in a row end the run: no
request is sent after, those in flight run to their end.

The knee is the offered rate at the middle of the window before the streak's first: the load
at which the achieved rate stopped following the offered one and TTFT left its floor (a
queue that shows in a window's TTFT p50 began to build in the window before). Each load
process judges its own share of the requests (rates scaled by the processes' number).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence

from cadence.lab.records import Saturation

SHORTFALL = 0.1
"""A window's achieved rate under (1 - SHORTFALL) x its offered rate falls short."""
GROWTH = 2.0
"""A window's TTFT p50 above GROWTH x the lowest window's has left its floor."""
STREAK = 2
"""Saturated windows in a row that end the run."""
MIN_REQUESTS = 3
"""Requests a window's TTFT p50 is taken over, at the least."""


def offered_between(stages: Sequence[tuple[float, float, float]], a: float, b: float) -> float:
    """The schedule's requests from `a` to `b` seconds into the run (the rate's integral)."""
    total, start = 0.0, 0.0
    for r0, r1, length in stages:
        end = start + length
        lo, hi = max(a, start), min(b, end)
        if hi > lo:
            slope = (r1 - r0) / length if math.isfinite(length) and length else 0.0
            total += (hi - lo) * (r0 + slope * ((lo + hi) / 2 - start))
        start = end
        if start >= b:
            break
    return total


class SaturationWatch:
    """One load process's judge of the windows (see the module's docstring)."""

    def __init__(
        self, window_s: float, stages: Sequence[tuple[float, float, float]], processes: int = 1
    ) -> None:
        self._window_s, self._stages, self._processes = window_s, list(stages), processes
        self._ended: defaultdict[int, list[float]] = defaultdict(list)
        """The TTFT (ms, or NaN) of each request that ended, by the window it ended in."""
        self._sent: Counter[int] = Counter()
        """Requests sent, by window."""
        self._judged = 0
        self._floor = math.inf
        self._previous = math.nan
        self._streak = 0
        self._knee_at = 0.0
        self.result = Saturation(window_s=window_s)

    def sent(self, at_s: float) -> None:
        self._sent[int(at_s // self._window_s)] += 1

    def ended(self, at_s: float, ttft_ms: float) -> None:
        self._ended[int(at_s // self._window_s)].append(ttft_ms)

    def stop(self, now_s: float) -> bool:
        """Judge the windows finished by `now_s`; True once the run should end."""
        w = self._window_s
        while not self.result.stopped and (self._judged + 1) * w <= now_s:
            self._judge(self._judged, self._judged * w, (self._judged + 1) * w)
            self._judged += 1
        return self.result.stopped

    def _judge(self, window: int, a: float, b: float) -> None:
        scale = self._processes / (b - a)
        ended_ttfts = self._ended.pop(window, [])
        ttfts = sorted(t for t in ended_ttfts if not math.isnan(t))
        ended = len(ended_ttfts)
        sent = self._sent.pop(window, 0)
        offered = offered_between(self._stages, a, b) / (b - a)
        achieved = ended * scale
        p50 = ttfts[len(ttfts) // 2] if len(ttfts) >= MIN_REQUESTS else math.nan
        self.result.windows.append([a, offered, achieved, p50])
        short = achieved < (1 - SHORTFALL) * offered
        if math.isnan(p50):
            # Nothing (or too little) came back: saturated only if requests went out and
            # windows before this one did see answers.
            saturated = short and sent > 0 and math.isfinite(self._floor) and not ttfts
            p50 = math.inf if saturated else math.nan
        else:
            saturated = short and p50 > GROWTH * self._floor and not p50 <= self._previous
            self._floor = min(self._floor, p50)
        self.result.peak_achieved_rate_per_s = max(
            self.result.peak_achieved_rate_per_s or 0.0, achieved
        )
        self._streak = self._streak + 1 if saturated else 0
        if self._streak == 1:  # the queue began to build in the window before: its middle
            self._knee_at = max(0.0, a - (b - a) / 2)
        if self._streak >= STREAK:
            self.result.stopped = True
            self.result.stopped_at_s = b
            self.result.knee_at_s = self._knee_at
            self.result.knee_rate_per_s = _rate_at(self._stages, self._knee_at)
        if not math.isnan(p50):
            self._previous = p50


def _rate_at(stages: Sequence[tuple[float, float, float]], t: float) -> float:
    start = 0.0
    for r0, r1, length in stages:
        if t < start + length:
            return r0 + (r1 - r0) * (t - start) / length if math.isfinite(length) else r0
        start += length
    return stages[-1][1] if stages else math.nan
