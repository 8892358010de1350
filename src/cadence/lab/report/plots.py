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

from cadence.lab.analysis.server_spans import SPLIT
from cadence.lab.analysis.stats import TTFT_SEGMENTS, is_ok, itl_points, ttft_ms
from cadence.lab.percentile import percentile
from cadence.lab.records import RequestRecord
from cadence.lab.results import (
    BenchResult,
    Capacity,
    DependenceCurve,
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
    "ttft_ms",
    "connect_ms",
    "ttft_after_connect_ms",
    "itl_ms",
    "chunk_gap_ms",
    "tpot_ms",
    "e2e_ms",
    "token_delay_ms",
    "chunk_tokens",
)
"""Aggregates in the order they are shown; any other distribution-shaped key follows."""
STATS = ("mean", "p50", "p90", "p99", "max")
"""The statistics of a distribution the report shows, in order."""


def aggregate_names(result: Any) -> list[str]:
    """The distributions of a result (or of its baseline) that counted something, known ones
    first."""
    counted = [
        n
        for n in result.__struct_fields__
        if isinstance(d := getattr(result, n), Distribution) and d.count
    ]
    return [n for n in AGGREGATES if n in counted] + [n for n in counted if n not in AGGREGATES]


def field(obj: Any, name: str) -> Any:
    """A struct's field or a dict's key (a result's per-name tables are dicts); None when
    absent or unset."""
    value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return None if value is msgspec.UNSET else value


def _finite(values: Iterable[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


# -- figures --------------------------------------------------------------------------------


def _figure(
    width: float = 8.0, height: float = 4.5, ncols: int = 1, nrows: int = 1, sharex: bool = True
):
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
    candidates = sorted(
        (r for r in records if is_ok(r) and itl_points(r)), key=lambda r: r.start_ns
    )
    if len(candidates) <= count:
        return candidates
    worst = max(candidates, key=lambda r: max(v for _, v in itl_points(r)))
    picked = [worst]
    rest = [r for r in candidates if r is not worst]
    need = count - 1
    for k in range(need):
        picked.append(rest[round(k * (len(rest) - 1) / max(1, need - 1))])
    return sorted(picked, key=lambda r: r.start_ns)


def plot_itl_over_time(
    records: Sequence[RequestRecord], path: Path, streams: int = 5
) -> Path | None:
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


SPAN_STACK_ORDER = tuple(name for name in SPLIT if name != "inside")
"""The parts of `server_spans.ttft_split_ms` that add up to TTFT (inside is queue + prefill +
inside_other)."""


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
        parts = [
            (n, float(d.mean))
            for n in order
            if (d := getattr(segments, n)).count and math.isfinite(d.mean)
        ]
        if parts:
            stacks.append(Stack(title, parts))
    spans = field(result, "server_spans")
    split = spans.ttft_split_ms if spans is not None else {}
    # Without a first send, queue and prefill lie inside inside_or_after: not stacked apart.
    order = SPAN_STACK_ORDER if "inside" in split else ("before", "inside_or_after")
    parts = [
        (name, float(split[name].mean))
        for name in order
        if name in split and math.isfinite(split[name].mean)
    ]
    if parts:
        stacks.append(Stack("time to first token at the server's span edges (OTLP)", parts))
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
                ax.text(
                    left + value / 2,
                    0,
                    f"{value:.2f}",
                    ha="center",
                    va="center",
                    fontsize="x-small",
                )
            left += value
        ax.text(left, 0, f"  {stack.total:.2f} ms", va="center", fontsize="small")
        ax.set_xlim(0, left * 1.18 or 1)
        ax.set_yticks([])
        ax.set_title(f"{stack.title} (means, ms)", fontsize="medium")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1].set_xlabel("ms")
    return _save(fig, path)


def plot_attribution(tails: Sequence[Any], path: Path) -> Path | None:
    """One bar per bad tail (`TailVerdict`): the share of its tail time each finding explains,
    then what no finding explains (red); a finding that gives no share is a hatched part of
    what is left. None when no tail is bad."""
    bad = [t for t in tails if t.state == "bad"]
    if not bad:
        return None
    fig, axes = _figure(9.0, 1.0 + 1.3 * len(bad), nrows=len(bad), sharex=True)
    rules = list(dict.fromkeys(r for t in bad for r in t.explained_by))
    colors = dict(zip(rules, _palette(len(rules))))
    for ax, tail in zip(axes, bad):
        left = 0.0
        for rule, share in tail.explained_by.items():
            if share:
                ax.barh([0], [share], left=left, color=colors[rule], label=rule, height=0.6)
                ax.text(
                    left + share / 2,
                    0,
                    f"{share:.0%}",
                    ha="center",
                    va="center",
                    fontsize="x-small",
                )
                left += share
        unshared = [r for r, share in tail.explained_by.items() if share is None]
        rest = max(0.0, 1.0 - left)
        if unshared:
            ax.barh(
                [0],
                [rest],
                left=left,
                color="#d6dbe1",
                hatch="//",
                height=0.6,
                label="explained, share not measured: " + ", ".join(unshared),
            )
        elif rest > 0:
            ax.barh([0], [rest], left=left, color="#d9534f", height=0.6, label="unexplained")
            ax.text(
                left + rest / 2,
                0,
                f"{rest:.0%}",
                ha="center",
                va="center",
                fontsize="x-small",
                color="white",
            )
        ax.set_xlim(0, 1)
        ax.set_yticks([])
        name = "ITL" if tail.metric == "itl_ms" else "TTFT"
        ax.set_title(
            f"{name} tail: p99 {tail.value_ms:.1f} ms against a healthy "
            f"{tail.bound_ms:.1f} ms, by cause",
            fontsize="medium",
        )
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1].set_xlabel("share of the tail's time")
    return _save(fig, path)


