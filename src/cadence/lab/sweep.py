"""`cadence sweep`: change one variable at a time, fresh server per value, same workload.

Point S11 of the design: measure before changing. Each value of the varied variable gets a
new `cadence serve` (so nothing carries over), the same workload, and `repeat` runs, and
the table shows the spread over repeats next to the mean.
"""

from __future__ import annotations

import dataclasses
import shlex
import statistics

from cadence.lab.bench import Workload, run_bench
from cadence.lab.server_process import ServerProcess

SERVER_VARIABLES = {
    "queue_capacity": "--queue-capacity",
    "max_concurrent": "--max-concurrent",
    "max_batch": "--max-batch",
    "step_ms": "--step-ms",
    "jitter_ms": "--jitter-ms",
    "overflow": "--overflow",
    "workers": "--devices",
    "engine_threads": "--engine-threads",
    "fronts": "--fronts",
}
"""Variables that change the server, and the `cadence serve` flag each sets."""
CLIENT_VARIABLES = ("concurrency", "rate", "procs")
"""Variables that change the load."""

TABLE_METRICS = (
    ("ttft_p50_ms", lambda r: r["ttft_ms"]["p50"]),
    ("ttft_p99_ms", lambda r: r["ttft_ms"]["p99"]),
    ("itl_mean_ms", lambda r: r["itl_ms"]["mean"]),
    ("itl_p90_ms", lambda r: r["itl_ms"]["p90"]),
    ("tokens_per_s", lambda r: r["tokens_per_s"]),
)


def parse_vary(text: str) -> tuple[str, list[str]]:
    """`name=v1,v2,...` → (name, values)."""
    name, _, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if name not in SERVER_VARIABLES and name not in CLIENT_VARIABLES:
        known = ", ".join(sorted([*SERVER_VARIABLES, *CLIENT_VARIABLES]))
        raise ValueError(f"cannot vary {name!r}; choose one of: {known}")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not items:
        raise ValueError(f"--vary {name}=... needs at least one value")
    return name, items


def _server_args(base: list[str], variable: str, value: str) -> list[str]:
    if variable not in SERVER_VARIABLES:
        return base
    flag = SERVER_VARIABLES[variable]
    value = f"cpu:{value}" if variable == "workers" else value
    return [*base, flag, value]  # argparse keeps the last occurrence of a flag


def run_sweep(variable: str, values: list[str], serve_args: list[str], workload: Workload,
              repeat: int = 1, processes: int = 1, progress=print) -> dict:
    """Every value, `repeat` times, each on a fresh server; results without raw records."""
    points = []
    for value in values:
        runs = []
        for n in range(repeat):
            args = _server_args(serve_args, variable, value)
            load, procs = workload, processes
            if variable == "concurrency":
                load = dataclasses.replace(workload, concurrency=int(value), rate=None)
            elif variable == "rate":
                load = dataclasses.replace(workload, rate=float(value))
            elif variable == "procs":
                procs = int(value)
            progress(f"{variable}={value} run {n + 1}/{repeat}: cadence serve {shlex.join(args)}")
            with ServerProcess(*args) as server:
                result = run_bench(server.target, load, processes=procs)
            result.pop("records")
            runs.append(result)
        points.append({"value": value, "repeats": runs})
    return {"sweep": {"variable": variable, "serve_args": serve_args, "repeat": repeat,
                      "points": points, "table": sweep_table(points)}}


def sweep_table(points: list[dict]) -> list[dict]:
    """Per value: each metric's mean over repeats and its spread (min, max, stdev)."""
    rows = []
    for point in points:
        row = {"value": point["value"]}
        for name, get in TABLE_METRICS:
            values = [get(r) for r in point["repeats"]]
            row[name] = {
                "mean": statistics.fmean(values),
                "min": min(values),
                "max": max(values),
                "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            }
        rows.append(row)
    return rows


def print_table(sweep: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s = sweep["sweep"]
    table = Table(title=f"cadence sweep: {s['variable']} ({s['repeat']} run(s) each; mean [min-max])")
    table.add_column(s["variable"])
    for name, _ in TABLE_METRICS:
        table.add_column(name, justify="right")
    for row in s["table"]:
        cells = []
        for name, _ in TABLE_METRICS:
            m = row[name]
            fmt = "{:.0f}" if name == "tokens_per_s" else "{:.2f}"
            cell = fmt.format(m["mean"])
            if m["max"] != m["min"]:
                cell += f" [{fmt.format(m['min'])}-{fmt.format(m['max'])}]"
            cells.append(cell)
        table.add_row(str(row["value"]), *cells)
    Console().print(table)
