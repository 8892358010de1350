"""`cadence report a.json b.json ...`: bench runs side by side, each metric's ratio to the
first run, and gates (`--fail-if 'ttft_p99_ms>1.1x'`) that hold a server to an earlier run.

A metric is a distribution's statistic named as the SLO terms are (`ttft_p99_ms`,
`itl_p50_ms`, `e2e_max_ms`, `chunk_gap_p90_ms`, `token_delay_p99_ms`, `tpot_p50_ms`) or a
run figure (`tokens_per_s`, `requests_per_s`, `chunks_per_s`, `errors`) or an integrity count
(`lost_tokens`, `repeated_tokens`, `reordered_chunks`, `short_streams`, and
`integrity_faults`, their sum; missing where the run's protocol does not count it). A gate
is `METRIC>FACTORx` or `METRIC<FACTORx` (against the first run) or `METRIC>VALUE` /
`METRIC<VALUE` (absolute), judged on every later run; an absolute gate with one run is
judged on that run.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from cadence.lab.analysis.integrity import CHECKS, counted_checks
from cadence.lab.analysis.noise import beyond_noise, figure
from cadence.lab.report.summary import WITHIN_NOISE
from cadence.lab.results import BenchResult

DISTRIBUTIONS = ("ttft", "itl", "tpot", "e2e", "chunk_gap", "token_delay")
STATS = ("p50", "p90", "p99", "p999", "max", "mean")
FIGURES = ("tokens_per_s", "requests_per_s", "chunks_per_s", "errors")
INTEGRITY = (*CHECKS, "integrity_faults")
SHOWN = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2e_p99_ms",
    "token_delay_p99_ms",
    "tokens_per_s",
    "requests_per_s",
    "errors",
    "integrity_faults",
)
_METRIC = re.compile(r"^(?P<dist>[a-z0-9_]+?)_(?P<stat>p50|p90|p999|p99|max|mean)_ms$")
_GATE = re.compile(r"^(?P<metric>[a-z0-9_]+)\s*(?P<op>[<>])\s*(?P<value>[0-9.]+)(?P<x>x?)$")


class UnknownMetric(ValueError):
    """A gate or a metric named something the report does not know (a misspelling)."""


def metric(result: BenchResult, name: str) -> float:
    """The run's value of `name`; NaN when the run lacks it; ValueError for an unknown name."""
    if name == "errors":
        return float(sum(result.errors_by_code.values()))
    if name in FIGURES:
        return float(getattr(result, name))
    if name in INTEGRITY:
        counted = counted_checks(result.workload)
        if name == "integrity_faults":
            return (
                float(sum(getattr(result.integrity, c) for c in counted)) if counted else math.nan
            )
        return float(getattr(result.integrity, name)) if name in counted else math.nan
    match = _METRIC.match(name)
    if match is None or match["dist"] not in DISTRIBUTIONS:
        raise UnknownMetric(
            f"unknown metric {name!r}: use DIST_STAT_ms with DIST one of "
            f"{', '.join(DISTRIBUTIONS)} and STAT one of {', '.join(STATS)}, or one of "
            f"{', '.join((*FIGURES, *INTEGRITY))}"
        )
    return figure(result, name)


