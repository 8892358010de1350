"""What a run's latency depends on: every gap and every first output set against each variable
the run knows, the way the lab's method changes one variable at a time, but inside one run
where many vary on their own.

Per gap between reads (`diagnosis.reads`): its position in its stream (tokens before it), its
time in the run, its stream's prompt length, the streams open and receiving at its end, the
tokens every stream had received by then, and the context in flight (prompt and output tokens
of the streams receiving then: what a step without a KV cache recomputes); its stream's
worker (with cadence's timing), load process, population and class as groups.
Per first output: its prompt length, its output budget (`max_tokens`), its order of arrival,
the requests waiting for a first output when it was sent, the streams open then, its time in
the run; its worker, load process, population and class as groups.

For each variable, the latency's dependence is measured with scipy.stats: Spearman's rank
correlation (a monotone dependence), the medians of the latency in quantile bins of the
variable with bootstrap confidence intervals at both ends, Theil-Sen's slope (the size of a
linear one), Mann-Whitney's U (a step at a point, one residue of the position every K
tokens, one group apart), Kruskal-Wallis's H (groups). Its shape is the one that fits the
binned medians best: linear, faster than linear (a + b x^c, c from 1.5 to 3), a step at one
point; or periodic (position only), or one group apart.

A dependence *explains* a part of the tail: each slow value's excess (as `reads` defines it)
up to what the dependence predicts over its lowest level at that value of the variable
(`tail_share`: over the whole tail). It is *named* only with an effect (a rise of
`MIN_RISE_MS` and half a typical gap or more, `MIN_RHO` for a monotone one), significance
(p below `P_MAX`, the ends' confidence intervals apart), enough values (`MIN_VALUES`, each
bin `MIN_PER_BIN`), and a meaningful part of the tail (`MIN_TAIL_SHARE`, `MIN_SLOW`, at
`MIN_INSTANTS` moments): a clean
server whose steps jitter and whose lengths vary keeps a flat table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from scipy import stats  # type: ignore[import-untyped]  # scipy ships no types; no stubs installed

from cadence.lab.records import RequestRecord
from cadence.lab.results import DependenceCurve

if TYPE_CHECKING:
    from cadence.lab.analysis.diagnosis.reads import Reads

GAP = "gap"
FIRST = "ttft"
"""The latencies whose dependence is measured: gaps between reads, first outputs."""

MIN_VALUES = 30
"""Fewer values than this (gaps or first outputs) are no basis for a dependence."""
MIN_PER_BIN = 5
BINS = 10
"""The variable is cut in up to this many quantile bins of at least MIN_PER_BIN values."""
P_MAX = 1e-3
"""A dependence is significant below this p-value: about ten variables are tried on each
latency, so 1e-3 keeps a false alarm across all of them near 1%."""
PERIODIC_P_MAX = 1e-6
"""...and a period below this: every period from 2 to 64 positions is tried."""
MIN_RHO = 0.3
"""A monotone dependence (linear, faster, a step) has at least this rank correlation."""
MIN_RISE_MS = 5.0
MIN_RISE_TYPICAL = 0.5
"""...and its binned medians rise by this many ms and this many typical gaps or more (a
busy host moves a median by a few ms, whatever the variable)."""
MIN_RATIO = 1.5
"""A period or a group stands apart when its median is this many times the rest's."""
MIN_TAIL_SHARE = 0.25
"""A dependence is named when it explains this share of its tail or more..."""
MIN_SLOW = 8
"""...over this many slow values or more..."""
MIN_INSTANTS = 4
"""...that ended at this many distinct instants or more (a typical gap and 5 ms apart): the
first burst of a run served in one late step, or one stall, is one moment, whatever the
variables that moment had."""
NONLINEAR_GAIN = 3.0
NONLINEAR_MIN_LEFT = 0.02
"""A step or a faster-than-linear curve is preferred to a line when it leaves a third or less
of what the line leaves unexplained of the binned medians' variance, and the line leaves 2%
or more (noise alone leaves the two alike)."""
FIT_MIN_R2 = 0.8
"""A shape is named as fitting when it explains this share of the binned medians' variance
(else the dependence is monotone, of no simpler shape)."""
PERIODIC_INSTANTS_SHARE = 0.25
"""The slow gaps of a period end at this share of distinct instants or more (`_periodic`)..."""
PERIODIC_WENT_ON_SHARE = 0.5
"""...or the other streams went on receiving during this share of them or more: a wait of
the stream at its position lets the batch go on, a pause of the server at that moment does
not (the longest silence of the others at most `WENT_ON_SILENCE` of the gap)."""
WENT_ON_SILENCE = 0.5
MAX_PERIOD = 64
MIN_PERIODS = 3
"""Periods up to this many positions, seen at least this many times in a stream."""
THEIL_SEN_MAX = 1500
"""Theil-Sen's slope is taken over at most this many values (it costs their square)."""
BOOTSTRAP_RESAMPLES = 400
CONFIDENCE = 0.95
SAME_VARIABLE_RHO = 0.7
"""Two variables this correlated (Spearman) with each other cannot be told apart in the run:
the stronger is named, the other said to go with it."""

