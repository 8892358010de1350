"""PNG plots of a `cadence bench` result (and of sweeps), for `cadence report`, and the
readers of a typed result (`cadence.lab.results`) they and the report share.

matplotlib is imported inside the functions, and figures are drawn on an Agg canvas
without pyplot, so importing this module stays cheap and no global backend is touched.
Every function returns the path it wrote, or None when there was nothing to plot.
Per-request values use the definitions in `cadence.lab.analysis.stats`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from cadence.lab.analysis.stats import TTFT_SEGMENTS, is_ok, itl_points, percentile, ttft_ms
from cadence.lab.load.records import RequestRecord
from cadence.lab.results import (
    BenchResult,
    Capacity,
    Distribution,
    Sweep,
    SweepPoint,
    System,
    WorkerCurve,
)

_DPI = 100
SEGMENT_ORDER = ("client_to_front", "queue", "engine_step", "transfer", "buffer", "send")
_TOKEN_SEGMENT_ORDER = SEGMENT_ORDER[2:]
"""The per-chunk segments; client_to_front and queue are one per request."""


# -- data -----------------------------------------------------------------------------------


def ttft_values(records: Sequence[RequestRecord]) -> list[float]:
    """TTFT (ms) of every OK request, as in `stats.summarize`."""
    return [ttft_ms(r) for r in records if is_ok(r)]


def itl_values(records: Sequence[RequestRecord]) -> list[float]:
    """ITL (ms) of every chunk after the first of every OK request, as in `stats.summarize`."""
    return [v for r in records if is_ok(r) for _, v in itl_points(r)]


AGGREGATES = (
    "ttft_ms", "connect_ms", "ttft_after_connect_ms", "itl_ms", "chunk_gap_ms", "tpot_ms",
    "e2e_ms", "token_delay_ms", "chunk_tokens",
)
"""Aggregates in the order they are shown; any other distribution-shaped key follows."""
STATS = ("mean", "p50", "p90", "p99", "max")
"""The statistics of a distribution the report shows, in order."""


def aggregate_names(result: Any) -> list[str]:
    """The distributions of a result (or of its baseline) that counted something, known ones
    first."""
    counted = [n for n in result.__struct_fields__
               if isinstance(d := getattr(result, n), Distribution) and d.count]
    return [n for n in AGGREGATES if n in counted] + [n for n in counted if n not in AGGREGATES]


def field(obj: Any, name: str) -> Any:
    """A struct's field or a dict's key (a result's per-name tables are dicts); None when
    absent or unset."""
    value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return None if value is msgspec.UNSET else value


def _finite(values: Iterable[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


# -- figures --------------------------------------------------------------------------------


def _figure(width: float = 8.0, height: float = 4.5, ncols: int = 1, nrows: int = 1,
            sharex: bool = True):
    """A figure on an Agg canvas (no pyplot) and its axes, as a flat list; rows share their
    x axis unless `sharex` is False."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(nrows, ncols, squeeze=False, sharex=sharex and nrows > 1).flat)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, axes


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _log_if_skewed(ax, values: Sequence[float], axis: str = "x") -> None:
    """Log scale when the largest value dwarfs the median (a long tail hides the body)."""
    positive = sorted(v for v in values if v > 0)
    if len(positive) < 2 or len(positive) != len(values):
        return
    if positive[-1] / percentile(positive, 50) > 50:
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")


def plot_cdf(values: Sequence[float], path: Path, title: str, xlabel: str) -> Path | None:
    """Empirical CDF of `values`, with p50/p90/p99 marked."""
    ordered = sorted(_finite(values))
    if not ordered:
        return None
    n = len(ordered)
    fig, (ax,) = _figure()
    ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", lw=1.5)
    for q, style in ((50, ":"), (90, "--"), (99, "-.")):
        v = percentile(ordered, q)
        ax.axvline(v, color="grey", ls=style, lw=1, label=f"p{q} = {v:.2f}")
    _log_if_skewed(ax, ordered, "x")
    ax.set_ylim(0, 1.01)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction ≤ x")
    ax.set_title(f"{title} (n = {n})")
    ax.legend(loc="lower right")
    return _save(fig, path)


def plot_ttft_cdf(records: Sequence[RequestRecord], path: Path) -> Path | None:
    return plot_cdf(ttft_values(records), path, "TTFT CDF", "time to first token (ms)")


def plot_itl_cdf(records: Sequence[RequestRecord], path: Path) -> Path | None:
    return plot_cdf(itl_values(records), path, "ITL CDF", "inter-token latency (ms per token)")


def pick_streams(records: Sequence[RequestRecord], count: int = 5) -> list[RequestRecord]:
    """Up to `count` OK streams with ITL values: the one holding the worst ITL, then streams
    spread evenly over the start order."""
    candidates = sorted((r for r in records if is_ok(r) and itl_points(r)), key=lambda r: r.start_ns)
    if len(candidates) <= count:
        return candidates
    worst = max(candidates, key=lambda r: max(v for _, v in itl_points(r)))
    picked = [worst]
    rest = [r for r in candidates if r is not worst]
    need = count - 1
    for k in range(need):
        picked.append(rest[round(k * (len(rest) - 1) / max(1, need - 1))])
    return sorted(picked, key=lambda r: r.start_ns)


def plot_itl_over_time(records: Sequence[RequestRecord], path: Path, streams: int = 5) -> Path | None:
    """Per-chunk ITL of a few streams against the time since the run started."""
    picked = pick_streams(records, streams)
    if not picked:
        return None
    t0 = min(r.start_ns for r in records)
    fig, (ax,) = _figure(9.0, 4.5)
    every = []
    worst = max(picked, key=lambda r: max(v for _, v in itl_points(r)))
    for r in picked:
        points = itl_points(r)
        xs = [(a - t0) / 1e9 for a, _ in points]
        ys = [v for _, v in points]
        every.extend(ys)
        label = f"{r.request_id} (p{r.process})" + (" · worst ITL" if r is worst else "")
        ax.plot(xs, ys, marker=".", ms=3, lw=0.8, label=label)
    _log_if_skewed(ax, every, "y")
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel("ITL (ms per token)")
    ax.set_title(f"ITL over time, {len(picked)} streams")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


class Stack(msgspec.Struct, frozen=True):
    """One stacked bar: parts that add up to `total` (means only: a mean of a sum is the sum of
    the means, which no percentile is)."""

    title: str
    parts: list[tuple[str, float]]

    @property
    def total(self) -> float:
        return sum(v for _, v in self.parts)


def segment_stacks(result: BenchResult) -> list[Stack]:
    """The segment bars of a run, each of one unit: a request's time to first token (from
    `ttft_segments_ms`), and a chunk's path from its step's start to the client (the per-chunk
    parts of `segments_ms`). The per-request parts of `segments_ms` (client_to_front, queue)
    are not a chunk's and are left out of the second."""
    stacks = []
    for key, order, title in (
        ("ttft_segments_ms", TTFT_SEGMENTS, "time to first token, per request"),
        ("segments_ms", _TOKEN_SEGMENT_ORDER, "a token's path, per chunk: step start to client"),
    ):
        segments = field(result, key)
        if segments is None:
            continue
        parts = [(n, float(d.mean)) for n in order
                 if (d := getattr(segments, n)).count and math.isfinite(d.mean)]
        if parts:
            stacks.append(Stack(title, parts))
    return stacks


def plot_segments(stacks: Sequence[Stack], path: Path) -> Path | None:
    """One horizontal bar per stack, its parts' means side by side and the total at its end;
    each bar has its own axis (a token's path is far shorter than a TTFT)."""
    if not stacks:
        return None
    fig, axes = _figure(9.0, 1.0 + 1.6 * len(stacks), nrows=len(stacks), sharex=False)
    names = list(dict.fromkeys(n for s in stacks for n, _ in s.parts))
    colors = dict(zip(names, _palette(len(names))))
    for ax, stack in zip(axes, stacks):
        left = 0.0
        for name, value in stack.parts:
            ax.barh([0], [value], left=left, color=colors[name], label=name, height=0.6)
            if stack.total and value / stack.total > 0.08:  # label only the parts with room
                ax.text(left + value / 2, 0, f"{value:.2f}", ha="center", va="center",
                        fontsize="x-small")
            left += value
        ax.text(left, 0, f"  {stack.total:.2f} ms", va="center", fontsize="small")
        ax.set_xlim(0, left * 1.18 or 1)
        ax.set_yticks([])
        ax.set_title(f"{stack.title} (means, ms)", fontsize="medium")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1].set_xlabel("ms")
    return _save(fig, path)


