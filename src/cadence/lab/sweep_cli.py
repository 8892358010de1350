"""The `cadence sweep` command line."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from cadence.lab.bench_cli import (
    check_scrapes,
    openai_from_args,
    protocol_from_args,
    workload_from_args,
)
from cadence.lab.options import SERVE_ARGS, SWEEP, add_flags


def add_sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="vary server or load settings (one, or a grid of several); same workload per point",
    )
    add_flags(p, SWEEP)  # as cadence.lab.options declares them
    p.set_defaults(func=_sweep)


def _sweep(args: argparse.Namespace) -> None:
    from cadence.credentials import from_arguments
    from cadence.lab.load.grpc_schema import SchemaError
    from cadence.lab.output_paths import check_outputs, writing
    from cadence.lab.results import to_builtins
    from cadence.lab.sweep import (
        Load,
        every_run_failed,
        grid,
        parse_vary,
        print_table,
        run_sweep,
        write_csv,
    )

    if args.target is not None and (args.server_cmd or args.serve_args != SERVE_ARGS):
        sys.exit(
            "cadence sweep: --target drives a running server; --serve-args and "
            "--server-cmd start servers: give one or the other"
        )
    check_outputs(
        "sweep", {"--json": args.json_path, "--csv": args.csv_path}, {"--report": args.report}
    )
    if args.scrape and args.target is None:
        sys.exit(
            "cadence sweep: --scrape needs --target: a server the sweep starts per run "
            "has no metrics address known before it starts"
        )
    check_scrapes(args.scrape, "sweep")
    base = Load(workload_from_args(args), args.procs, args.channels)
    try:
        axes = [
            parse_vary(text, args.server_cmd, running=args.target is not None) for text in args.vary
        ]
        points = grid(axes, base)
        credentials = from_arguments(args)
    except ValueError as exc:
        sys.exit(f"cadence sweep: {exc}")
    if args.report:  # before the sweep, not after it
        from cadence.lab.report_cli import missing_plotting

        if missing_plotting() is not None:
            sys.exit(f"cadence sweep: {missing_plotting()}")
    kserve, resolve = protocol_from_args(args, "sweep")
    openai = openai_from_args(args, "sweep")
    if openai is not None and args.server_cmd:
        sys.exit(
            "cadence sweep: --protocol openai runs cadence serve (with --http-port), not "
            "--server-cmd"
        )
    try:
        result = run_sweep(
            points,
            shlex.split(args.serve_args),
            repeat=args.repeat,
            target=args.target,
            server_cmd=args.server_cmd,
            ready_timeout=args.ready_timeout,
            credentials=credentials,
            kserve=kserve,
            resolve_grpc=resolve,
            openai=openai,
            scrape=args.scrape,
        )
    except SchemaError as exc:
        sys.exit(f"cadence sweep: {exc}")
    print_table(result)
    written = to_builtins(result)
    if args.json_path:
        with writing("sweep", "--json", args.json_path), open(args.json_path, "w") as f:
            json.dump(written, f)
    if args.csv_path:
        with writing("sweep", "--csv", args.csv_path):
            write_csv(result, args.csv_path)
    if args.report:
        from pathlib import Path

        from cadence.lab.report.run import render_report

        with writing("sweep", "--report", args.report):
            print(render_report(result, Path(args.report)))
    if every_run_failed(result):
        runs = sum(len(p.failures or []) for p in result.sweep.points)
        sys.exit(f"cadence sweep: every run failed ({runs} of {runs}); each one's reason is above")