def _palette(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def plot_dependence(curves: Sequence[DependenceCurve], path: Path) -> Path | None:
    """One panel per latency (gaps, first outputs): its median (line) and quartiles (band)
    by bin of the variable it depends on most, as the analysis stored them
    (`BenchResult.dependence`): a curve over a numeric variable, bars by position within a
    period or by group. None without a curve."""
    shown = [c for c in curves if c.x]
    if not shown:
        return None
    fig, axes = _figure(8.0, 3.2 * len(shown), nrows=len(shown), sharex=False)
    for ax, c in zip(axes, shown):
        what = "gap between reads" if c.latency == "gap" else "TTFT"
        low = [m - q for m, q in zip(c.median_ms, c.p25_ms)]
        high = [q - m for m, q in zip(c.median_ms, c.p75_ms)]
        if c.period or c.labels:
            ax.bar(c.x, c.median_ms, yerr=[low, high], color="#4c72b0", alpha=0.8, capsize=2)
            if c.labels:
                ax.set_xticks(c.x, c.labels)
            ax.set_xlabel(
                f"position modulo {c.period}" if c.period else c.variable.replace("_", " ")
            )
        else:
            ax.fill_between(c.x, c.p25_ms, c.p75_ms, color="#4c72b0", alpha=0.25)
            ax.plot(c.x, c.median_ms, marker="o", color="#4c72b0")
            ax.set_xlabel(c.variable.replace("_", " "))
        ax.set_ylabel(f"{what} (ms)")
        state = (
            f"{c.shape.replace('_', ' ')}, {c.tail_share:.0%} of the tail"
            if c.named
            else "not named" + (f" ({c.shape.replace('_', ' ')})" if c.shape else "")
        )
        ax.set_title(f"{what} by {c.variable}: {state}", fontsize="medium")
    return _save(fig, path)


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
            ax.plot(
                [s[0] for s in gpu.samples],
                [s[1] for s in gpu.samples],
                lw=1,
                label=f"card {gpu.index}",
            )
        ax.set_ylabel("card utilisation %")
        ax.set_ylim(0, 105)
        ax.set_title("Card utilisation")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1].set_xlabel("time since sampling started (s)")
    return _save(fig, path)


