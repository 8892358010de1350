"""`cadence sweep`: the same workload at each point of one variable, or of several (a grid).

Each point gets `repeat` runs, and the table shows the spread over repeats next to the
mean. A variable changes the server (SERVER_VARIABLES, or any `{NAME}` of `server_cmd`) or
the load (CLIENT_VARIABLES), both declared with the lab's options (cadence.lab.options). Without `target` each run gets a fresh server, so nothing
carries over: `cadence serve`, or any server started from a command line (`server_cmd`,
lab/servers/command_server.py) whose `{NAME}`s the values fill. With `target` the sweep
drives a server that is already running and varies only the load: nothing is restarted,
since a large model takes minutes to load. A run that fails (the server exits or never gets
ready, nothing answers, no request succeeds) is recorded as its point's failure, and the
sweep goes on.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import itertools
import re
import shlex
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import NamedTuple

import msgspec

from cadence.credentials import ClientCredentials
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.cadence_v1 import CADENCE
from cadence.lab.load.grpc_schema import SchemaError
from cadence.lab.load.grpc_service import GrpcTarget
from cadence.lab.load.kserve import KServeTarget
from cadence.lab.load.openai_http import OpenAITarget, require_http
from cadence.lab.options import SERVER_VARIABLES, client_variables
from cadence.lab.report.summary import PIPED_WIDTH
from cadence.lab.results import BenchResult, Spread, Sweep, SweepPoint, SweepResult, SweepRow
from cadence.lab.servers.command_server import CommandServer
from cadence.lab.servers.readiness import require_reachable
from cadence.lab.servers.server_process import ServerProcess
from cadence.wording import counted


@dataclasses.dataclass(frozen=True)
class Load:
    """What one run sends, and from how many client processes and connections."""

    workload: Workload
    processes: int = 1
    channels: int = 1


CLIENT_VARIABLES: dict[str, Callable[[Load, str], Load]] = client_variables()
"""Variables that change the load (named as `cadence bench`'s flags), and how each value
changes it; a bad value raises ValueError. Declared on the load's options
(cadence.lab.options.WorkloadOptions, `Flag.vary`)."""

TABLE_METRICS = (
    ("ttft_p50_ms", lambda r: r.ttft_ms.p50),
    ("ttft_p99_ms", lambda r: r.ttft_ms.p99),
    ("itl_mean_ms", lambda r: r.itl_ms.mean),
    ("itl_p90_ms", lambda r: r.itl_ms.p90),
    ("tokens_per_s", lambda r: r.tokens_per_s),
)


def parse_vary(
    text: str, server_cmd: str | None = None, *, running: bool = False
) -> tuple[str, list[str]]:
    """`name=v1,v2,...` → (name, values). With `server_cmd`, NAME is any `{NAME}` of the
    command (or a client variable); with `running` (a server the sweep does not start),
    only a client variable."""
    name, _, values = text.partition("=")
    name = name.strip()
    if server_cmd is None or name.replace("-", "_") in CLIENT_VARIABLES:
        name = name.replace("-", "_")
    if running and name in SERVER_VARIABLES:
        raise ValueError(
            f"{name} changes the server, and --target drives a running one that "
            "the sweep does not restart: sweep it with --serve-args or "
            "--server-cmd instead"
        )
    if server_cmd is not None:
        if name not in CLIENT_VARIABLES and "{" + name + "}" not in server_cmd:
            raise ValueError(
                f"--server-cmd has no {{{name}}} to vary (nor is {name!r} one of "
                f"the client variables {', '.join(CLIENT_VARIABLES)})"
            )
        if name == "port":
            raise ValueError("{port} is chosen by the sweep; vary another name")
    elif name not in CLIENT_VARIABLES and (running or name not in SERVER_VARIABLES):
        known = sorted(CLIENT_VARIABLES if running else [*SERVER_VARIABLES, *CLIENT_VARIABLES])
        raise ValueError(f"cannot vary {name!r}; choose one of: {', '.join(known)}")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not items:
        raise ValueError(f"--vary {name}=... needs at least one value")
    return name, items


class Point(NamedTuple):
    """One point of the grid: the value of each variable, as typed, and the load it sends."""

    values: dict[str, str]
    load: Load


def grid(axes: list[tuple[str, list[str]]], base: Load) -> list[Point]:
    """Every combination of the axes' values, the first axis slowest; ValueError (one line)
    when a variable repeats, the load's variables clash, or a value does not fit."""
    names = [name for name, _ in axes]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--vary {repeated[0]} is given twice; give all its values in one")
    if "concurrency" in names and "rate" in names:
        raise ValueError(
            "--vary concurrency (closed loop) and --vary rate (open loop) do not combine; sweep one"
        )
    points = []
    for combination in itertools.product(*(values for _, values in axes)):
        values = dict(zip(names, combination, strict=True))
        load = base
        for name, value in values.items():
            try:
                load = CLIENT_VARIABLES[name](load, value) if name in CLIENT_VARIABLES else load
            except ValueError as exc:
                raise ValueError(f"--vary {name}={value}: {exc}") from None
        points.append(Point(values, load))
    return points


def _server_args(base: list[str], variable: str, value: str) -> list[str]:
    if variable not in SERVER_VARIABLES:
        return base
    flag = SERVER_VARIABLES[variable]
    value = f"cpu:{value}" if variable == "workers" else value
    return [*base, flag, value]  # argparse keeps the last occurrence of a flag


def run_sweep(
    points: list[Point],
    serve_args: list[str] | None = None,
    repeat: int = 1,
    progress=print,
    *,
    target: str | None = None,
    server_cmd: str | None = None,
    ready_timeout: float = 60.0,
    credentials: ClientCredentials | None = None,
    kserve: KServeTarget | None = None,
    resolve_grpc: Callable | None = None,
    openai: OpenAITarget | None = None,
    scrape: Sequence[str] = (),
) -> SweepResult:
    """Every point, `repeat` times; results without raw records.

    The server is the one running at `target` (its load's variables only; `openai` then
    aims at its HTTP address), or per run a fresh `cadence serve SERVE_ARGS` or `server_cmd`
    filled with the point's values. With `kserve` the load speaks the Open Inference
    Protocol; with `resolve_grpc(target, credentials)`, which resolves any gRPC method once
    (against the first server that answers), the load drives that method. With `openai` and
    a fresh server each serves HTTP too (`--http-port 0`) and the load speaks the OpenAI API
    to it. `scrape`: Prometheus pages every run reads (`run_bench`).
    """
    credentials = credentials or ClientCredentials()
    variables = list(points[0].values)
    grpc = None
    done = []
    for point in points:
        label = " ".join(f"{name}={value}" for name, value in point.values.items())
        runs: list[BenchResult] = []
        failures: list[str] = []
        problem: str | None
        for n in range(repeat):
            described, server = _server_of(
                point.values,
                serve_args or [],
                target,
                server_cmd,
                ready_timeout,
                credentials,
                openai,
            )
            progress(f"{label} run {n + 1}/{repeat}: {described}")
            try:
                with server as (address, http):
                    if resolve_grpc is not None and grpc is None:
                        grpc = resolve_grpc(address, credentials)
                    result = _bench(address, point.load, credentials, kserve, grpc, http, scrape)
            except SchemaError:
                raise  # the same for every point: the sweep cannot run
            except RuntimeError as exc:
                problem = str(exc)
            else:
                result.records = msgspec.UNSET
                problem = _failed(result)
                if problem is None:
                    runs.append(result)
                    continue
            progress(f"{label} run {n + 1}/{repeat} failed: {problem}")
            failures.append(problem)
        done.append(
            SweepPoint(
                value=",".join(point.values.values()),
                values=point.values,
                repeats=runs,
                failed=not runs,
                failures=failures or msgspec.UNSET,
            )
        )
    sweep = Sweep(
        variable=",".join(variables),
        variables=variables,
        repeat=repeat,
        points=done,
        table=sweep_table(done),
    )
    if target is not None:
        sweep.target = target
    elif server_cmd is not None:
        sweep.server_cmd = server_cmd
    else:
        sweep.serve_args = serve_args or []
    return SweepResult(sweep=sweep)


Serving = tuple[str, OpenAITarget | None]
"""A run's server: its gRPC address, and with `--protocol openai` the HTTP target."""


def _server_of(
    values: dict[str, str],
    serve_args: list[str],
    target: str | None,
    server_cmd: str | None,
    ready_timeout: float,
    credentials: ClientCredentials,
    openai: OpenAITarget | None,
) -> tuple[str, AbstractContextManager[Serving]]:
    """(what the server is, in words; a context that yields its gRPC address and its
    OpenAI target) for one run."""
    if target is not None:
        return target, _running(target, credentials, openai)
    if server_cmd is not None:
        server = CommandServer(server_cmd, values, ready_timeout, credentials=credentials)
        return server.command, _started(server, None)
    args = serve_args
    for name, value in values.items():
        args = _server_args(args, name, value)
    if openai is not None:
        args = [*args, "--http-port", "0"]
    return f"cadence serve {shlex.join(args)}", _started(ServerProcess(*args), openai)


@contextlib.contextmanager
def _running(
    target: str, credentials: ClientCredentials, openai: OpenAITarget | None
) -> Iterator[Serving]:
    """The server someone else started: checked that it answers, never restarted."""
    if openai is None:
        require_reachable(target, credentials)
    else:
        require_http(openai)
    yield target, openai


@contextlib.contextmanager
def _started(
    server: ServerProcess | CommandServer, openai: OpenAITarget | None
) -> Iterator[Serving]:
    with server:
        if openai is None:
            yield server.target, None
        else:  # `_server_of` asks a `cadence serve` (the banner names its HTTP port) only
            assert isinstance(server, ServerProcess)
            yield server.target, _http_target(server, openai)


def _bench(
    address: str,
    load: Load,
    credentials: ClientCredentials,
    kserve: KServeTarget | None,
    grpc: GrpcTarget | None,
    openai: OpenAITarget | None,
    scrape: Sequence[str] = (),
) -> BenchResult:
    """The sweep's one call into the bench."""
    return run_bench(
        address,
        load.workload,
        processes=load.processes,
        channels=load.channels,
        credentials=credentials,
        protocol=openai or grpc or kserve or CADENCE,
        scrape=scrape,
    )


def _failed(result: BenchResult) -> str | None:
    """Why a run that went through counts as failed (it stopped early, or no request
    succeeded), or None: its figures would describe errors, not the server's service."""
    if result.aborted:
        return f"the run stopped early: {result.aborted}"
    if result.requests_ok:
        return None
    codes = ", ".join(f"{count} {code}" for code, count in result.errors_by_code.items())
    first = next(iter(result.first_error_by_code.values()), "")
    return f"no request of {result.requests} succeeded" + (
        f" ({codes}; first: {first})" if codes else ""
    )


def _http_target(server: ServerProcess, openai: OpenAITarget) -> OpenAITarget:
    """`openai` aimed at the HTTP port on the server's start line."""
    match = re.search(r"\(http on (\S+):(\d+)\)", server.banner)
    if match is None:
        raise RuntimeError(f"the server printed no HTTP port: {server.banner!r}")
    return msgspec.structs.replace(openai, base_url=f"http://{match.group(1)}:{match.group(2)}")


def every_run_failed(result: SweepResult) -> bool:
    """No point of the sweep has a run that went through."""
    return all(not point.repeats for point in result.sweep.points)


def sweep_table(points: list[SweepPoint]) -> list[SweepRow]:
    """Per point: each metric's mean over repeats and its spread (min, max, stdev), and the
    diagnosis rules that fired in any repeat."""
    rows = []
    for point in points:
        row = SweepRow(value=point.value, values=point.values)
        if point.failures:
            row.failures = len(point.failures)
        if point.repeats:
            for name, get in TABLE_METRICS:
                values = [get(r) for r in point.repeats]
                setattr(
                    row,
                    name,
                    Spread(
                        mean=statistics.fmean(values),
                        min=min(values),
                        max=max(values),
                        stdev=statistics.stdev(values) if len(values) > 1 else 0.0,
                    ),
                )
            row.diagnosis = list(dict.fromkeys(f.rule for r in point.repeats for f in r.diagnosis))
        rows.append(row)
    return rows


def write_csv(result: SweepResult, path: str) -> None:
    """One row per point: its values, each table metric's mean, min, max and stdev, the
    runs that went through and failed, and the diagnosis rules (space-separated)."""
    s = result.sweep
    spread = [
        f"{name}{part}" for name, _ in TABLE_METRICS for part in ("", "_min", "_max", "_stdev")
    ]
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow([*_variables(s), "runs", "failed_runs", *spread, "diagnosis"])
        for point, row in zip(s.points, s.table, strict=True):
            figures = [
                getattr(getattr(row, name), part) if getattr(row, name) else ""
                for name, _ in TABLE_METRICS
                for part in ("mean", "min", "max", "stdev")
            ]
            out.writerow(
                [
                    *_values(point),
                    len(point.repeats),
                    row.failures or 0,
                    *figures,
                    " ".join(row.diagnosis or []),
                ]
            )


def _variables(s: Sweep) -> list[str]:
    """The varied names (a sweep saved before grids names one, `variable`)."""
    return s.variables or [s.variable]


def _values(point: SweepPoint | SweepRow) -> list[str]:
    return list(point.values.values()) if point.values else [point.value]


def print_table(result: SweepResult) -> None:
    from rich.console import Console
    from rich.table import Table

    s = result.sweep
    variables = _variables(s)
    where = f" of {s.target}" if s.target else ""
    table = Table(
        title=f"cadence sweep{where}: {' x '.join(variables)} ({counted(s.repeat, 'run')} "
        "each; mean \\[min-max])"
    )
    for name in variables:
        table.add_column(name)
    for name, _ in TABLE_METRICS:
        table.add_column(name, justify="right")
    failed = any(row.failures for row in s.table)
    if failed:
        table.add_column("failed runs", justify="right")
    diagnosed = any(row.diagnosis for row in s.table)
    if diagnosed:
        table.add_column("diagnosis")
    for row in s.table:
        cells = _values(row)
        for name, _ in TABLE_METRICS:
            spread = getattr(row, name)
            cells.append(_cell(name, spread) if spread else "—")
        if failed:
            cells.append(str(row.failures or 0))
        if diagnosed:
            cells.append(" ".join(row.diagnosis or []))
        table.add_row(*cells)
    piped = not sys.stdout.isatty()
    console = Console(soft_wrap=piped, width=PIPED_WIDTH if piped else None)
    console.print(table)
    for point in s.points:
        label = " ".join(f"{n}={v}" for n, v in zip(variables, _values(point), strict=False))
        for failure in point.failures or []:
            console.print(f"{label}: {failure}", highlight=False, markup=False)


def _cell(name: str, metric: Spread) -> str:
    fmt = "{:.0f}" if name == "tokens_per_s" else "{:.2f}"
    cell = fmt.format(metric.mean)
    if metric.max != metric.min:
        cell += f" [{fmt.format(metric.min)}-{fmt.format(metric.max)}]"
    return cell
