"""The `cadence capacity` command line."""

from __future__ import annotations

import argparse
import json
import sys

from cadence.lab.options import CAPACITY, add_flags


def add_capacity(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "capacity",
        help="the largest load a running server takes within a "
        "latency SLO, and what binds it there",
    )
    add_flags(p, CAPACITY)  # as cadence.lab.options declares them
    p.set_defaults(func=_capacity)


def _capacity(args: argparse.Namespace) -> None:
    from cadence.lab.bench import run_bench
    from cadence.lab.bench_cli import bench_inputs
    from cadence.lab.capacity import at_load, search
    from cadence.lab.output_paths import check_outputs, writing
    from cadence.lab.results import CapacityResult

    check_outputs("capacity", {"--json": args.json_path})
    if not 0 < args.low < args.high:
        sys.exit("cadence capacity: --low must be above 0 and below --high")
    if args.search == "concurrency" and (args.low != int(args.low) or args.high != int(args.high)):
        sys.exit("cadence capacity: --search concurrency takes whole --low and --high")
    workload, credentials, slo, protocol = bench_inputs(args, "capacity")

    def run(value: float):
        return run_bench(
            args.target,
            at_load(workload, args.search, value),
            processes=args.procs,
            channels=args.channels,
            credentials=credentials,
            protocol=protocol,
            slo=slo,
            scrape=args.scrape,
        )

    try:
        capacity = search(
            run, args.search, args.low, args.high, slo, args.repeat, confirm=args.confirm_runs
        )
    except RuntimeError as exc:
        sys.exit(f"cadence capacity: {exc}")
    print_capacity(capacity)
    if args.json_path:
        import msgspec

        with writing("capacity", "--json", args.json_path), open(args.json_path, "w") as f:
            json.dump(msgspec.to_builtins(CapacityResult(capacity=capacity)), f)
    if capacity.client_limited_at is not None:
        sys.exit(
            f"cadence capacity: the client limited the run at {args.search} "
            f"{capacity.client_limited_at:g}, so the search cannot say what the server "
            "takes: add --procs (or run the client on another host)"
        )


def print_capacity(capacity) -> None:
    from rich.console import Console
    from rich.table import Table

    from cadence.lab.analysis.goodput import slo_names
    from cadence.lab.report.capacity import answer_lines
    from cadence.lab.report.summary import PIPED_WIDTH

    piped = not sys.stdout.isatty()
    console = Console(soft_wrap=piped, width=PIPED_WIDTH if piped else None)
    table = Table(title=f"cadence capacity: {capacity.search} within {slo_names(capacity.slo)}")
    for column in (
        capacity.search,
        "TTFT p99 ms",
        "ITL p99 ms",
        "tokens/s",
        "goodput tokens/s",
        "SLO",
        "diagnosis",
    ):
        table.add_column(column)
    for p in sorted(capacity.points, key=lambda p: p.value):
        table.add_row(
            f"{p.value:g}",
            f"{p.ttft_p99_ms:.1f}",
            f"{p.itl_p99_ms:.1f}",
            f"{p.tokens_per_s:,.0f}",
            f"{p.goodput_tokens_per_s:,.0f}",
            "met"
            if p.passed
            else ("client-limited" if p.client_limited else "missed: " + ", ".join(p.failed_terms)),
            " ".join(p.diagnosis),
        )
    console.print(table)
    for line in answer_lines(capacity):
        console.print(line, highlight=False, markup=False)
    if capacity.first_failing is not None and capacity.client_limited_at is None:
        console.print(
            f"{capacity.search} {capacity.first_failing:g} misses it: "
            f"{', '.join(capacity.binding)}",
            highlight=False,
        )
        for term in capacity.binding:
            if term in capacity.reasons:
                console.print(f"  because {capacity.reasons[term]}", highlight=False, markup=False)
        if capacity.knee:
            console.print(f"  where the time went: {capacity.knee}", highlight=False, markup=False)
        for f in capacity.why:
            console.print(
                f"  why, {f.rule}: {f.finding}\n    look at: {f.look_at}",
                highlight=False,
                markup=False,
            )
    console.print(f"search: {capacity.runs} runs in {capacity.elapsed_s:.1f} s", highlight=False)
