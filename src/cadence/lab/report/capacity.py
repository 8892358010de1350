"""The report of a capacity search (`cadence report capacity.json`): the load curve, every
run, and what binds the server at its knee."""

from __future__ import annotations

from pathlib import Path

from cadence.lab.capacity import answer_lines, slo_names
from cadence.lab.report.html import figure, note, page, section, table
from cadence.lab.report.plots import plot_capacity
from cadence.lab.results import Capacity

REPORT_NAME = "report.html"


def render_capacity(capacity: Capacity, out_dir: Path, source: str = "") -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    found = "; ".join(line.strip().removeprefix("capacity: ")
                      for line in answer_lines(capacity))
    if capacity.first_failing is not None and capacity.client_limited_at is None:
        found += (f"; {capacity.first_failing:g} misses it ({', '.join(capacity.binding)})")
    if capacity.client_limited_at is not None:
        found += (f"; the client limited the run at {capacity.client_limited_at:g}: the search "
                  "stopped there (add --procs)")
    why = [f"{f.rule}: {f.finding} (look at: {f.look_at})" for f in capacity.why]
    parts = [
        note(f"{found}. {capacity.runs} runs in {capacity.elapsed_s:.1f} s."),
        section("Where capacity stops", *(note(text) for text in
                                            [f"Because {r}" for r in capacity.reasons.values()]
                                            + ([capacity.knee] if capacity.knee else []) + why)),
        figure(plot_capacity(capacity, out_dir / "capacity.png"),
               f"tokens/s and goodput, TTFT p99 and ITL p99 against {capacity.search}; dashed: "
               "the SLO's bounds; green: the largest load that meets it"),
        section("Every run", table(
            (capacity.search, "met the SLO", "TTFT p99 ms", "ITL p99 ms", "tokens/s",
             "goodput tokens/s", "missed", "diagnosis"),
            [(p.value, "yes" if p.passed else "client-limited" if p.client_limited else "no",
              p.ttft_p99_ms, p.itl_p99_ms, p.tokens_per_s, p.goodput_tokens_per_s,
              ", ".join(p.failed_terms), " ".join(p.diagnosis))
             for p in sorted(capacity.points, key=lambda p: p.value)],
            bad=lambda column, cell: column == 1 and cell != "yes")),
    ]
    path = out_dir / REPORT_NAME
    path.write_text(page(f"cadence capacity: {capacity.search} within {slo_names(capacity.slo)}",
                         f"from {source}" if source else "", parts), encoding="utf-8")
    return path
