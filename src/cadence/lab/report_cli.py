"""The `cadence report` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="render a bench or sweep JSON result as one HTML page")
    p.add_argument("results", help="JSON written by `cadence bench --json` (or a sweep)")
    p.add_argument("--out", default=None,
                   help="folder for report.html and the PNGs (default: <stem>-report/ next to the JSON)")
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


def _report(args: argparse.Namespace) -> None:
    problem = missing_plotting()
    if problem is not None:
        sys.exit(f"cadence report: {problem}")
    import msgspec

    from cadence.lab.report.run import decode_result, render_report

    source = Path(args.results)
    try:
        with source.open() as f:
            data = json.load(f)
    except OSError as exc:
        sys.exit(f"cadence report: cannot read {source}: {exc.strerror or exc}")
    except json.JSONDecodeError as exc:
        sys.exit(f"cadence report: {source} is not JSON: {exc}")
    if not isinstance(data, dict):
        sys.exit(f"cadence report: {source} holds a {type(data).__name__}, not a result object")
    try:
        result, records_note = decode_result(data)
    except msgspec.ValidationError as exc:
        sys.exit(f"cadence report: {source} is not a bench or sweep result: {exc}")
    out_dir = Path(args.out) if args.out else source.with_name(f"{source.stem}-report")
    print(render_report(result, out_dir, source=source.name, records_note=records_note))