def _palette(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def plot_cpu(system: System, path: Path) -> Path | None:
    """CPU % of every sampled process against time; with card samples ([t, util %, ...]),
    a second panel of each card's utilisation on the same time axis."""
    series = {name: p for name, p in system.processes.items() if p.samples}
    cards = [gpu for gpu in system.gpus if gpu.samples]
    if not series and not cards:
        return None
    both = bool(series and cards)
    fig, axes = _figure(9.0, 7.0 if both else 4.5, nrows=2 if both else 1)
    k = 0
    if series:
        ax = axes[k]
        for name, p in series.items():
            label = f"{name} (mean {p.cpu_pct_mean:.0f} %)" if p.cpu_pct_mean is not None else name
            ax.plot([s[0] for s in p.samples], [s[1] for s in p.samples], lw=1, label=label)
        ax.axhline(100, color="grey", ls=":", lw=1)
        ax.set_ylabel("CPU % (100 = one core)")
        ax.set_ylim(bottom=0)
        ax.set_title("CPU per process")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        k += 1
    if cards:
        ax = axes[k]
        for gpu in cards:
            ax.plot([s[0] for s in gpu.samples], [s[1] for s in gpu.samples], lw=1,
                    label=f"card {gpu.index}")
        ax.set_ylabel("card utilisation %")
        ax.set_ylim(0, 105)
        ax.set_title("Card utilisation")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1].set_xlabel("time since sampling started (s)")
    return _save(fig, path)