LINEAR = "linear"
FASTER = "faster_than_linear"
STEP = "step"
PERIODIC = "periodic"
GROUP = "group"
MONOTONE = "monotone"
SHAPES = (LINEAR, FASTER, STEP, PERIODIC, GROUP, MONOTONE)
"""Every shape a dependence may have (a contract of the findings' evidence)."""

UNITS = {
    "position": "tokens of position",
    "time_in_run_s": "s of the run",
    "prompt_tokens": "prompt tokens",
    "streams_receiving": "streams receiving",
    "streams_open": "streams open",
    "tokens_sent": "tokens sent by all streams",
    "context_in_flight": "tokens of context in flight",
    "max_tokens": "tokens of max_tokens",
    "arrival_order": "requests sent before it",
    "waiting_at_send": "requests waiting at its send",
    "streams_open_at_send": "streams open at its send",
}
"""Each numeric variable and the unit its size is said in."""
GROUPS = ("worker", "process", "population", "request_class")
"""The group variables (categories): a stream's worker (cadence's timing), load process (and
so its connections), client population and request class."""


def _cause(latency: str, variable: str, shape: str) -> str:
    """What usually makes that dependence."""
    rising = shape in (LINEAR, FASTER, MONOTONE, STEP)
    if shape == GROUP:
        return (
            f"one {variable.replace('_', ' ')} served apart: a slower card or replica, a "
            "connection or proxy of its own, a population or class treated differently"
        )
    if variable == "position":
        if shape == PERIODIC:
            return (
                "a per-block cost every K tokens: a KV-cache block allocated or swapped in, "
                "a paged buffer, a detokenizer or writer that flushes every K outputs"
            )
        if shape == STEP:
            return (
                "a change of path past a length: a cache or buffer that fills there, a "
                "switch of kernel or sequence bucket, a block table that spills"
            )
        return (
            "work over the stream's whole context each token: attention without a KV "
            "cache (each step recomputes the prompt and the output so far), or per-token "
            "work over the text so far (re-detokenizing, a stop-string search)"
        )
    if variable in ("time_in_run_s", "tokens_sent", "arrival_order") and rising:
        return (
            "something that grows with the run: a leak (a list or cache kept and scanned "
            "every step), throttling (heat, a power or rate cap), a queue that grows "
            "because the server takes requests slower than they come"
        )
    if variable == "context_in_flight":
        return (
            "each step costs the context of its batch: attention without a KV cache (every "
            "step recomputes each stream's prompt and output), or a cache that spills "
            "(offload, swap)"
        )
    if variable in ("streams_receiving", "streams_open", "streams_open_at_send"):
        return (
            "each stream in flight adds its own work: batching that is not free, a step "
            "serving one stream at a time, a slot or pool per stream"
        )
    if variable == "prompt_tokens":
        if latency == FIRST:
            return (
                "prefill cost: linear in the prompt for the matrix work, as its square for "
                "attention over the prompt (no flash or chunked kernel)"
            )
        return (
            "the stream's prompt in every step: no KV cache of the prompt, or attention "
            "over it each token"
        )
    if variable == "max_tokens":
        return (
            "a scheduler that orders by length (shortest or longest first, a budget per "
            "step by output length), starving the others"
        )
    if variable == "waiting_at_send":
        return (
            "a queue: each request waits for those ahead of it (a slot limit, a batch cap, "
            "one request admitted per step)"
        )
    return "work that grows with this variable"


@dataclass
class Curve:
    """The latency by the variable, as the report draws it: for each bin (a quantile bin of a
    numeric variable, a position within the period, a group) where it is (`x`, or `labels`
    for groups), the values in it, and their median and quartiles."""

    x: list[float]
    median_ms: list[float]
    p25_ms: list[float]
    p75_ms: list[float]
    n: list[int]
    labels: list[str] = field(default_factory=list)


def _curve(
    x: np.ndarray, y: np.ndarray, bins: np.ndarray, labels: list[str] | None = None
) -> Curve:
    """The curve of `y` over the bins (`bins`: each value's bin, 0..n-1), placed at x's
    median in each bin."""
    out = Curve([], [], [], [], [], labels or [])
    for b in range(int(bins.max()) + 1):
        inside = bins == b
        if not np.any(inside):
            continue
        q25, q50, q75 = np.percentile(y[inside], [25, 50, 75])
        out.x.append(round(float(np.median(x[inside])), 3))
        out.median_ms.append(round(float(q50), 2))
        out.p25_ms.append(round(float(q25), 2))
        out.p75_ms.append(round(float(q75), 2))
        out.n.append(int(inside.sum()))
    return out


