"""The sweep part of the report: one row per point (a value, or a grid's combination of
values), with the spread over repeats, errors, integrity and the rules that fired; the plot;
and each point's aggregates."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from cadence.lab.report import plots
from cadence.lab.report.html import Raw, esc, figure, fmt, note, section, table
from cadence.lab.results import BenchResult, Sweep, SweepPoint

_COLUMNS = (
    ("ttft_ms", "p50"),
    ("ttft_ms", "p99"),
    ("itl_ms", "mean"),
    ("itl_ms", "p90"),
    ("tokens_per_s", None),
)


def title(sweep: Sweep) -> str:
    """The report's title for a sweep: what it varied."""
    return f"cadence sweep over {' × '.join(plots.sweep_variables(sweep))}"


def first_repeat(sweep: Sweep) -> BenchResult:
    """The first run of the sweep, for what all its runs share (the workload); an empty
    result when no run finished."""
    for point in plots.sweep_points(sweep):
        if point.repeats:
            return point.repeats[0]
    return BenchResult()


def _spread_cell(repeats: Sequence[Any], name: str, stat: str | None) -> Raw:
    mean, low, high = plots.spread(repeats, name, stat)
    if not math.isfinite(mean):
        return Raw("—")
    if len(repeats) > 1 and high > low:
        return Raw(f"{fmt(mean)} <span class='note'>[{fmt(low)}–{fmt(high)}]</span>")
    return Raw(fmt(mean))


def _rules(repeats: Sequence[BenchResult]) -> str:
    """The rules that fired in any repeat; "none" when none did, "—" without repeats."""
    if not repeats:
        return "—"
    return ", ".join(dict.fromkeys(f.rule for r in repeats for f in r.diagnosis)) or "none"


def _label(point: SweepPoint, variables: Sequence[str]) -> str:
    return ", ".join(f"{n} = {plots.point_value(point, n)}" for n in variables)


def _settings(sweep: Sweep) -> str:
    rows: list[tuple[str, int | Raw]] = [("repeats per point", sweep.repeat)]
    if sweep.server_cmd:
        rows.append(("server command", Raw(f"<code>{esc(sweep.server_cmd)}</code>")))
    if sweep.serve_args:
        rows.append(("cadence serve", Raw(f"<code>{esc(' '.join(sweep.serve_args))}</code>")))
    return table(("", "value"), rows)


def sweep_section(sweep: Sweep, out_dir: Path) -> str:
    """The sweep's table, failures, settings, plot and per-point details."""
    variables = plots.sweep_variables(sweep)
    points = plots.sweep_points(sweep)
    if not points:
        return section("Points", note("The sweep has no points."))
    header = (
        *variables,
        "repeats",
        "requests OK",
        *(f"{n} {s}" if s else n for n, s in _COLUMNS),
        "errors",
        "integrity",
        "diagnosis",
    )
    rows = []
    for p in points:
        repeats = p.repeats
        ok = sum(r.requests_ok for r in repeats)
        total = sum(r.requests for r in repeats)
        errors: Counter = Counter()
        for r in repeats:
            errors.update(r.errors_by_code)
        broken = sum(sum(msgspec.structs.astuple(r.integrity)) for r in repeats)
        rows.append(
            (
                *(Raw(esc(plots.point_value(p, n))) for n in variables),
                len(repeats),
                Raw(f"{ok}/{total}"),
                *(_spread_cell(repeats, n, s) for n, s in _COLUMNS),
                Raw(esc(", ".join(f"{k} {v}" for k, v in errors.items())) or "none"),
                broken,
                Raw(esc(_rules(repeats))),
            )
        )
    integrity_column = len(header) - 2
    parts = [
        table(header, rows, bad=lambda i, v: i == integrity_column and v != 0),
        note(
            "Mean over repeats, [lowest–highest] when they differ; diagnosis: the rules "
            "that fired in any repeat."
        ),
    ]
    failures = [(_label(p, variables), text) for p in points for text in p.failures or []]
    parts.append(
        section(
            "Runs that failed", table(("point", "why"), failures, bad=lambda i, v: i == 1), level=3
        )
    )
    parts.append(_settings(sweep))
    path = plots.plot_sweep(sweep, out_dir / "sweep.png")
    parts.append(
        figure(
            path,
            f"TTFT, ITL and throughput against {variables[0]}: markers at "
            "the mean over repeats, bars from the lowest to the highest.",
        )
    )
    for p in points:
        parts.append(
            f"<details><summary>{esc(_label(p, variables))} "
            f"({len(p.repeats)} repeats)</summary>{_point_detail(p.repeats)}</details>"
        )
    return section("Points", *parts)


def _point_detail(repeats: Sequence[BenchResult]) -> str:
    """One sweep point: every aggregate as the mean over repeats, with the range."""
    if not repeats:
        return note("No repeats.")
    names = list(dict.fromkeys(n for r in repeats for n in plots.aggregate_names(r)))
    rows = [(n, *(_spread_cell(repeats, n, s) for s in plots.STATS)) for n in names]
    segments = [s for r in repeats if (s := plots.field(r, "segments_ms")) is not None]
    if segments:
        rows += [
            (f"segment {n}", *(_spread_cell(segments, n, s) for s in plots.STATS))
            for n in plots.SEGMENT_ORDER
        ]
    cpu = [r.system.processes for r in repeats]
    cpu_rows = [
        (f"CPU % {n}", _spread_cell(cpu, n, "cpu_pct_mean"), _spread_cell(cpu, n, "cpu_pct_max"))
        for n in _names_in(cpu)
    ]
    parts = [
        table(("metric", *plots.STATS), rows),
        table(("process", "CPU % mean", "CPU % max"), cpu_rows),
    ]
    for i, r in enumerate(repeats):
        text = "; ".join(f"{f.rule}: {f.finding}" for f in r.diagnosis) or "no rule fired"
        parts.append(note(f"repeat {i + 1} diagnosis: {text}"))
    return "".join(parts)


def _names_in(dicts: Iterable[dict]) -> list[str]:
    """The keys of several dicts, in first-seen order."""
    return list(dict.fromkeys(n for d in dicts for n in d))