def plot_worker_curves(workers: list[WorkerCurve] | None, path: Path, bin_s: float = 0.25
                       ) -> Path | None:
    """Each worker's output curve on one time axis: its step time, this run's sequences per
    step, and the tokens it made per second (steps' sequences over `bin_s` windows)."""
    curves = [w for w in workers or [] if w.series]
    if not curves:
        return None
    fig, axes = _figure(9.0, 8.0, nrows=3)
    for w in curves:
        series = w.series
        label = f"worker {w.worker}" + (f" ({w.device})" if w.device else "")
        t = [p[0] for p in series]
        axes[0].plot(t, [p[1] for p in series], lw=0.8, label=label)
        axes[1].plot(t, [p[2] for p in series], lw=0.8, label=label)
        # The series may be thinned: scale each kept step by the steps it stands for.
        weight = (w.steps or len(series)) / len(series)
        bins: dict[int, float] = {}
        for p in series:
            k = int(p[0] / bin_s)
            bins[k] = bins.get(k, 0.0) + p[2] * weight
        keys = sorted(bins)
        axes[2].plot([(k + 0.5) * bin_s for k in keys], [bins[k] / bin_s for k in keys],
                     lw=1, marker=".", label=label)
    for ax, ylabel in zip(axes, ("step (ms)", "sequences per step", "tokens/s"), strict=True):
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[0].set_title("Each worker's output curve")
    axes[-1].set_xlabel("time since the run's first step (s)")
    return _save(fig, path)


# -- sweeps ---------------------------------------------------------------------------------

SWEEP_PANELS = (
    ("TTFT (ms)", (("ttft_ms", "p50"), ("ttft_ms", "p99"))),
    ("ITL (ms per token)", (("itl_ms", "mean"), ("itl_ms", "p90"))),
    ("throughput (tokens/s)", (("tokens_per_s", None),)),
)


def metric(result: Any, name: str, stat: str | None) -> float:
    """One number: `result.name.stat`, or `result.name` when stat is None; NaN when absent."""
    v = field(result, name)
    if stat is not None and v is not None:
        v = field(v, stat)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def spread(repeats: Sequence[Any], name: str, stat: str | None) -> tuple[float, float, float]:
    """(mean, min, max) of a metric over a point's repeats; NaNs when none has it."""
    values = _finite(metric(r, name, stat) for r in repeats)
    if not values:
        return math.nan, math.nan, math.nan
    return sum(values) / len(values), min(values), max(values)


def as_number(v: Any) -> float | None:
    """A swept value as a number: numbers, and strings such as "16" or "2.5" (`cadence sweep`
    keeps the values as typed); None for anything else."""
    if isinstance(v, bool):
        return None
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return None
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def sweep_variables(sweep: Sweep) -> list[str]:
    """The swept variables: the keys of the points' `values` (a grid), else `variable`."""
    names = list(dict.fromkeys(k for p in sweep.points for k in p.values or {}))
    return names or [sweep.variable]


def point_value(point: SweepPoint, variable: str) -> str | None:
    """The value of `variable` at a sweep point (`values` of a grid point, else `value`)."""
    return point.values.get(variable) if point.values else point.value


def sweep_points(sweep: Sweep) -> list[SweepPoint]:
    """The sweep's points; sorted by each variable in turn when every value is a number, else
    in the given order."""
    points = list(sweep.points)
    names = sweep_variables(sweep)
    if points and all(as_number(point_value(p, n)) is not None for p in points for n in names):
        points = sorted(points, key=lambda p: [as_number(point_value(p, n)) for n in names])
    return points


def spans_decades(values: Iterable[Any]) -> bool:
    """Positive values whose largest is ten times the smallest or more: a log axis shows them
    all, a linear one flattens the small ones."""
    numbers = _finite(values)
    return bool(numbers) and min(numbers) > 0 and max(numbers) / min(numbers) >= 10