@dataclass
class Dependence:
    """How one latency depends on one variable."""

    latency: str
    variable: str
    values: int
    strength: float
    """|Spearman's rho| for a numeric variable; for a period or a group, the share of values
    in the slow class or group that are slow, against 0 for none."""
    p_value: float
    shape: str = ""
    size: str = ""
    """The dependence in the run's units, in words ("each 100 tokens of position adds 3.1 ms
    to a gap")."""
    tail_share: float = 0.0
    tail_ms: float = 0.0
    slow_explained: int = 0
    """Slow values it explains some of."""
    significant: bool = False
    evidence: dict[str, float | int | str] = field(default_factory=dict)
    goes_with: list[str] = field(default_factory=list)
    curve: Curve | None = None
    """What a plot of it needs: the latency's median and quartiles by bin of the variable
    (by position within the period, by group)."""
    rise: np.ndarray | None = field(default=None, repr=False)
    """What it predicts of each value over its lowest level, ms (the values in the table's
    order: each gap, or each stream's first output)."""

    @property
    def named(self) -> bool:
        """Significant, with an effect, and explaining a meaningful part of the tail."""
        return (
            self.significant
            and self.tail_share >= MIN_TAIL_SHARE
            and self.slow_explained >= MIN_SLOW
        )

    @property
    def cause(self) -> str:
        return _cause(self.latency, self.variable, self.shape)

    def row(self) -> str:
        """Its line in the dependence table."""
        head = (
            f"{self.variable} rho {self.strength:.2f}"
            if self.variable in UNITS
            else f"{self.variable} apart {self.strength:.2f}"
        )
        p = f"p {self.p_value:.0e}" if self.p_value >= 1e-12 else "p<1e-12"
        if not self.significant:
            return f"{head} ({p}, not significant)"
        return f"{head} ({p}, {self.shape}, {self.tail_share:.0%} of the tail)"


@dataclass
class Table:
    """Every variable's dependence for one latency, strongest first, and the tail's total."""

    latency: str
    values: int
    slow: int
    tail_ms: float
    rows: list[Dependence]

    @property
    def named(self) -> list[Dependence]:
        """The dependences named: the strongest, then those it does not go with."""
        out: list[Dependence] = []
        for d in self.rows:
            if d.named and not any(d.variable in n.goes_with for n in out):
                out.append(d)
        return out

    @property
    def period(self) -> tuple[int, int] | None:
        """(K, residue) of a significant period of the gaps' position: the gaps at those
        positions wait on where the stream is, not on a clock."""
        for d in self.rows:
            if d.shape == PERIODIC and d.significant:
                return int(d.evidence["period"]), int(d.evidence["residue"])
        return None

    def words(self, rows: int = 6) -> str:
        """The table in one line: each variable's strength, p, shape and share."""
        return "; ".join(d.row() for d in self.rows[:rows])


def _instants(ends_ns: np.ndarray, apart_ms: float) -> int:
    """How many distinct moments the values ended at: ends more than `apart_ms` apart."""
    if len(ends_ns) == 0:
        return 0
    return 1 + int(np.count_nonzero(np.diff(np.sort(ends_ns)) > apart_ms * 1e6))


class _Latency:
    """One latency's values, which are slow, their excess, when each ended (`at`, ns), and
    the run's yardstick."""

    def __init__(
        self,
        name: str,
        y: np.ndarray,
        slow: np.ndarray,
        excess: np.ndarray,
        typical: float,
        at: np.ndarray,
    ) -> None:
        self.name = name
        self.y = y
        self.slow = slow
        self.excess = np.where(slow, np.maximum(excess, 0.0), 0.0)
        self.total_ms = float(self.excess.sum())
        self.typical = typical
        self.min_rise = max(MIN_RISE_MS, MIN_RISE_TYPICAL * typical)
        self.at = at

    def explained(self, predicted: np.ndarray) -> tuple[float, float, int]:
        """(share, ms, slow values) of the tail that `predicted` (over its lowest level)
        accounts for, counting only slow values that ended at MIN_INSTANTS distinct
        instants or more (else none)."""
        rise = np.maximum(predicted - float(np.min(predicted)), 0.0)
        claimed = np.minimum(self.excess, rise)
        if _instants(self.at[claimed > 0], max(self.typical, MIN_RISE_MS)) < MIN_INSTANTS:
            return 0.0, 0.0, 0
        ms = float(claimed.sum())
        count = int(np.count_nonzero(claimed[self.slow] > 0))
        return (ms / self.total_ms if self.total_ms > 0 else 0.0), ms, count


def _bins(x: np.ndarray) -> np.ndarray | None:
    """Each value's bin: quantile bins of x, every bin MIN_PER_BIN values or more; None when
    x takes fewer than 3 values."""
    distinct = np.unique(x)
    if len(distinct) < 3:
        return None
    if len(distinct) <= BINS:
        edges = (distinct[:-1] + distinct[1:]) / 2
    else:
        edges = np.unique(np.quantile(x, np.linspace(0, 1, BINS + 1)[1:-1]))
    index = np.searchsorted(edges, x, side="right")
    # Merge bins that are too small into their neighbour.
    while True:
        counts = np.bincount(index)
        present = np.flatnonzero(counts)
        small = [b for b in present if counts[b] < MIN_PER_BIN]
        if not small or len(present) < 3:
            break
        b = small[0]
        k = int(np.searchsorted(present, b))
        into = present[k + 1] if k + 1 < len(present) else present[k - 1]
        index[index == b] = into
    _, index = np.unique(index, return_inverse=True)
    return index if index.max() >= 2 else None