def plot_worker_curves(
    workers: list[WorkerCurve] | None, path: Path, bin_s: float = 0.25
) -> Path | None:
    """Each worker's output curve on one time axis: its step time, this run's sequences per
    step, and the tokens it made per second (steps' sequences over `bin_s` windows)."""
    curves = [w for w in workers or [] if w.series]
    if not curves:
        return None
    fig, axes = _figure(9.0, 8.0, nrows=3)
    for w in curves:
        series = w.series
        label = (
            f"worker {w.worker}"
            + (f" ({w.device})" if w.device else "")
            + (f" {w.role}" if w.role else "")
        )
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
        axes[2].plot(
            [(k + 0.5) * bin_s for k in keys],
            [bins[k] / bin_s for k in keys],
            lw=1,
            marker=".",
            label=label,
        )
    for ax, ylabel in zip(axes, ("step (ms)", "sequences per step", "tokens/s"), strict=True):
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[0].set_title("Each worker's output curve")
    axes[-1].set_xlabel("time since the run's first step (s)")
    return _save(fig, path)


_ROLE_PANELS = (
    ("requests", (("running", "running"), ("waiting", "waiting"))),
    ("KV cache in use (%)", (("kv_cache_use", "KV cache in use"),)),
    ("preempted per s", (("preempted", "preempted"),)),
)
"""The panels of the scraped roles, each with its roles and their labels."""
_OTHER_SERIES = 6
"""Series shown when a page has no role (none of the known names)."""
_LATENCY_POINTS = 5000
"""ITL points drawn at most (evenly thinned): a dense cloud says no more with more."""


