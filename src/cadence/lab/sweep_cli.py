"""The `cadence sweep` command line."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from cadence.lab.bench_cli import add_workload_args, workload_from_args


def add_sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="vary one setting, fresh server per value, same workload")
    p.add_argument("--vary", required=True,
                   help="NAME=V1,V2,...: queue_capacity, workers, max_concurrent, max_batch, "
                        "step_ms, jitter_ms, overflow, engine_threads (app engine), fronts, "
                        "concurrency, rate or procs")
    p.add_argument("--repeat", type=int, default=1, help="runs per value")
    p.add_argument("--serve-args", default="--devices cpu:2 --step-ms 20",
                   help="arguments of `cadence serve` that stay fixed (quoted)")
    add_workload_args(p)
    p.add_argument("--json", dest="json_path", default=None, help="write the sweep's results here")
    p.add_argument("--report", default=None, help="render plots and an HTML report into this folder")
    p.set_defaults(func=_sweep)


def _sweep(args: argparse.Namespace) -> None:
    from cadence.lab.sweep import parse_vary, print_table, run_sweep

    try:
        variable, values = parse_vary(args.vary)
    except ValueError as exc:
        sys.exit(f"cadence sweep: {exc}")
    if args.repeat < 1:
        sys.exit("cadence sweep: --repeat must be at least 1")
    if args.report:  # before the sweep, not after it
        from cadence.lab.report_cli import missing_plotting

        if missing_plotting() is not None:
            sys.exit(f"cadence sweep: {missing_plotting()}")
    result = run_sweep(variable, values, shlex.split(args.serve_args), workload_from_args(args),
                       repeat=args.repeat, processes=args.procs)
    print_table(result)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f)
    if args.report:
        from pathlib import Path

        from cadence.lab.report import render_report

        print(render_report(result, Path(args.report)))