def _median_ci(values: np.ndarray, seed: int) -> tuple[float, float]:
    """The bootstrap confidence interval of a median (percentile method)."""
    if len(values) < 3 or np.all(values == values[0]):
        v = float(np.median(values))
        return v, v
    ci = stats.bootstrap(
        (values,),
        np.median,
        n_resamples=BOOTSTRAP_RESAMPLES,
        confidence_level=CONFIDENCE,
        method="percentile",
        rng=np.random.default_rng(seed),
    ).confidence_interval
    return float(ci.low), float(ci.high)


def _unit(variable: str, span: float) -> float:
    """A round unit to say a slope in: about a third of the span, a power of ten."""
    if span <= 0:
        return 1.0
    unit = 10 ** math.floor(math.log10(max(span / 3, 1e-9)))
    return unit if variable == "time_in_run_s" else max(1.0, unit)


def _num(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:.3g}"


def _numeric(lat: _Latency, variable: str, x: np.ndarray) -> Dependence | None:
    """The dependence of a latency on a numeric variable."""
    bins = _bins(x)
    y = lat.y
    if bins is None or np.all(y == y[0]):
        return None
    rho, p = stats.spearmanr(x, y)
    rho = 0.0 if not np.isfinite(rho) else float(rho)
    p = 1.0 if not np.isfinite(p) else float(p)
    nb = int(bins.max()) + 1
    cx = np.array([np.median(x[bins == b]) for b in range(nb)])
    my = np.array([np.median(y[bins == b]) for b in range(nb)])
    d = Dependence(lat.name, variable, len(y), abs(rho), p)
    predicted = np.interp(x, cx, my)
    d.tail_share, d.tail_ms, d.slow_explained = lat.explained(predicted)
    d.rise = predicted - float(np.min(predicted))
    d.curve = _curve(x, y, bins)
    rise = float(my.max() - my.min())
    lo_b, hi_b = int(np.argmin(my)), int(np.argmax(my))
    lo_ci = _median_ci(y[bins == lo_b], 1)
    hi_ci = _median_ci(y[bins == hi_b], 2)
    d.evidence = {
        "rho": round(rho, 3),
        "p_value": float(f"{p:.3g}"),
        "bins": nb,
        "median_low_ms": round(float(my[lo_b]), 2),
        "median_high_ms": round(float(my[hi_b]), 2),
        "at_low": round(float(cx[lo_b]), 3),
        "at_high": round(float(cx[hi_b]), 3),
        "median_high_ci_low_ms": round(hi_ci[0], 2),
        "median_low_ci_high_ms": round(lo_ci[1], 2),
    }
    d.significant = (
        p < P_MAX and abs(rho) >= MIN_RHO and rise >= lat.min_rise and hi_ci[0] > lo_ci[1]
    )
    if not d.significant:
        return d
    _shape(d, lat, variable, x, y, cx, my, rho)
    return d


def _r2(fitted: np.ndarray, my: np.ndarray) -> float:
    total = float(((my - my.mean()) ** 2).sum())
    return 1.0 - float(((my - fitted) ** 2).sum()) / total if total > 0 else 0.0


