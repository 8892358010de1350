"""The most a healthy run's ITL p99 and TTFT p99 may be: near their medians and the engine's
own pace, beside the run's own noise floor (`cadence.lab.analysis.noise_floor`), and each
tail judged by its bound (`tails`). The verdict judges the run by them
(`cadence.lab.analysis.verdict`); a rule that reads a tail the verdict calls healthy stays
quiet by them (`diagnosis.itl`, `diagnosis.threads`). Beside them, the least of a bad tail
that the verdict calls unexplained, which a rule that leaves the rest to the host reads too."""

from __future__ import annotations

from cadence.lab.analysis.noise_floor import NoiseFloor, noise_floor
from cadence.lab.results import BenchResult, Distribution, TailVerdict

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
TTFT_ITL_STEPS = 5.0
TTFT_SLACK_MS = 5.0
"""TTFT p99 of a healthy run: the engine's own time to a first output, plus 5 ITL p50 (a wait
for the step under way and the next, and the way to the client) + 5 ms (the call's set-up),
or the run's noise floor when that is larger (a first output wakes the same threads a gap
does)."""
MIN_GAPS = 100
"""ITL's tail is judged over at least this many gaps."""
MIN_FIRST_OUTPUTS = 16
"""TTFT's tail is judged over at least this many requests with an output."""
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


def ttft_floor(result: BenchResult) -> tuple[float, str]:
    """The engine's own time to a first output, as far as the run knows it (ms), and where
    it comes from; (0, "") when unknown."""
    known: list[tuple[float, str]] = []
    first = result.ttft_segments_ms
    if first and _usable(first.first_step):
        known.append((first.first_step.p99, "the first step's p99"))
    baseline = result.baseline
    if baseline and not baseline.error and _usable(baseline.ttft_ms):
        known.append((baseline.ttft_ms.p99, "the engine-only baseline's TTFT p99"))
    spans = result.server_spans
    prefill = spans.ttft_split_ms.get("prefill") if spans else None
    if prefill is not None and _usable(prefill):
        known.append((prefill.p99, "the server's prefill span p99"))
    return max(known) if known else (0.0, "")


def _time_per_output(result: BenchResult, typical_read_ms: float | None) -> tuple[float, str]:
    """What one output takes, for the TTFT bound: ITL p50, or, where outputs come grouped
    (a writer that flushes every few outputs: most gaps are ~0 and ITL p50 with them), the
    run's typical gap per token between reads (`typical_read_ms`, `diagnosis.reads`; None
    without usable reads), whichever is larger."""
    p50 = result.itl_ms.p50
    if typical_read_ms is not None and typical_read_ms > p50:
        return typical_read_ms, f"the typical gap per token {typical_read_ms:.1f}"
    return p50, f"ITL p50 {p50:.1f}"


def _usable(d: Distribution | None) -> bool:
    return d is not None and d.usable


def tails(result: BenchResult, typical_read_ms: float | None) -> list[TailVerdict]:
    """Each tail of the run with its bound and its state (healthy, bad, not judged), as the
    verdict judges it. `typical_read_ms`: the run's typical gap per token between reads
    (`diagnosis.reads.Reads.typical_ms` of usable reads), else None."""
    itl, ttft = result.itl_ms, result.ttft_ms
    tails = []
    noise = noise_floor(result)
    if itl.count:
        bound, words = itl_bound(itl.p50, noise)
        tails.append(
            TailVerdict(
                metric="itl_ms",
                value_ms=itl.p99,
                p50_ms=itl.p50,
                bound_ms=bound,
                bound=words,
                values=itl.count,
                noise_ms=round(noise.ms, 3),
                noise_terms_ms=noise.terms_ms,
                state="not_judged"
                if itl.count < MIN_GAPS or not itl.usable
                else "bad"
                if itl.p99 > bound
                else "healthy",
            )
        )
    if ttft.count:
        tail = TailVerdict(metric="ttft_ms", value_ms=ttft.p99, p50_ms=ttft.p50, values=ttft.count)
        if itl.usable and itl.count:
            floor, source = ttft_floor(result)
            step, step_words = _time_per_output(result, typical_read_ms)
            slack = max(TTFT_SLACK_MS, noise.ms)
            tail.bound_ms = floor + TTFT_ITL_STEPS * step + slack
            tail.bound = (
                f"{TTFT_ITL_STEPS:g} x {step_words} + "
                + (f"noise {slack:.1f} ms" if slack > TTFT_SLACK_MS else f"{TTFT_SLACK_MS:g} ms")
                + (f" + {source} {floor:.1f}" if source else "")
            )
            tail.noise_ms, tail.noise_terms_ms = round(noise.ms, 3), noise.terms_ms
            tail.state = (
                "not_judged"
                if ttft.count < MIN_FIRST_OUTPUTS or not ttft.usable
                else "bad"
                if ttft.p99 > tail.bound_ms
                else "healthy"
            )
        else:
            tail.bound = "no ITL to measure it against (outputs of one token)"
        tails.append(tail)
    return tails
