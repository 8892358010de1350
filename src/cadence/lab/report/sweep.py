"""The sweep part of the report: one row per point (a value, or a grid's combination of
values), with the spread over repeats, errors, integrity and the rules that fired; the plot;
and each point's aggregates."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from cadence.lab.report import plots
from cadence.lab.report.html import Raw, esc, figure, fmt, kv_table, note, section, table

_COLUMNS = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "mean"), ("itl_ms", "p90"),
            ("tokens_per_s", None))


def title(sweep: dict) -> str:
    """The report's title for a sweep: what it varied."""
    return f"cadence sweep over {' × '.join(plots.sweep_variables(sweep))}"


def first_repeat(sweep: dict) -> dict:
    """The first run of the sweep, for what all its runs share (the workload)."""
    for point in plots.sweep_points(sweep):
        for repeat in point.get("repeats") or []:
            if isinstance(repeat, dict):
                return repeat
    return {}


def _spread_cell(repeats: Sequence[dict], name: str, stat: str | None) -> Raw:
    mean, low, high = plots.spread(repeats, name, stat)
    if not math.isfinite(mean):
        return Raw("—")
    if len(repeats) > 1 and high > low:
        return Raw(f"{fmt(mean)} <span class='note'>[{fmt(low)}–{fmt(high)}]</span>")
    return Raw(fmt(mean))


def _sum_dicts(dicts: Iterable[Any]) -> Counter:
    total: Counter = Counter()
    for d in dicts:
        if isinstance(d, dict):
            total.update({k: v for k, v in d.items() if isinstance(v, (int, float))})
    return total


def _rules(repeats: Sequence[dict]) -> str:
    """The rules that fired in any repeat, "none" when the diagnosis ran silent, "—" when no
    repeat carries a diagnosis."""
    diagnosed = [r["diagnosis"] for r in repeats if r.get("diagnosis") is not None]
    if not diagnosed:
        return "—"
    rules = dict.fromkeys(f.get("rule", "?") if isinstance(f, dict) else str(f)
                          for findings in diagnosed for f in findings)
    return ", ".join(rules) or "none"


def _label(point: dict, variables: Sequence[str]) -> str:
    return ", ".join(f"{n} = {plots.point_value(point, n)}" for n in variables)


def sweep_section(sweep: dict, out_dir: Path) -> str:
    """The sweep's table, failures, settings, plot and per-point details."""
    variables = plots.sweep_variables(sweep)
    points = plots.sweep_points(sweep)
    if not points:
        return section("Points", note("The sweep has no points."))
    header = (*variables, "repeats", "requests OK",
              *(f"{n} {s}" if s else n for n, s in _COLUMNS), "errors", "integrity",
              "diagnosis")
    rows = []
    for p in points:
        repeats = [r for r in p.get("repeats") or [] if isinstance(r, dict)]
        ok = sum(r.get("requests_ok", 0) or 0 for r in repeats)
        total = sum(r.get("requests", 0) or 0 for r in repeats)
        errors = _sum_dicts(r.get("errors_by_code") for r in repeats)
        broken = sum(_sum_dicts(r.get("integrity") for r in repeats).values())
        rows.append((*(Raw(esc(plots.point_value(p, n))) for n in variables), len(repeats),
                     Raw(f"{ok}/{total}"), *(_spread_cell(repeats, n, s) for n, s in _COLUMNS),
                     Raw(esc(", ".join(f"{k} {v}" for k, v in errors.items())) or "none"),
                     broken, Raw(esc(_rules(repeats)))))
    integrity_column = len(header) - 2
    parts = [table(header, rows, bad=lambda i, v: i == integrity_column and v != 0),
             note("Mean over repeats, [lowest–highest] when they differ; diagnosis: the rules "
                  "that fired in any repeat.")]
    failures = [(_label(p, variables), text) for p in points for text in p.get("failures") or []]
    parts.append(section("Runs that failed", table(("point", "why"), failures,
                                                   bad=lambda i, v: i == 1), level=3))
    settings = {k: v for k, v in sweep.items() if k in ("serve_args", "server_cmd", "repeat")}
    if isinstance(settings.get("serve_args"), list):
        settings["serve_args"] = " ".join(map(str, settings["serve_args"]))
    parts.append(kv_table(settings))
    path = plots.plot_sweep(sweep, out_dir / "sweep.png")
    parts.append(figure(path, f"TTFT, ITL and throughput against {variables[0]}: markers at "
                              "the mean over repeats, bars from the lowest to the highest."))
    for p in points:
        repeats = [r for r in p.get("repeats") or [] if isinstance(r, dict)]
        parts.append(f"<details><summary>{esc(_label(p, variables))} "
                     f"({len(repeats)} repeats)</summary>{_point_detail(repeats)}</details>")
    return section("Points", *parts)


def _point_detail(repeats: Sequence[dict]) -> str:
    """One sweep point: every aggregate as the mean over repeats, with the range."""
    if not repeats:
        return note("No repeats.")
    names = _names_in(dict.fromkeys(plots.aggregate_names(r)) for r in repeats)
    rows = [(n, *(_spread_cell(repeats, n, s) for s in plots.STATS)) for n in names]
    rows += [(f"segment {n}", *(_spread_cell([r.get("segments_ms") or {} for r in repeats], n, s)
                                for s in plots.STATS))
             for n in _names_in(r.get("segments_ms") for r in repeats)]
    cpu = [((r.get("system") or {}).get("processes") or {}) for r in repeats]
    cpu_rows = [(f"CPU % {n}", _spread_cell(cpu, n, "cpu_pct_mean"),
                 _spread_cell(cpu, n, "cpu_pct_max")) for n in _names_in(cpu)]
    parts = [table(("metric", *plots.STATS), rows),
             table(("process", "CPU % mean", "CPU % max"), cpu_rows)]
    for i, r in enumerate(repeats):
        if "diagnosis" in r:
            findings = r.get("diagnosis") or []
            text = "; ".join(f"{f.get('rule', '?')}: {f.get('finding', '')}" if isinstance(f, dict)
                             else str(f) for f in findings) or "no rule fired"
            parts.append(note(f"repeat {i + 1} diagnosis: {text}"))
    return "".join(parts)


def _names_in(dicts: Iterable[Any]) -> list[str]:
    """The keys of several dicts, in first-seen order."""
    return list(dict.fromkeys(n for d in dicts if isinstance(d, dict) for n in d))