def _shape(
    d: Dependence,
    lat: _Latency,
    variable: str,
    x: np.ndarray,
    y: np.ndarray,
    cx: np.ndarray,
    my: np.ndarray,
    rho: float,
) -> None:
    """The shape of a significant monotone dependence, and its size in words."""
    what = "a gap" if lat.name == GAP else "TTFT"
    unit_words = UNITS.get(variable, variable)
    # A line through the binned medians.
    line = np.polyfit(cx, my, 1)
    r2_line = _r2(np.polyval(line, cx), my)
    # a + b x^c, c from 1.5 to 3, on x scaled to [0, 1].
    scale = float(cx.max()) or 1.0
    best_c, r2_power, power = 1.0, -math.inf, (0.0, 0.0)
    if cx.min() >= 0:
        for c in (1.5, 2.0, 2.5, 3.0):
            basis = np.vstack([np.ones_like(cx), (cx / scale) ** c]).T
            coef, *_ = np.linalg.lstsq(basis, my, rcond=None)
            r2 = _r2(basis @ coef, my)
            if r2 > r2_power and coef[1] * rho > 0:
                best_c, r2_power, power = c, r2, (float(coef[0]), float(coef[1]))
    # One step between two bins: two levels.
    r2_step, split = -math.inf, 1
    for k in range(1, len(cx)):
        fitted = np.where(np.arange(len(cx)) < k, np.median(my[:k]), np.median(my[k:]))
        r2 = _r2(fitted, my)
        if r2 > r2_step:
            r2_step, split = r2, k
    d.evidence.update(
        {
            "r2_linear": round(r2_line, 3),
            "r2_power": round(r2_power, 3),
            "r2_step": round(r2_step, 3),
        }
    )

    def better(r2: float, than: float) -> bool:
        return (
            r2 >= FIT_MIN_R2
            and 1 - than >= NONLINEAR_MIN_LEFT
            and (1 - r2) * NONLINEAR_GAIN <= 1 - than
        )

    if better(r2_step, max(r2_line, r2_power)):
        d.shape = STEP
        low_x, high_x = float(cx[split - 1]), float(cx[split])
        below = y[x <= low_x]
        above = y[x >= high_x]
        before, after = float(np.median(below)), float(np.median(above))
        edge_lo = float(x[x <= (low_x + high_x) / 2].max())
        edge_hi = float(x[x > (low_x + high_x) / 2].min())
        ratio = after / before if before > 0 else math.inf
        big, small = (after, before) if after >= before else (before, after)
        lead = (
            (
                f"{what} with {variable} >= {_num(edge_hi)} is {big / max(small, 1e-9):.1f}x "
                f"that with {variable} <= {_num(edge_lo)}"
            )
            if after >= before
            else (
                f"{what} with {variable} <= {_num(edge_lo)} is {big / max(small, 1e-9):.1f}x "
                f"that with {variable} >= {_num(edge_hi)}"
            )
        )
        d.size = f"{lead} ({small:.1f} ms against {big:.1f})"
        d.evidence.update(
            {
                "step_at": round((edge_lo + edge_hi) / 2, 3),
                "below_ms": round(before, 2),
                "above_ms": round(after, 2),
                "step_ratio": round(ratio, 2),
            }
        )
        return
    lo, hi = float(np.quantile(x, 0.1)), float(np.quantile(x, 0.9))
    if best_c > 1 and better(r2_power, r2_line) and abs(power[1]) > 0:
        d.shape = FASTER
        # Said at the binned medians (the fit's own values can undershoot at the low end).
        at = [float(np.interp(v, cx, my)) for v in (lo, hi)]
        power_words = {2.0: "the square", 3.0: "the cube"}.get(best_c, f"the power {best_c:g}")
        d.size = (
            f"{what} grows as {power_words} of {variable}: {at[0]:.1f} ms at "
            f"{_num(lo)}, {at[1]:.1f} ms at {_num(hi)}"
        )
        d.evidence.update(
            {
                "power": best_c,
                "ms_at_p10": round(at[0], 2),
                "ms_at_p90": round(at[1], 2),
                "x_p10": round(lo, 3),
                "x_p90": round(hi, 3),
            }
        )
        return
    d.shape = LINEAR if r2_line >= FIT_MIN_R2 else MONOTONE
    slope, low, high = _theil_sen(x, y)
    unit = _unit(variable, float(x.max() - x.min()))
    verb = "adds" if slope >= 0 else "takes"
    d.size = (
        f"each {_num(unit)} {unit_words} {verb} {abs(slope) * unit:.2g} ms "
        f"{'to' if slope >= 0 else 'from'} {what} (95% CI {low * unit:.2g} to "
        f"{high * unit:.2g}); {float(my[0]):.1f} ms at {_num(float(cx[0]))}, "
        f"{float(my[-1]):.1f} ms at {_num(float(cx[-1]))}"
    )
    d.evidence.update(
        {
            "ms_per_unit": round(slope * unit, 4),
            "unit": unit,
            "ms_per_unit_ci_low": round(low * unit, 4),
            "ms_per_unit_ci_high": round(high * unit, 4),
        }
    )


def _theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Theil-Sen's slope and its 95% interval, over at most THEIL_SEN_MAX values."""
    if len(x) > THEIL_SEN_MAX:
        pick = np.random.default_rng(0).choice(len(x), THEIL_SEN_MAX, replace=False)
        x, y = x[pick], y[pick]
    found = stats.theilslopes(y, x, alpha=CONFIDENCE)
    return float(found.slope), float(found.low_slope), float(found.high_slope)