def sweep_figure(sweep: Sweep):
    """The sweep's figure (see `plot_sweep`), or None without points."""
    points = sweep_points(sweep)
    if not points:
        return None
    x_name, *others = sweep_variables(sweep)
    # a grid: one line per combination of the other variables, against the first
    lines: dict[str, list[dict]] = {}
    for p in points:
        key = ", ".join(f"{n}={point_value(p, n)}" for n in others)
        lines.setdefault(key, []).append(p)
    x_values = list(dict.fromkeys(point_value(p, x_name) for p in points))
    numeric = all(as_number(v) is not None for v in x_values)
    position = {v: as_number(v) if numeric else i for i, v in enumerate(x_values)}
    fig, axes = _figure(15.0, 4.5, ncols=len(SWEEP_PANELS))
    for ax, (ylabel, series) in zip(axes, SWEEP_PANELS):
        shown = []
        for (name, stat), style in zip(series, ("-", "--")):
            for (key, line), color in zip(lines.items(), _palette(len(lines))):
                xs, mean, low, high = [], [], [], []
                for p in line:
                    m, lo, hi = spread(p.repeats, name, stat)
                    xs.append(position[point_value(p, x_name)])
                    mean.append(m)
                    low.append(m - lo if math.isfinite(m) else 0.0)
                    high.append(hi - m if math.isfinite(m) else 0.0)
                shown += mean
                label = (f"{name} {stat}" if stat else name) + (f" · {key}" if key else "")
                ax.errorbar(xs, mean, yerr=[low, high], marker="o", ms=4, capsize=3, ls=style,
                            color=color if len(lines) > 1 else None, label=label)
        if numeric and spans_decades(position.values()):
            ax.set_xscale("log")
        if len(x_values) <= 12:
            ax.set_xticks([position[v] for v in x_values], [str(v) for v in x_values])
            ax.minorticks_off()
        if spans_decades(shown):
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel(x_name)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize="small")
    repeats = sorted({len(p.repeats) for p in points})
    fig.suptitle(f"sweep over {' × '.join([x_name, *others])} "
                 f"({'/'.join(map(str, repeats))} repeats per point; bars: min–max)")
    return fig


def plot_sweep(sweep: Sweep, path: Path) -> Path | None:
    """TTFT p50/p99, mean ITL, ITL p90 and tokens/s against the (first) swept variable, one
    line per value of the others; markers at the mean over repeats, error bars from the lowest
    to the highest repeat; log axes where the values span a decade or more."""
    fig = sweep_figure(sweep)
    return None if fig is None else _save(fig, path)


def plot_capacity(capacity: Capacity, path: Path) -> Path | None:
    """The load curve of a capacity search: tokens/s and goodput against load, TTFT p99 and
    ITL p99 against load with the SLO's bounds, the knee (largest passing load) marked."""
    points = sorted(capacity.points, key=lambda p: p.value)
    if not points:
        return None
    fig, (top, bottom) = _figure(8.0, 7.0, nrows=2)
    xs = [p.value for p in points]
    top.plot(xs, [p.tokens_per_s for p in points], marker="o", label="tokens/s")
    top.plot(xs, [p.goodput_tokens_per_s for p in points], marker="s", label="goodput tokens/s")
    top.set_ylabel("tokens/s")
    for name, values in (("TTFT p99", [p.ttft_p99_ms for p in points]),
                         ("ITL p99", [p.itl_p99_ms for p in points])):
        bottom.plot(xs, values, marker="o", label=name)
    for term in capacity.slo:
        if term.metric in ("ttft", "itl") and term.stat in ("p99", "p90", "p50", "max"):
            bottom.axhline(term.bound_ms, ls="--", lw=1, color="grey")
            bottom.annotate(f"SLO {term.metric}_{term.stat} {term.bound_ms:g} ms",
                            (xs[0], term.bound_ms), fontsize=8, va="bottom")
    bottom.set_ylabel("ms")
    bottom.set_xlabel(capacity.search)
    if xs[-1] / xs[0] >= 10:
        bottom.set_xscale("log")
        values = [v for p in points for v in (p.ttft_p99_ms, p.itl_p99_ms)
                  if math.isfinite(v) and v > 0]
        if values and max(values) / min(values) >= 10:
            bottom.set_yscale("log")
    if capacity.max_passing is not None:
        for ax in (top, bottom):
            ax.axvline(capacity.max_passing, color="green", lw=1.5, alpha=0.7)
        top.annotate(f"knee: {capacity.max_passing:g}", (capacity.max_passing, 0),
                     xycoords=("data", "axes fraction"), fontsize=9, va="bottom")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8)
    return _save(fig, path)
