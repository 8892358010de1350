"""The `cadence report` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_GATE_FAILED = 1
"""A run failed a --fail-if gate (a regression, or an integrity fault gated on)."""
EXIT_USAGE = 2
"""The command line is wrong: a gate that does not parse, a metric the report does not know
(a misspelling must not read as a regression), a relative gate with one run."""
EXIT_CANNOT_REPORT = 3
"""The report cannot be made: a result file cannot be read, is not JSON or is not the kind of
result the command takes, or plotting is not installed."""
EXIT_CODES = (
    f"exit status: 0 the report was written and every gate passed; "
    f"{EXIT_GATE_FAILED} a run failed a --fail-if gate; {EXIT_USAGE} a usage error "
    "(a gate that does not parse, an unknown metric); "
    f"{EXIT_CANNOT_REPORT} the report cannot be made (a result cannot be read, or "
    "matplotlib is missing)"
)


def _exit(message: str, code: int) -> None:
    print(f"cadence report: {message}", file=sys.stderr)
    sys.exit(code)


def add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="render a bench or sweep JSON result as one HTML page, "
        "or compare bench runs side by side",
        epilog=EXIT_CODES,
    )
    p.add_argument(
        "results",
        nargs="+",
        help="JSON written by `cadence bench --json` (or a sweep); two or more bench "
        "results: one table of their metrics, with each run's ratio to the first",
    )
    p.add_argument(
        "--out",
        default=None,
        help="folder for report.html and the PNGs (default: <stem>-report/ next to the JSON)",
    )
    p.add_argument(
        "--fail-if",
        action="append",
        default=[],
        metavar="GATE",
        help=f"exit {EXIT_GATE_FAILED} when a later run fails the gate, e.g. "
        "'ttft_p99_ms>1.1x' (above 1.1 times the first run's), "
        "'tokens_per_s<0.9x', 'errors>0', 'lost_tokens>0', "
        "'reordered_chunks>0', 'integrity_faults>0'; with one run, absolute "
        "gates are judged on it (repeatable; default: none)",
    )
    p.set_defaults(func=_report)


def missing_plotting() -> str | None:
    """Why the report cannot be drawn here (plotting is the `lab` extra), or None."""
    import importlib.util

    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return (
            "the report's plots need matplotlib, which is not installed; install it with: "
            "pip install 'cadence[lab]'"
        )
    return None


def _read(path: str) -> dict:
    source = Path(path)
    try:
        with source.open() as f:
            data = json.load(f)
    except OSError as exc:
        _exit(f"cannot read {source}: {exc.strerror or exc}", EXIT_CANNOT_REPORT)
    except json.JSONDecodeError as exc:
        _exit(f"{source} is not JSON: {exc}", EXIT_CANNOT_REPORT)
    if not isinstance(data, dict):
        _exit(f"{source} holds a {type(data).__name__}, not a result object", EXIT_CANNOT_REPORT)
    return data


def _gates(texts: list[str], runs: int) -> list:
    """The parsed gates; exits EXIT_USAGE when one does not parse or names an unknown metric,
    or is relative with one run to hold it to."""
    from cadence.lab.report.compare import parse_gate

    gates = []
    for text in texts:
        try:
            gates.append(parse_gate(text))
        except ValueError as exc:
            _exit(str(exc), EXIT_USAGE)
    relative = [g.text for g in gates if g.relative]
    if runs < 2 and relative:
        _exit(
            f"--fail-if {', '.join(relative)} judges a run against an earlier one: give two "
            "or more results",
            EXIT_USAGE,
        )
    return gates


def _judge(gates: list, runs: list, names: list[str]) -> None:
    """Every gate on every run after the first (on the one run when there is one); exits
    EXIT_GATE_FAILED with one line per failure."""
    judged = list(zip(runs[1:], names[1:], strict=True)) or [(runs[0], names[0])]
    said = [gate.verdict(runs[0], run, name) for gate in gates for run, name in judged]
    for line, failed in said:
        if line is not None and not failed:
            print(f"cadence report: {line}")
    failures = [line for line, failed in said if failed]
    for line in failures:
        print(f"cadence report: {line}", file=sys.stderr)
    if failures:
        sys.exit(EXIT_GATE_FAILED)


def _compare(args: argparse.Namespace) -> None:
    """Two or more bench runs side by side; the gates judged on every run after the first."""
    import msgspec
    from rich.console import Console
    from rich.table import Table

    from cadence.lab.report.compare import rows
    from cadence.lab.report.summary import PIPED_WIDTH
    from cadence.lab.results import BenchResult

    gates = _gates(args.fail_if, len(args.results))
    runs = []
    for path in args.results:
        data = _read(path)
        if "sweep" in data or "capacity" in data:
            _exit(
                f"{path} is not a bench result; comparisons take bench results (cadence "
                "bench --json)",
                EXIT_CANNOT_REPORT,
            )
        data.pop("records", None)  # not compared: no need to decode them
        try:
            runs.append(msgspec.convert(data, BenchResult))
        except msgspec.ValidationError as exc:
            _exit(f"{path} is not a bench result: {exc}", EXIT_CANNOT_REPORT)
    names = [Path(p).name for p in args.results]
    table = Table(title="cadence report: " + " vs ".join(names))
    for column in ("metric", *names):
        table.add_column(column, justify="right")
    for row in rows(runs):
        table.add_row(*row)
    piped = not sys.stdout.isatty()
    Console(soft_wrap=piped, width=PIPED_WIDTH if piped else None).print(table)
    _judge(gates, runs, names)


def _report(args: argparse.Namespace) -> None:
    if len(args.results) > 1:
        _compare(args)
        return
    gates = _gates(args.fail_if, 1)
    problem = missing_plotting()
    if problem is not None:
        _exit(problem, EXIT_CANNOT_REPORT)
    import msgspec

    from cadence.lab.output_paths import check_outputs, writing
    from cadence.lab.report.run import decode_result, render_report

    source = Path(args.results[0])
    data = _read(args.results[0])
    out_dir = Path(args.out) if args.out else source.with_name(f"{source.stem}-report")
    check_outputs("report", {}, {"--out": str(out_dir)})
    if "capacity" in data:
        from cadence.lab.report.capacity import render_capacity
        from cadence.lab.results import CapacityResult

        if gates:
            _exit("--fail-if judges bench results, not a capacity search", EXIT_USAGE)
        try:
            capacity = msgspec.convert(data, CapacityResult).capacity
        except msgspec.ValidationError as exc:
            _exit(f"{source} is not a capacity result: {exc}", EXIT_CANNOT_REPORT)
        with writing("report", "--out", str(out_dir), EXIT_CANNOT_REPORT):
            print(render_capacity(capacity, out_dir, source=source.name))
        return
    if gates and "sweep" in data:
        _exit("--fail-if judges bench results, not a sweep", EXIT_USAGE)
    try:
        result, records_note = decode_result(data)
    except msgspec.ValidationError as exc:
        _exit(f"{source} is not a bench or sweep result: {exc}", EXIT_CANNOT_REPORT)
    with writing("report", "--out", str(out_dir), EXIT_CANNOT_REPORT):
        print(render_report(result, out_dir, source=source.name, records_note=records_note))
    _judge(gates, [result], [source.name])