def _periodic(
    lat: _Latency, position: np.ndarray, t1: np.ndarray, went_on: np.ndarray
) -> Dependence | None:
    """Gaps at one position every K tokens apart from the others. Streams that cross those
    positions at the same instants (opened together, paused together) cannot tell a position
    from a moment: the slow gaps of the period must end at PERIODIC_INSTANTS_SHARE distinct
    instants (a typical gap apart) or more, or the other streams must have gone on receiving
    during PERIODIC_WENT_ON_SHARE of them (`went_on`: for each slow gap)."""
    top = int(position.max()) if len(position) else 0
    slow = lat.slow
    found: list[tuple[float, int, int]] = []
    """(slow share of the class, K, residue) of each period's slowest class."""
    for k in range(2, min(MAX_PERIOD, top // MIN_PERIODS) + 1):
        residue = position % k
        counts = np.bincount(residue, minlength=k)
        slows = np.bincount(residue, weights=slow, minlength=k)
        shares = np.where(counts >= MIN_PER_BIN, slows / np.maximum(counts, 1), 0.0)
        r = int(np.argmax(shares))
        found.append((float(shares[r]), k, r))
    if not found:
        return None
    best = max(s for s, _, _ in found)
    if best <= 0:
        return None
    share, k, r = next(f for f in found if f[0] >= 0.8 * best)  # the shortest period
    inside = (position % k) == r
    # Outputs that pile up during a wait arrive in one read, so some positions end no gap:
    # a wait every 8 leaves gaps only at 8, 14, 15, 16..., and every 4 then looks as slow.
    # The slow positions' common step says the period.
    slow_at = np.unique(position[inside & slow])
    step = int(np.gcd.reduce(np.diff(slow_at))) if len(slow_at) >= MIN_PERIODS else k
    if k < step <= MAX_PERIOD and step % k == 0:
        wider = (position % step) == int(slow_at[0] % step)
        if slow[wider].mean() >= 0.8 * best:
            k, r, share, inside = step, int(slow_at[0] % step), float(slow[wider].mean()), wider
    a, b = lat.y[inside], lat.y[~inside]
    if len(a) < MIN_PER_BIN or len(b) < MIN_PER_BIN:
        return None
    p = float(stats.mannwhitneyu(a, b, alternative="greater").pvalue)
    ma, mb = float(np.median(a)), float(np.median(b))
    d = Dependence(lat.name, "position", len(lat.y), share, p, shape=PERIODIC)
    predicted = np.where(inside, ma, mb)
    d.tail_share, d.tail_ms, d.slow_explained = lat.explained(predicted)
    d.rise = predicted - float(np.min(predicted))
    within = position % k
    d.curve = _curve(within.astype(float), lat.y, within)
    other_share = float(slow[~inside].mean()) if np.any(~inside) else 0.0
    at = np.unique(position[inside & slow])
    ends = t1[inside & slow]
    spread = _instants(ends, lat.typical) / max(1, len(ends))
    others_went_on = float(went_on[inside & slow].mean()) if np.any(inside & slow) else 0.0
    d.significant = bool(
        p < PERIODIC_P_MAX
        and ma >= MIN_RATIO * mb
        and ma - mb >= lat.min_rise
        and share >= 0.5
        and share >= 4 * other_share
        and len(at) >= MIN_PERIODS
        and (spread >= PERIODIC_INSTANTS_SHARE or others_went_on >= PERIODIC_WENT_ON_SHARE)
    )
    shown = ", ".join(str(int(v)) for v in at[:4])
    d.size = (
        f"gaps at positions {shown} ... (every {k}) are {ma / max(mb, 1e-9):.1f}x the "
        f"others ({ma:.1f} ms against {mb:.1f})"
    )
    d.evidence = {
        "period": k,
        "residue": r,
        "median_at_period_ms": round(ma, 2),
        "median_others_ms": round(mb, 2),
        "slow_share_at_period": round(share, 3),
        "slow_share_others": round(other_share, 3),
        "instants_share": round(spread, 3),
        "others_went_on_share": round(others_went_on, 3),
        "p_value": float(f"{p:.3g}"),
    }
    return d


def _group(lat: _Latency, variable: str, labels: list[str]) -> Dependence | None:
    """One group of a category apart from the rest."""
    names = sorted(set(labels))
    if len(names) < 2:
        return None
    codes = np.array([names.index(v) for v in labels])
    groups = [lat.y[codes == i] for i in range(len(names))]
    kept = [i for i, g in enumerate(groups) if len(g) >= MIN_PER_BIN]
    if len(kept) < 2:
        return None
    p_all = float(stats.kruskal(*[groups[i] for i in kept]).pvalue)
    medians = {i: float(np.median(groups[i])) for i in kept}
    apart = max(kept, key=lambda i: medians[i])
    rest = lat.y[codes != apart]
    mr = float(np.median(rest))
    p = float(stats.mannwhitneyu(groups[apart], rest, alternative="greater").pvalue)
    d = Dependence(lat.name, variable, len(lat.y), 0.0, max(p, p_all), shape=GROUP)
    slow_in = float(lat.slow[codes == apart].mean())
    d.strength = round(slow_in, 3)
    predicted = np.where(codes == apart, medians[apart], mr)
    d.tail_share, d.tail_ms, d.slow_explained = lat.explained(predicted)
    d.rise = predicted - float(np.min(predicted))
    d.curve = _curve(codes.astype(float), lat.y, codes, names)
    ratio = medians[apart] / mr if mr > 0 else math.inf
    d.significant = d.p_value < P_MAX and ratio >= MIN_RATIO and medians[apart] - mr >= lat.min_rise
    what = "gaps" if lat.name == GAP else "TTFT"
    d.size = (
        f"{what} of {variable} {names[apart]} are {ratio:.1f}x the others' "
        f"({medians[apart]:.1f} ms against {mr:.1f})"
    )
    d.evidence = {
        "group": names[apart],
        "groups": len(kept),
        "median_group_ms": round(medians[apart], 2),
        "median_others_ms": round(mr, 2),
        "p_value": float(f"{d.p_value:.3g}"),
    }
    return d


def _table(
    lat: _Latency,
    numeric: dict[str, np.ndarray],
    groups: dict[str, list[str]],
    position: np.ndarray | None,
    t1: np.ndarray | None = None,
    went_on: np.ndarray | None = None,
) -> Table:
    rows: list[Dependence] = []
    for name, x in numeric.items():
        found = _numeric(lat, name, x)
        if found is not None:
            rows.append(found)
    if position is not None and t1 is not None and went_on is not None:
        cycle = _periodic(lat, position, t1, went_on)
        # A period is the position's dependence when it explains more than a monotone one.
        if cycle is not None and cycle.significant:
            rows = [
                r
                for r in rows
                if not (r.variable == "position" and r.tail_share <= cycle.tail_share)
            ]
            if not any(r.variable == "position" for r in rows):
                rows.append(cycle)
    for name, labels in groups.items():
        found = _group(lat, name, labels)
        if found is not None:
            rows.append(found)
    rows.sort(key=lambda d: (d.named, d.significant, d.tail_share, d.strength), reverse=True)
    _goes_with(lat, rows, numeric)
    return Table(lat.name, len(lat.y), int(lat.slow.sum()), lat.total_ms, rows)


def _goes_with(lat: _Latency, rows: list[Dependence], numeric: dict[str, np.ndarray]) -> None:
    """For the strongest named dependence on a numeric variable, the weaker named ones it
    accounts for: variables that move with its own (SAME_VARIABLE_RHO), or whose dependence
    is gone once its own is taken out of the latency (the latency less what the strongest
    predicts, tried again)."""
    named = [d for d in rows if d.named and d.variable in numeric and d.shape != PERIODIC]
    if len(named) < 2:
        return
    top = named[0]
    x = numeric[top.variable]
    bins = _bins(x)
    if bins is None:
        return
    nb = int(bins.max()) + 1
    cx = np.array([np.median(x[bins == b]) for b in range(nb)])
    my = np.array([np.median(lat.y[bins == b]) for b in range(nb)])
    rest = _Latency(
        lat.name,
        lat.y - np.interp(x, cx, my) + float(np.median(lat.y)),
        lat.slow,
        lat.excess,
        lat.typical,
        lat.at,
    )
    for other in named[1:]:
        rho = stats.spearmanr(x, numeric[other.variable])[0]
        same = bool(np.isfinite(rho) and abs(rho) >= SAME_VARIABLE_RHO)
        again = None if same else _numeric(rest, other.variable, numeric[other.variable])
        if same or again is None or not again.significant:
            top.goes_with.append(other.variable)


def _varies(values: list[float]) -> bool:
    return len(set(values)) >= 3


def gaps(reads: Reads, records: list[RequestRecord] | None = None) -> Table | None:
    """The gaps' dependence table; None with too few gaps."""
    if len(reads.gaps) < MIN_VALUES or reads.typical_ms <= 0:
        return None
    streams = reads.streams
    t0 = min(s.start_ns for s in streams)
    starts = np.sort([s.start_ns for s in streams])
    firsts = np.array([s.first_ns for s in streams])
    ends = np.array([s.end_ns for s in streams])
    prompts = np.array([s.prompt_tokens for s in streams], dtype=float)
    totals = np.array([sum(s.tokens) for s in streams], dtype=float)
    by_first = np.argsort(firsts)
    by_end = np.argsort(ends)
    first_sorted, end_sorted = firsts[by_first], ends[by_end]
    prompt_by_first = np.concatenate([[0.0], np.cumsum(prompts[by_first])])
    prompt_by_end = np.concatenate([[0.0], np.cumsum(prompts[by_end])])
    total_by_end = np.concatenate([[0.0], np.cumsum(totals[by_end])])
    read_times = np.array([t for s in streams for t in s.times])
    read_tokens = np.array([n for s in streams for n in s.tokens], dtype=float)
    order = np.argsort(read_times)
    read_times, read_cum = read_times[order], np.concatenate([[0.0], np.cumsum(read_tokens[order])])

    t1 = np.array([g.t1 for g in reads.gaps])
    sent = read_cum[np.searchsorted(read_times, t1, side="left")]
    n_first = np.searchsorted(first_sorted, t1, side="left")
    n_end = np.searchsorted(end_sorted, t1, side="left")
    receiving = n_first - n_end
    # Context of the streams receiving: their prompts and what they had got, i.e. every
    # stream's tokens so far less those of the streams already ended.
    context = (prompt_by_first[n_first] - prompt_by_end[n_end]) + (sent - total_by_end[n_end])
    position = np.array([sum(g.stream.tokens[: g.read]) for g in reads.gaps])
    numeric = {
        "position": position.astype(float),
        "time_in_run_s": (t1 - t0) / 1e9,
        "prompt_tokens": np.array([g.stream.prompt_tokens for g in reads.gaps], dtype=float),
        "streams_receiving": receiving.astype(float),
        "streams_open": (np.searchsorted(starts, t1, side="right") - n_end).astype(float),
        "tokens_sent": sent,
        "context_in_flight": context,
    }
    numeric = {k: v for k, v in numeric.items() if len(np.unique(v)) >= 3}
    y = np.array([g.ms for g in reads.gaps])
    slow = y > reads.slow_gap_ms
    lat = _Latency(GAP, y, slow, y - reads.typical_ms, reads.typical_ms, t1)
    groups = _stream_groups(reads, records, [g.stream.number for g in reads.gaps])
    went_on = np.array(
        [
            bool(s) and reads.silence_ms(g.t0, g.t1, g.stream.number) <= WENT_ON_SILENCE * g.ms
            for g, s in zip(reads.gaps, slow, strict=True)
        ]
    )
    return _table(lat, numeric, groups, position if "position" in numeric else None, t1, went_on)


def first_outputs(reads: Reads, records: list[RequestRecord] | None = None) -> Table | None:
    """The first outputs' dependence table; None with too few of them."""
    streams = reads.streams
    if len(streams) < MIN_VALUES or reads.typical_ms <= 0:
        return None
    t0 = min(s.start_ns for s in streams)
    sends = np.array([s.start_ns for s in streams])
    starts_sorted = np.sort(sends)
    firsts_sorted = np.sort([s.first_ns for s in streams])
    ends_sorted = np.sort([s.end_ns for s in streams])
    ok = _ok_records(records, len(streams))
    numeric = {
        "prompt_tokens": np.array([s.prompt_tokens for s in streams], dtype=float),
        "max_tokens": np.array([r.max_tokens for r in ok], dtype=float) if ok else None,
        "arrival_order": stats.rankdata(sends, method="ordinal") - 1.0,
        "waiting_at_send": (
            np.searchsorted(starts_sorted, sends, side="left")
            - np.searchsorted(firsts_sorted, sends, side="left")
        ).astype(float),
        "streams_open_at_send": (
            np.searchsorted(starts_sorted, sends, side="left")
            - np.searchsorted(ends_sorted, sends, side="left")
        ).astype(float),
        "time_in_run_s": (sends - t0) / 1e9,
    }
    kept = {k: v for k, v in numeric.items() if v is not None and len(np.unique(v)) >= 3}
    y = np.array([s.ttft_ms for s in streams])
    slow = y > reads.slow_first_ms
    lat = _Latency(
        FIRST,
        y,
        slow,
        y - reads.typical_ms,
        reads.typical_ms,
        np.array([s.first_ns for s in streams]),
    )
    groups = _stream_groups(reads, records, [s.number for s in streams])
    return _table(lat, kept, groups, None)


def _ok_records(records: list[RequestRecord] | None, streams: int) -> list[RequestRecord]:
    """The records `Reads` made its streams of, in its order (the same filter)."""
    if not records:
        return []
    ok = [r for r in records if r.code == "OK" and r.arrival_ns and sum(r.tokens)]
    return ok if len(ok) == streams else []


def _stream_groups(
    reads: Reads, records: list[RequestRecord] | None, numbers: list[int]
) -> dict[str, list[str]]:
    """Each value's group labels by its stream, for the group variables that vary."""
    ok = _ok_records(records, len(reads.streams))
    out: dict[str, list[str]] = {}
    if not ok:
        return out
    for name in GROUPS:
        labels = [str(getattr(ok[n], name)) for n in numbers]
        if name == "worker" and "-1" in labels:
            continue
        if len(set(labels)) >= 2:
            out[name] = labels
    return out


def tables(records: list[RequestRecord], reads: Reads | None = None) -> dict[str, Table | None]:
    """Both tables of a run from its records: {"gap": ..., "ttft": ...}."""
    if reads is None:
        from cadence.lab.analysis.diagnosis.reads import Reads

        reads = Reads(records)
    if not reads.usable:
        return {GAP: None, FIRST: None}
    return {GAP: gaps(reads, records), FIRST: first_outputs(reads, records)}


def table_evidence(
    records: list[RequestRecord], metric: str, found: dict[str, Table | None] | None = None
) -> dict[str, str | float]:
    """The dependence table of a tail (`metric` itl_ms or ttft_ms) as an `unexplained_tail`
    finding carries it: every variable's strength in one line (`dependence`), the strongest
    variable and its rank correlation; {} without a table. `found`: the run's tables when
    already read."""
    if found is None:
        found = tables(records) if records else {}
    table = found.get(GAP if metric == "itl_ms" else FIRST)
    if table is None or not table.rows:
        return {}
    top = table.rows[0]
    return {
        "dependence": table.words(len(table.rows)),
        "dependence_strongest": top.variable,
        "dependence_strongest_strength": round(top.strength, 3),
        "dependence_strongest_tail_share": round(top.tail_share, 3) if top.significant else 0.0,
    }


def curves(found: dict[str, Table | None]) -> list[DependenceCurve]:
    """The strongest dependence of each latency (the first named, else the table's strongest
    row) with its curve, as the result keeps it for the report."""
    out = []
    for latency in (GAP, FIRST):
        table = found.get(latency)
        if table is None or not table.rows:
            continue
        d = table.named[0] if table.named else table.rows[0]
        if d.curve is None:
            continue
        out.append(
            DependenceCurve(
                latency=latency,
                variable=d.variable,
                shape=d.shape if d.significant else "",
                size=d.size if d.significant else "",
                named=d.named,
                strength=round(d.strength, 3),
                tail_share=round(d.tail_share, 3),
                period=int(d.evidence["period"]) if d.shape == PERIODIC else None,
                x=d.curve.x,
                labels=d.curve.labels,
                median_ms=d.curve.median_ms,
                p25_ms=d.curve.p25_ms,
                p75_ms=d.curve.p75_ms,
                n=d.curve.n,
            )
        )
    return out


__all__ = [
    "FIRST",
    "GAP",
    "SHAPES",
    "Dependence",
    "Table",
    "curves",
    "first_outputs",
    "gaps",
    "table_evidence",
    "tables",
]
