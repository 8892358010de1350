"""The `cadence report` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="render a bench or sweep JSON result as one HTML page, "
                                      "or compare bench runs side by side")
    p.add_argument("results", nargs="+",
                   help="JSON written by `cadence bench --json` (or a sweep); two or more bench "
                        "results: one table of their metrics, with each run's ratio to the first")
    p.add_argument("--out", default=None,
                   help="folder for report.html and the PNGs (default: <stem>-report/ next to the JSON)")
    p.add_argument("--fail-if", action="append", default=[], metavar="GATE",
                   help="with two or more runs: exit non-zero when a later run fails the gate, "
                        "e.g. 'ttft_p99_ms>1.1x' (above 1.1 times the first run's), "
                        "'tokens_per_s<0.9x', 'errors>0' (repeatable; default: none)")
    p.set_defaults(func=_report)


def missing_plotting() -> str | None:
    """Why the report cannot be drawn here (plotting is the `lab` extra), or None."""
    import importlib.util

    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return ("the report's plots need matplotlib, which is not installed; install it with: "
                "pip install 'cadence[lab]'")
    return None


def _read(path: str) -> dict:
    source = Path(path)
    try:
        with source.open() as f:
            data = json.load(f)
    except OSError as exc:
        sys.exit(f"cadence report: cannot read {source}: {exc.strerror or exc}")
    except json.JSONDecodeError as exc:
        sys.exit(f"cadence report: {source} is not JSON: {exc}")
    if not isinstance(data, dict):
        sys.exit(f"cadence report: {source} holds a {type(data).__name__}, not a result object")
    return data


def _compare(args: argparse.Namespace) -> None:
    """Two or more bench runs side by side; the gates judged on every run after the first."""
    import msgspec
    from rich.console import Console
    from rich.table import Table

    from cadence.lab.report.compare import parse_gate, rows
    from cadence.lab.report.summary import PIPED_WIDTH
    from cadence.lab.results import BenchResult

    try:
        gates = [parse_gate(text) for text in args.fail_if]
    except ValueError as exc:
        sys.exit(f"cadence report: {exc}")
    runs = []
    for path in args.results:
        data = _read(path)
        if "sweep" in data or "capacity" in data:
            sys.exit(f"cadence report: {path} is not a bench result; comparisons take bench "
                     "results (cadence bench --json)")
        data.pop("records", None)  # not compared: no need to decode them
        try:
            runs.append(msgspec.convert(data, BenchResult))
        except msgspec.ValidationError as exc:
            sys.exit(f"cadence report: {path} is not a bench result: {exc}")
    names = [Path(p).name for p in args.results]
    table = Table(title="cadence report: " + " vs ".join(names))
    for column in ("metric", *names):
        table.add_column(column, justify="right")
    for row in rows(runs):
        table.add_row(*row)
    piped = not sys.stdout.isatty()
    Console(soft_wrap=piped, width=PIPED_WIDTH if piped else None).print(table)
    failures = [line for gate in gates for run, name in zip(runs[1:], names[1:], strict=True)
                if (line := gate.failure(runs[0], run, name)) is not None]
    for line in failures:
        print(f"cadence report: {line}", file=sys.stderr)
    if failures:
        sys.exit(1)


def _report(args: argparse.Namespace) -> None:
    if len(args.results) > 1:
        _compare(args)
        return
    if args.fail_if:
        sys.exit("cadence report: --fail-if judges a run against an earlier one: give two or "
                 "more results")
    problem = missing_plotting()
    if problem is not None:
        sys.exit(f"cadence report: {problem}")
    import msgspec

    from cadence.lab.report.run import decode_result, render_report

    source = Path(args.results[0])
    data = _read(args.results[0])
    out_dir = Path(args.out) if args.out else source.with_name(f"{source.stem}-report")
    if "capacity" in data:
        from cadence.lab.report.capacity import render_capacity
        from cadence.lab.results import CapacityResult

        try:
            capacity = msgspec.convert(data, CapacityResult).capacity
        except msgspec.ValidationError as exc:
            sys.exit(f"cadence report: {source} is not a capacity result: {exc}")
        print(render_capacity(capacity, out_dir, source=source.name))
        return
    try:
        result, records_note = decode_result(data)
    except msgspec.ValidationError as exc:
        sys.exit(f"cadence report: {source} is not a bench or sweep result: {exc}")
    print(render_report(result, out_dir, source=source.name, records_note=records_note))
