"""The report of a capacity search (`cadence report capacity.json`): the load curve, every
run, and what binds the server at its knee."""

from __future__ import annotations

from pathlib import Path

from cadence.lab.analysis.goodput import slo_names
from cadence.lab.report.html import figure, note, page, section, table
from cadence.lab.report.plots import plot_capacity
from cadence.lab.results import Capacity

REPORT_NAME = "report.html"


def answer_lines(capacity: Capacity) -> list[str]:
    """The answer in words: the load, how many runs met the SLO there, where the range's
    edge or the runs' disagreement leaves it, and any non-monotone result."""
    kind, runs = capacity.search, capacity.runs_by_value

    def tally(value: float) -> str:
        seen = runs.get(f"{value:g}", [])
        return f"{sum(seen)} of {len(seen)} runs met it"

    lines = []
    if capacity.max_passing is None:
        lines.append(f"no {kind} tried meets the SLO")
    else:
        lines.append(
            f"capacity: {kind} {capacity.max_passing:g} meets the SLO "
            f"({tally(capacity.max_passing)})"
        )
    if capacity.range_edge == "high":
        lines.append(
            f"  at least {capacity.max_passing:g}: the top of the range searched; "
            "raise --high to find the knee"
        )
    elif capacity.range_edge == "low":
        lines.append(
            f"  below {capacity.first_failing:g}: the bottom of the range searched "
            "missed it; lower --low"
        )
    if capacity.first_failing is not None and capacity.range_edge is None:
        lines.append(f"  {kind} {capacity.first_failing:g}: {tally(capacity.first_failing)}")
    spread = capacity.knee_spread
    if spread and capacity.first_failing is not None and spread[1] > capacity.first_failing:
        lines.append(
            f"  runs disagree about the knee: it lies between {spread[0]:g} and "
            f"{spread[1]:g} (runs met the SLO as high as {spread[1]:g})"
        )
    for low, high in capacity.non_monotone:
        lines.append(
            f"  not monotone: {kind} {low:g} missed the SLO ({tally(low)}) where "
            f"{high:g} met it ({tally(high)}); the answer stays below {low:g}"
        )
    return lines


def render_capacity(capacity: Capacity, out_dir: Path, source: str = "") -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    found = "; ".join(line.strip().removeprefix("capacity: ") for line in answer_lines(capacity))
    if capacity.first_failing is not None and capacity.client_limited_at is None:
        found += f"; {capacity.first_failing:g} misses it ({', '.join(capacity.binding)})"
    if capacity.client_limited_at is not None:
        found += (
            f"; the client limited the run at {capacity.client_limited_at:g}: the search "
            "stopped there (add --procs)"
        )
    why = [f"{f.rule}: {f.finding} (look at: {f.look_at})" for f in capacity.why]
    parts = [
        note(f"{found}. {capacity.runs} runs in {capacity.elapsed_s:.1f} s."),
        section(
            "Where capacity stops",
            *(
                note(text)
                for text in [f"Because {r}" for r in capacity.reasons.values()]
                + ([capacity.knee] if capacity.knee else [])
                + why
            ),
        ),
        figure(
            plot_capacity(capacity, out_dir / "capacity.png"),
            f"tokens/s and goodput, TTFT p99 and ITL p99 against {capacity.search}; dashed: "
            "the SLO's bounds; green: the largest load that meets it",
        ),
        section(
            "Every run",
            table(
                (
                    capacity.search,
                    "met the SLO",
                    "TTFT p99 ms",
                    "ITL p99 ms",
                    "tokens/s",
                    "goodput tokens/s",
                    "missed",
                    "diagnosis",
                ),
                [
                    (
                        p.value,
                        "yes" if p.passed else "client-limited" if p.client_limited else "no",
                        p.ttft_p99_ms,
                        p.itl_p99_ms,
                        p.tokens_per_s,
                        p.goodput_tokens_per_s,
                        ", ".join(p.failed_terms),
                        " ".join(p.diagnosis),
                    )
                    for p in sorted(capacity.points, key=lambda p: p.value)
                ],
                bad=lambda column, cell: column == 1 and cell != "yes",
            ),
        ),
    ]
    path = out_dir / REPORT_NAME
    path.write_text(
        page(
            f"cadence capacity: {capacity.search} within {slo_names(capacity.slo)}",
            f"from {source}" if source else "",
            parts,
        ),
        encoding="utf-8",
    )
    return path