def plot_scraped(result: BenchResult, path: Path) -> Path | None:
    """The server's own metrics (`--scrape`) on the run's time axis, under the run's TTFT
    (each request at its send) and ITL (each chunk at its arrival): the requests running and
    waiting, the KV cache in use and preemptions; or, from a page with none of the known
    names, its first gauges. The run's window is shaded."""
    scraped = field(result, "scraped")
    if scraped is None or not (scraped.roles or scraped.series):
        return None
    records = [r for r in field(result, "records") or [] if is_ok(r)]
    panels = [
        (
            label,
            [
                (scraped.roles[role], name)
                for role, name in roles
                if role in scraped.roles and scraped.roles[role].points
            ],
        )
        for label, roles in _ROLE_PANELS
    ]
    panels = [(label, lines) for label, lines in panels if lines]
    others = [] if panels else _other_series(scraped)
    count = bool(records) + len(panels) + bool(others)
    if not count or not (panels or others):
        return None
    fig, axes = _figure(9.0, 2.6 + 2.2 * count, nrows=count)
    k = 0
    t0 = scraped.started_ns
    if records:
        ax = axes[k]
        itl = [((a - t0) / 1e9, v) for r in records for a, v in itl_points(r)]
        itl = itl[:: max(1, len(itl) // _LATENCY_POINTS)]
        ax.scatter(
            [t for t, _ in itl], [v for _, v in itl], s=2, alpha=0.3, label="ITL", color="tab:grey"
        )
        ttft = [((r.start_ns - t0) / 1e9, ttft_ms(r)) for r in records]
        ax.scatter(
            [t for t, _ in ttft],
            [v for _, v in ttft],
            s=8,
            label="TTFT (at its send)",
            color="tab:red",
        )
        _log_if_skewed(ax, [v for _, v in itl] + [v for _, v in ttft], "y")
        ax.set_ylabel("ms")
        ax.set_title("The run's latency and the server's own metrics")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        k += 1
    for label, lines in panels:
        ax = axes[k]
        percent = label.endswith("(%)")
        for role, name in lines:
            # A gauge holds until the next scrape; a rate is of the interval before its point.
            ax.step(
                [p[0] for p in role.points],
                [p[1] * (100 if percent else 1) for p in role.points],
                where="pre" if name == "preempted" else "post",
                lw=1.2,
                label=f"{name} ({role.metric})",
            )
        ax.set_ylabel(label)
        if percent:
            ax.set_ylim(0, 105)
        else:
            ax.set_ylim(bottom=0)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        k += 1
    if others:
        ax = axes[k]
        for series in others:
            ax.plot(
                [p[0] for p in series.points],
                [p[1] for p in series.points],
                lw=1,
                label=series_label(series),
            )
        ax.set_ylabel("value (no known role)")
        _log_if_skewed(ax, [p[1] for s in others for p in s.points], "y")
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if scraped.run_window_s is not None:
        for ax in axes:
            ax.axvspan(*scraped.run_window_s, color="tab:blue", alpha=0.06, lw=0)
    axes[-1].set_xlabel("time since sampling started (s); shaded: the run")
    return _save(fig, path)


def series_label(series: Any) -> str:
    """A scraped series as `name{labels}`, and its kind when it is not the value."""
    labels = ",".join(f"{k}={v}" for k, v in series.labels.items())
    text = f"{series.name}{{{labels}}}" if labels else series.name
    return text + (f" ({series.kind})" if series.kind != "gauge" else "")


def _other_series(scraped: Any) -> list:
    """The gauges (then the rest) with the largest changes over the run, at most
    _OTHER_SERIES: a flat series says nothing on a time axis."""

    def change(series) -> float:
        values = [p[1] for p in series.points]
        return max(values) - min(values) if values else 0.0

    ranked = sorted(
        (s for s in scraped.series if len(s.points) > 1 and change(s) > 0),
        key=lambda s: (s.kind != "gauge", -change(s)),
    )
    return ranked[:_OTHER_SERIES]


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
    lines: dict[str, list[SweepPoint]] = {}
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
                ax.errorbar(
                    xs,
                    mean,
                    yerr=[low, high],
                    marker="o",
                    ms=4,
                    capsize=3,
                    ls=style,
                    color=color if len(lines) > 1 else None,
                    label=label,
                )
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
    fig.suptitle(
        f"sweep over {' × '.join([x_name, *others])} "
        f"({'/'.join(map(str, repeats))} repeats per point; bars: min–max)"
    )
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
    for name, values in (
        ("TTFT p99", [p.ttft_p99_ms for p in points]),
        ("ITL p99", [p.itl_p99_ms for p in points]),
    ):
        bottom.plot(xs, values, marker="o", label=name)
    for term in capacity.slo:
        if term.metric in ("ttft", "itl") and term.stat in ("p99", "p90", "p50", "max"):
            bottom.axhline(term.bound_ms, ls="--", lw=1, color="grey")
            bottom.annotate(
                f"SLO {term.metric}_{term.stat} {term.bound_ms:g} ms",
                (xs[0], term.bound_ms),
                fontsize=8,
                va="bottom",
            )
    bottom.set_ylabel("ms")
    bottom.set_xlabel(capacity.search)
    if xs[-1] / xs[0] >= 10:
        bottom.set_xscale("log")
        values = [
            v for p in points for v in (p.ttft_p99_ms, p.itl_p99_ms) if math.isfinite(v) and v > 0
        ]
        if values and max(values) / min(values) >= 10:
            bottom.set_yscale("log")
    if capacity.max_passing is not None:
        for ax in (top, bottom):
            ax.axvline(capacity.max_passing, color="green", lw=1.5, alpha=0.7)
        top.annotate(
            f"knee: {capacity.max_passing:g}",
            (capacity.max_passing, 0),
            xycoords=("data", "axes fraction"),
            fontsize=9,
            va="bottom",
        )
    top.legend(fontsize=8)
    bottom.legend(fontsize=8)
    return _save(fig, path)
