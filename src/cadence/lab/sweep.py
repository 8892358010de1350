"""`cadence sweep`: change one variable at a time, fresh server per value, same workload.

Point S11 of the design: measure before changing. Each value of the varied variable gets a
new server (so nothing carries over), the same workload, and `repeat` runs, and the table
shows the spread over repeats next to the mean. The server is `cadence serve`, or any
server started from a command line (`server_cmd`, lab/command_server.py) whose `{NAME}` the
variable fills. A server that exits or never gets ready is recorded as that run's failure,
and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import statistics
from collections.abc import Callable

import msgspec

from cadence.credentials import ClientCredentials
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.cadence_v1 import CadenceTarget
from cadence.lab.load.grpc_schema import SchemaError
from cadence.lab.load.kserve import KServeTarget
from cadence.lab.load.openai_http import OpenAITarget
from cadence.lab.servers.command_server import CommandServer
from cadence.lab.servers.server_process import ServerProcess

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


def parse_vary(text: str, server_cmd: str | None = None) -> tuple[str, list[str]]:
    """`name=v1,v2,...` → (name, values). With `server_cmd`, NAME is any `{NAME}` of the
    command (or a client variable)."""
    name, _, values = text.partition("=")
    name = name.strip()
    if server_cmd is not None:
        if name not in CLIENT_VARIABLES and "{" + name + "}" not in server_cmd:
            raise ValueError(f"--server-cmd has no {{{name}}} to vary (nor is {name!r} one of "
                             f"the client variables {', '.join(CLIENT_VARIABLES)})")
        if name == "port":
            raise ValueError("{port} is chosen by the sweep; vary another name")
    else:
        name = name.replace("-", "_")
    if server_cmd is None and name not in SERVER_VARIABLES and name not in CLIENT_VARIABLES:
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
              repeat: int = 1, processes: int = 1, progress=print, *,
              server_cmd: str | None = None, ready_timeout: float = 60.0,
              credentials: ClientCredentials | None = None,
              kserve: KServeTarget | None = None,
              resolve_grpc: Callable | None = None,
              openai: OpenAITarget | None = None) -> dict:
    """Every value, `repeat` times, each on a fresh server; results without raw records.

    The server is `cadence serve SERVE_ARGS`, or `server_cmd` filled with the value. With
    `kserve` the load speaks the Open Inference Protocol; with `resolve_grpc(target,
    credentials)`, which resolves any gRPC method once (against the first server that is
    ready), the load drives that method. With `openai` each server also serves HTTP
    (`--http-port 0`) and the load speaks the OpenAI API to it.
    """
    grpc = None
    points = []
    for value in values:
        runs, failures = [], []
        for n in range(repeat):
            load, procs = workload, processes
            if variable == "concurrency":
                load = dataclasses.replace(workload, concurrency=int(value), rate=None)
            elif variable == "rate":
                load = dataclasses.replace(workload, rate=float(value))
            elif variable == "procs":
                procs = int(value)
            if server_cmd is not None:
                server = CommandServer(server_cmd, {variable: value}, ready_timeout,
                                       credentials=credentials)
                progress(f"{variable}={value} run {n + 1}/{repeat}: {server.command}")
            else:
                args = _server_args(serve_args, variable, value)
                if openai is not None:
                    args = [*args, "--http-port", "0"]
                server = ServerProcess(*args)
                progress(f"{variable}={value} run {n + 1}/{repeat}: "
                         f"cadence serve {shlex.join(args)}")
            try:
                with server:
                    if resolve_grpc is not None and grpc is None:
                        grpc = resolve_grpc(server.target, credentials or ClientCredentials())
                    http = _http_target(server, openai) if openai is not None else None
                    result = run_bench(server.target, load, processes=procs,
                                       credentials=credentials,
                                       protocol=http or grpc or kserve or CadenceTarget())
            except SchemaError:
                raise  # the same for every value: the sweep cannot run
            except RuntimeError as exc:
                progress(f"{variable}={value} run {n + 1}/{repeat} failed: {exc}")
                failures.append(str(exc))
                continue
            result.pop("records")
            runs.append(result)
        point = {"value": value, "repeats": runs}
        if failures:
            point["failures"] = failures
        points.append(point)
    sweep = {"variable": variable, "repeat": repeat, "points": points,
             "table": sweep_table(points)}
    if server_cmd is not None:
        sweep["server_cmd"] = server_cmd
    else:
        sweep["serve_args"] = serve_args
    return {"sweep": sweep}


def _http_target(server: ServerProcess, openai: OpenAITarget) -> OpenAITarget:
    """`openai` aimed at the HTTP port on the server's start line."""
    match = re.search(r"\(http on (\S+):(\d+)\)", server.banner)
    if match is None:
        raise RuntimeError(f"the server printed no HTTP port: {server.banner!r}")
    return msgspec.structs.replace(openai, base_url=f"http://{match.group(1)}:{match.group(2)}")


def sweep_table(points: list[dict]) -> list[dict]:
    """Per value: each metric's mean over repeats and its spread (min, max, stdev)."""
    rows = []
    for point in points:
        row = {"value": point["value"]}
        if point.get("failures"):
            row["failures"] = len(point["failures"])
        if not point["repeats"]:
            rows.append(row)
            continue
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
    table = Table(title=f"cadence sweep: {s['variable']} ({s['repeat']} run(s) each; mean \\[min-max])")
    table.add_column(s["variable"])
    for name, _ in TABLE_METRICS:
        table.add_column(name, justify="right")
    failed = any(row.get("failures") for row in s["table"])
    if failed:
        table.add_column("failed runs", justify="right")
    for row in s["table"]:
        cells = []
        if TABLE_METRICS[0][0] not in row:
            table.add_row(str(row["value"]), *("—" for _ in TABLE_METRICS),
                          *([str(row.get("failures", 0))] if failed else []))
            continue
        for name, _ in TABLE_METRICS:
            m = row[name]
            fmt = "{:.0f}" if name == "tokens_per_s" else "{:.2f}"
            cell = fmt.format(m["mean"])
            if m["max"] != m["min"]:
                cell += f" [{fmt.format(m['min'])}-{fmt.format(m['max'])}]"
            cells.append(cell)
        if failed:
            cells.append(str(row.get("failures", 0)))
        table.add_row(str(row["value"]), *cells)
    console = Console()
    console.print(table)
    for point in s["points"]:
        for failure in point.get("failures", []):
            console.print(f"{s['variable']}={point['value']}: {failure}", highlight=False)