@dataclass(frozen=True)
class Gate:
    metric: str
    above: bool
    """Fails when the value is above the bound (`>`), else below it (`<`)."""
    value: float
    relative: bool
    """The bound is `value` times the first run's (`1.1x`), else `value` itself."""

    @property
    def text(self) -> str:
        return (
            f"{self.metric}{'>' if self.above else '<'}{self.value:g}{'x' if self.relative else ''}"
        )

    def failure(self, base: BenchResult, run: BenchResult, label: str) -> str | None:
        """Why `run` fails the gate, in one line; None when it passes."""
        line, failed = self.verdict(base, run, label)
        return line if failed else None

    def judge(self, base: BenchResult, run: BenchResult, label: str) -> str | None:
        """Why `run` fails the gate, or (ending in "within noise") why a mean past the bound
        is not judged a regression, in one line; None when it passes plainly."""
        return self.verdict(base, run, label)[0]

    def verdict(self, base: BenchResult, run: BenchResult, label: str) -> tuple[str | None, bool]:
        """(`judge`'s line, whether the run fails). With repeats on both sides (`--repeat`),
        a relative gate compares the means and fails only outside the runs' noise
        (`cadence.lab.analysis.noise`)."""
        noisy = self._repeated(base, run)
        value = noisy[1].mean if noisy else metric(run, self.metric)
        bound = (
            self.value * (noisy[0].mean if noisy else metric(base, self.metric))
            if self.relative
            else self.value
        )
        if math.isnan(value) or math.isnan(bound):
            return f"{label}: {self.text}: {self.metric} is missing, so the gate cannot pass", True
        if not ((value > bound) if self.above else (value < bound)):
            return None, False
        if noisy is None:
            return (
                f"{label}: {self.text} failed: {self.metric} {value:.4g} against a bound of "
                f"{bound:.4g}"
            ), True
        first, later = noisy
        failed = beyond_noise(first, later, self.value, self.above)
        said = (
            f"{label}: {self.text}{' failed' if failed else ''}: {self.metric} mean "
            f"{value:.4g} (95% CI {later.ci95_low:.4g}-{later.ci95_high:.4g}, "
            f"{len(later.values)} runs) against a bound of {bound:.4g} (first: "
            f"{first.ci95_low:.4g}-{first.ci95_high:.4g}, {len(first.values)} runs)"
        )
        return (said, True) if failed else (f"{said}: {WITHIN_NOISE}", False)

    def _repeated(self, base: BenchResult, run: BenchResult):
        """(the base's, the run's) repeats of the gate's metric for a relative gate when both
        runs were repeated with a usable interval; else None."""
        if not self.relative:
            return None
        pair = (_noise(base, self.metric), _noise(run, self.metric))
        return None if None in pair else pair


def parse_gate(text: str) -> Gate:
    match = _GATE.match(text.strip())
    if match is None:
        raise ValueError(
            f"--fail-if {text!r}: expected METRIC>FACTORx, METRIC<FACTORx, "
            "METRIC>VALUE or METRIC<VALUE (e.g. 'ttft_p99_ms>1.1x')"
        )
    gate = Gate(
        metric=match["metric"],
        above=match["op"] == ">",
        value=float(match["value"]),
        relative=bool(match["x"]),
    )
    metric(BenchResult(), gate.metric)  # an unknown name fails here, before any judging
    return gate


def rows(results: list[BenchResult], names: tuple[str, ...] = SHOWN) -> list[list[str]]:
    """Per metric: each run's value and, after the first, its ratio to the first run's."""
    out = []
    for name in names:
        values = [metric(r, name) for r in results]
        noise = [_noise(r, name) for r in results]
        values = [n.mean if n else v for v, n in zip(values, noise, strict=True)]
        base = values[0]
        cells = [name, _number(base) + _ci(noise[0])]
        for value, spread in zip(values[1:], noise[1:], strict=True):
            ratio = (
                value / base
                if base and not math.isnan(base) and not math.isnan(value)
                else math.nan
            )
            cells.append(
                _number(value) + _ci(spread) + ("" if math.isnan(ratio) else f" ({ratio:.2f}x)")
            )
        out.append(cells)
    return out


def _noise(result: BenchResult, name: str):
    """The figure's repeats when the run was repeated (`--repeat`) with an interval; else None."""
    found = result.repeats.figures.get(name) if result.repeats else None
    return found if found is not None and not math.isnan(found.ci95_low) else None


def _ci(spread) -> str:
    """` ±H` (half the 95% interval of the mean) of a repeated figure; "" for one run."""
    return "" if spread is None else f" ±{_number((spread.ci95_high - spread.ci95_low) / 2)}"


def _number(value: float) -> str:
    if math.isnan(value):
        return "—"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.2f}"
