"""The lab's false alarms, measured: healthy servers benched many times, every rule that fires
counted, and how often each verdict said unhealthy.

    python benchmarks/false_alarms.py [--runs 20] [--quick] [--only NAME ...]
        [--protocols grpc sse] [--lengths short long] [--hosts quiet loaded]
        [--venvs /work/venvs] [--out results/false_alarms.json] [--keep DIR]
    python benchmarks/false_alarms.py --reread DIR ... --out FILE

Every server here is healthy: it streams each request at its engine's pace, with no planted
fault, well inside the host's CPU. So every alarm of `cadence bench` (a finding of its result
JSON's `diagnosis` whose `severity` is `alarm`) on a quiet host is a false alarm, and so is a
verdict other than healthy. A finding of severity `information` (a light load, a CPU engine's
worker filling its core) is true of a healthy server: it is counted apart, never as an alarm.

| server | how it runs | protocols |
|---|---|---|
| `synthetic wW S ms` | `cadence serve --devices cpu:W --step-ms S --jitter-ms S/10`, W = 1, 2, 4, S = 2, 5, 20 | gRPC, SSE |
| `transformers wW` | `cadence serve --engine transformers --devices cpu:W`, W = 1, 2, the tiny random Qwen3 of examples/transformers_model.py (built here from its seed) | gRPC, SSE |
| `batched model` | `cadence serve --engine benchmarks.batched_step:StepModel` (a user's numpy step, one BLAS thread) | gRPC, SSE |
| `LitServe` | benchmarks/litserve_tokens.py: async streaming, a token every 10 ms, from `--venvs`/litserve | SSE (chat) |

gRPC is cadence.v1 (`--protocol cadence`, with server timing), SSE is OpenAI's
/v1/completions (`--protocol openai`; LitServe's /v1/chat/completions). Each cell (server x
protocol x output length x host) is one `cadence bench` per run: 16 streams at once (fewer
where 16 would make over 3,200 tokens/s, which fills this 2-core host: 6 for 2 ms steps),
closed loop, 16-token prompts, outputs of 16 tokens (short) or 128 (long), as many rounds of
requests as fill about 2 s (1 to 8, 16 requests at least), 2 warm-up requests. Each server starts once, gets one
bench that is not counted (a real engine's first requests after its start are a start), then every
cell's runs in turn, round after round, so that a slow minute of the host spreads over the
cells (a synthetic engine has no start to warm: its first run counts). On the loaded host a known job shares the machine: one process spinning on the first
core the benchmark may use, started before the run and stopped after it; there the target is
that the lab puts the tail on the host (the verdict healthy, or every bad tail explained by
`host_contended`, nothing failed, the output whole).

`--keep DIR` keeps every run's result JSON there (`DIR/SERVER_PROTOCOL_LENGTH_HOST_RUN.json`),
the evidence behind each count: `cadence report` reads it. `--reread DIR ...` benches nothing:
it reads those runs again with the rules of the day (their diagnosis and verdict made anew from
the same records and measurements) and counts them as a measured matrix does.

`--quick` is the CI subset: synthetic 5 ms steps, 1 and 2 workers, gRPC and SSE, short
outputs, quiet host (tests/integration/test_false_alarms.py). The table prints per rule the
runs it fired in (all cells, and the worst cell) and per host the verdicts; the JSON holds
every run's verdict and findings. A run on the "quiet" host where the lab found other work
filling the host (`host_contended`) is counted, and also set apart: the repeated false alarms
(`summary.repeated_false_alarms`: a rule, or a verdict other than healthy, in more than one
run of a cell) are read from the quiet host's runs without it, the CI test's criterion.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
from msgspec import UNSET

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_cell import free_port, stop_group, wait_http

STREAMS = 16
HOST_TOKENS_PER_S = 3200
"""...but no more streams than make this many tokens/s at the server's step: the server, the
client and the lab share two cores here, and a run that fills them is not a healthy one."""
PROMPT_TOKENS = 16
LENGTHS = {"short": 16, "long": 128}
RUN_S = 2.0
"""A run's planned length: rounds of STREAMS requests until about this long (1 to 8)."""
MAX_ROUNDS = 8
MIN_REQUESTS = 16
"""The verdict judges TTFT's tail over 16 requests or more (`verdict.MIN_FIRST_OUTPUTS`)."""
TARGET_RATE = 1 / 20
"""A rule may fire on a healthy server in at most 1 run in 20 (issue 52)."""
HOST_RULE = "host_contended"
QUICK = ("synthetic w1 5 ms", "synthetic w2 5 ms")

BURN = "import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
"""The loaded host's known job: one process spinning on one core."""

ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Targets:
    """Where a started server answers: its gRPC target and OpenAI base URL (either may be
    empty), the model name its SSE endpoint wants and which endpoint."""

    grpc: str
    sse: str
    model: str = "m"
    endpoint: str = "completions"


@dataclass(frozen=True)
class Server:
    name: str
    step_ms: float
    """The step (or gap) it streams at, to size a run."""
    start: Callable[[], contextlib.AbstractContextManager[Targets]]
    protocols: tuple[str, ...] = ("grpc", "sse")
    warm: bool = True
    """Gets one bench, not counted, after its start: a real engine's first requests are a
    start (its first calls, allocations), which the lab rightly names."""

    @property
    def streams(self) -> int:
        return max(4, min(STREAMS, int(HOST_TOKENS_PER_S * self.step_ms / 1000)))


def _env() -> dict[str, str]:
    path = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))


@contextlib.contextmanager
def _process(command: list[str], ready_url: str, env: dict | None = None) -> Iterator[None]:
    process = subprocess.Popen(
        command,
        env=env or _env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_http(ready_url, process, 180.0)
        yield
    finally:
        # The process group is the server's alone (its workers, LitServe's children).
        stop_group(process)


@contextlib.contextmanager
def cadence(*args: str) -> Iterator[Targets]:
    """`cadence serve ARGS` with gRPC and OpenAI's HTTP API, from this checkout."""
    port, http = free_port(), free_port()
    command = [sys.executable, "-m", "cadence.cli", "serve", "--port", str(port)]
    command += ["--http-port", str(http), "--served-model-name", "m", "--log-level", "WARNING"]
    with _process([*command, *args], f"http://127.0.0.1:{http}/health", {**_env(), **ONE_THREAD}):
        yield Targets(grpc=f"127.0.0.1:{port}", sse=f"http://127.0.0.1:{http}")


@contextlib.contextmanager
def litserve(venvs: Path) -> Iterator[Targets]:
    python = venvs / "litserve" / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"no venv: {python} is missing")
    port = free_port()
    command = [str(python), str(ROOT / "benchmarks" / "litserve_tokens.py"), "--port", str(port)]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    with _process(command, f"http://127.0.0.1:{port}/health", env):
        yield Targets(grpc="", sse=f"http://127.0.0.1:{port}", endpoint="chat")


_MODEL_DIR: Path | None = None


def _tiny_model() -> Path:
    """examples/transformers_model.py's tiny Qwen3, built once per benchmark from its seed."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        folder = Path(tempfile.mkdtemp(prefix="false-alarms-qwen3-"))
        subprocess.run(
            [sys.executable, "examples/transformers_model.py", str(folder)],
            cwd=ROOT,
            env=_env(),
            check=True,
            capture_output=True,
        )
        _MODEL_DIR = folder
    return _MODEL_DIR


def servers(venvs: Path) -> list[Server]:
    found = [
        Server(
            f"synthetic w{workers} {step:g} ms",
            step,
            lambda w=workers, s=step: cadence(
                "--devices", f"cpu:{w}", "--step-ms", f"{s:g}", "--jitter-ms", f"{s / 10:g}"
            ),
            warm=False,
        )
        for workers in (1, 2, 4)
        for step in (2.0, 5.0, 20.0)
    ]
    found += [
        Server(
            f"transformers w{workers}",
            5.0,
            lambda w=workers: cadence(
                "--engine", "transformers", "--model", str(_tiny_model()), "--devices", f"cpu:{w}"
            ),
        )
        for workers in (1, 2)
    ]
    found.append(
        Server(
            "batched model", 3.0, lambda: cadence("--engine", "benchmarks.batched_step:StepModel")
        )
    )
    found.append(Server("LitServe", 10.0, lambda: litserve(venvs), protocols=("sse",)))
    return found


@contextlib.contextmanager
def host(kind: str) -> Iterator[None]:
    """The host of a run: as it is (quiet), or loaded by one process spinning on one core."""
    if kind == "quiet":
        yield
        return
    cpu = min(os.sched_getaffinity(0))
    burner = subprocess.Popen([sys.executable, "-c", BURN.format(cpu=cpu)])
    time.sleep(0.3)  # running, and seen by the lab's samples, before the first request
    try:
        yield
    finally:
        burner.kill()
        burner.wait()


def bench(
    targets: Targets, protocol: str, tokens: int, server: Server, out: Path, in_process: bool
) -> dict:
    """One `cadence bench`; its result JSON (or {"error": ...} when it wrote none). In a
    process of its own, as a user runs it, or `in_process` (the CI test: no interpreter to
    start and no lab to import per run; the same command line through `cadence.cli.main`)."""
    rounds = max(1, min(MAX_ROUNDS, round(RUN_S * 1000 / (tokens * server.step_ms))))
    streams = server.streams
    command = ["bench"]
    if protocol == "grpc":
        command += ["--target", targets.grpc]
    else:
        command += ["--target", targets.sse, "--protocol", "openai", "--model", targets.model]
        command += ["--endpoint", targets.endpoint]
    command += [
        "--concurrency",
        str(streams),
        "--requests",
        str(max(streams * rounds, MIN_REQUESTS)),
        "--max-tokens",
        str(tokens),
        "--prompt-tokens",
        str(PROMPT_TOKENS),
        "--warmup",
        "2",
        "--no-progress",
        "--json",
        str(out),
    ]
    out.unlink(missing_ok=True)
    if in_process:
        from cadence.cli import main as cadence_main

        said = io.StringIO()
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            try:
                cadence_main(command)
            except SystemExit as e:  # the CLI's exit status: a run that failed says why
                said.write(f"exit {e.code}")
        why = said.getvalue()
    else:
        done = subprocess.run(
            [sys.executable, "-m", "cadence.cli", *command],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        why = done.stderr or done.stdout or f"exit {done.returncode}"
    if not out.exists():
        return {"error": why.strip()[-400:]}
    result = json.loads(out.read_text())
    result["_command"] = "cadence " + " ".join(command[:-2])
    return result


def run_record(result: dict) -> dict:
    """What the matrix keeps of one run: its verdict, the rules that raised an alarm and
    those that gave information (with their sentences), whether the tails were put on the
    host, and the key figures. Information (a light load, a CPU engine's worker filling its
    core) is true of a healthy server: it is kept apart and is no false alarm."""
    if "error" in result:
        return {"verdict": "error", "rules": [], "information": [], "error": result["error"]}
    verdict = result["verdict"]
    findings = result["diagnosis"]
    rules = sorted({f["rule"] for f in findings if f.get("severity", "alarm") == "alarm"})
    information = sorted({f["rule"] for f in findings} - set(rules))
    bad = [t for t in verdict["tails"] if t["state"] == "bad"]
    on_host = verdict["state"] == "healthy" or (
        not verdict["problems"] and all(_on_host(t) for t in bad)
    )
    record = {
        "verdict": verdict["state"],
        "rules": rules,
        "information": information,
        "tails_on_host": on_host,
        "itl_p50_ms": _ms(result["itl_ms"].get("p50")),
        "itl_p99_ms": _ms(result["itl_ms"].get("p99")),
        "ttft_p99_ms": _ms(result["ttft_ms"].get("p99")),
        "wall_s": round(result["wall_s"], 2),
        "wakeup_p99_ms": _ms(
            ((result["system"].get("host") or {}).get("wakeups") or {}).get("p99")
        ),
    }
    if verdict["state"] != "healthy":
        record["verdict_line"] = verdict["line"]
        record["bad_tails"] = [
            {k: t.get(k) for k in ("metric", "explained_by", "unexplained_share")} for t in bad
        ]
    if findings:
        record["findings"] = {f["rule"]: f["finding"][:300] for f in findings}
    return record


def _fired(records: list[dict], key: str) -> dict[str, int]:
    """How many of `records` each rule of `key` ("rules": alarms, "information") came in."""
    return dict(collections.Counter(x for r in records for x in r.get(key, [])))


def _on_host(tail: dict) -> bool:
    """A bad tail the verdict puts on the host: `host_contended` among its causes with a
    share (or one it leaves unsaid), and no quarter of it left unexplained."""
    share = tail["explained_by"].get(HOST_RULE, 0.0)
    unexplained = tail.get("unexplained_share")
    return (share is None or share > 0) and (unexplained is None or unexplained < 0.25)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def cells(server: Server, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    return [
        (protocol, length, kind)
        for kind in args.hosts
        for protocol in server.protocols
        if protocol in args.protocols
        for length in args.lengths
    ]


def measure(server: Server, args: argparse.Namespace, tmp: Path) -> list[dict]:
    """Every run of one server's cells, round after round; its records."""
    todo = cells(server, args)
    records: list[dict] = []
    with server.start() as targets:
        if server.warm:
            bench(targets, todo[0][0], LENGTHS["short"], server, tmp / "warm.json", args.in_process)
        for run in range(args.runs):
            for protocol, length, kind in todo:
                with host(kind):
                    result = bench(
                        targets,
                        protocol,
                        LENGTHS[length],
                        server,
                        tmp / "run.json",
                        args.in_process,
                    )
                if args.keep:
                    _keep(
                        tmp / "run.json", Path(args.keep), server.name, protocol, length, kind, run
                    )
                record = {
                    "server": server.name,
                    "protocol": protocol,
                    "length": length,
                    "host": kind,
                    "run": run,
                    **run_record(result),
                }
                if run == 0:
                    record["command"] = result.get("_command")
                records.append(record)
                print(
                    f"{server.name:<20} {protocol:<4} {length:<5} {kind:<6} run {run + 1:>2}: "
                    f"{record['verdict']:<12} {' '.join(record['rules'])}"
                    + (
                        f" (information: {' '.join(record['information'])})"
                        if record.get("information")
                        else ""
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    return records


def reread(folders: list[Path]) -> list[dict]:
    """Every run kept in `folders` (--keep) read again with the rules of the day: its
    diagnosis and verdict made anew from the same records and measurements
    (`cadence.lab.bench.judged`), its record as `measure` makes it."""
    from cadence.lab.bench import judged
    from cadence.lab.report.run import decode_result

    records = []
    for path in sorted(p for folder in folders for p in folder.glob("*.json")):
        server, protocol, length, kind, run = path.stem.rsplit("_", 4)
        result, _ = decode_result(json.loads(path.read_text()))
        result.diagnosis, result.verdict = [], UNSET
        kept = json.loads(msgspec.json.encode(judged(result)))
        records.append(
            {
                "server": server.replace("-", " "),
                "protocol": protocol,
                "length": length,
                "host": kind,
                "run": int(run),
                **run_record(kept),
            }
        )
    return records


def _keep(
    run: Path, folder: Path, server: str, protocol: str, length: str, kind: str, number: int
) -> None:
    """A copy of one run's result JSON in `folder` (--keep), named by its cell and run."""
    if not run.exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    name = "_".join((server.replace(" ", "-"), protocol, length, kind, str(number)))
    (folder / f"{name}.json").write_bytes(run.read_bytes())


def summarize(records: list[dict]) -> dict:
    """Per rule: the runs it fired in, per host, overall and in the worst cell; per host the
    verdicts. On the quiet host also without the runs where the lab found the host busy
    after all (`host_contended`): those runs' findings may be the host's."""
    by_cell: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in records:
        by_cell[(r["server"], r["protocol"], r["length"], r["host"])].append(r)
    rules = sorted({rule for r in records for rule in r["rules"]})
    table: dict[str, dict] = {}
    for rule in rules:
        row: dict = {}
        for kind in ("quiet", "loaded"):
            runs = [r for r in records if r["host"] == kind]
            if not runs:
                continue
            worst = max(
                (
                    (sum(rule in r["rules"] for r in rs), len(rs), " / ".join(cell[:3]))
                    for cell, rs in by_cell.items()
                    if cell[3] == kind
                ),
                key=lambda w: w[0] / w[1],
            )
            row[kind] = {
                "fired": sum(rule in r["rules"] for r in runs),
                "runs": len(runs),
                "worst_cell": worst[2],
                "worst_cell_fired": worst[0],
                "worst_cell_runs": worst[1],
            }
            if kind == "quiet":
                calm = [r for r in runs if HOST_RULE not in r["rules"]]
                row[kind]["fired_uncontended"] = sum(rule in r["rules"] for r in calm)
                row[kind]["runs_uncontended"] = len(calm)
        table[rule] = row
    verdicts: dict[str, dict] = {}
    for kind in ("quiet", "loaded"):
        runs = [r for r in records if r["host"] == kind]
        if not runs:
            continue
        counts = collections.Counter(r["verdict"] for r in runs)
        cell_healthy = [
            (sum(r["verdict"] == "healthy" for r in rs), len(rs), " / ".join(cell[:3]))
            for cell, rs in by_cell.items()
            if cell[3] == kind
        ]
        worst = min(cell_healthy, key=lambda w: w[0] / w[1])
        verdicts[kind] = {
            "runs": len(runs),
            **{state: counts.get(state, 0) for state in ("healthy", "unhealthy", "inconclusive")},
            "errors": counts.get("error", 0),
            "tails_on_host": sum(bool(r.get("tails_on_host")) for r in runs),
            "host_contended": sum(HOST_RULE in r["rules"] for r in runs),
            "worst_cell": worst[2],
            "worst_cell_healthy": worst[0],
            "worst_cell_runs": worst[1],
        }
    repeats = {}
    for cell, rs in by_cell.items():
        calm = [r for r in rs if HOST_RULE not in r["rules"]]
        if cell[3] != "quiet":
            continue
        fired = collections.Counter(x for r in calm for x in r["rules"])
        fired["verdict not healthy"] = sum(r["verdict"] != "healthy" for r in calm)
        repeats[" / ".join(cell)] = sorted(rule for rule, n in fired.items() if n > 1)
    information: dict[str, dict] = {}
    for kind in ("quiet", "loaded"):
        runs = [r for r in records if r["host"] == kind]
        for rule, n in sorted(_fired(runs, "information").items()):
            information.setdefault(rule, {})[kind] = {"fired": n, "runs": len(runs)}
    return {
        "rules": table,
        "information": information,
        "verdicts": verdicts,
        "repeated_false_alarms": {cell: rules for cell, rules in repeats.items() if rules},
        "quiet_cells_all_contended": sorted(
            " / ".join(cell)
            for cell, rs in by_cell.items()
            if cell[3] == "quiet" and all(HOST_RULE in r["rules"] for r in rs)
        ),
    }


def markdown(result: dict) -> str:
    """The tables of docs/lab.md: per rule, the runs it fired in; per host, the verdicts."""
    summary = result["summary"]
    lines = [
        "| rule | quiet host: runs fired | worst cell | loaded host: runs fired |",
        "|---|---|---|---|",
    ]
    for rule, row in summary["rules"].items():
        quiet, loaded = row.get("quiet"), row.get("loaded")
        lines.append(
            f"| `{rule}` | "
            + (f"{quiet['fired']} / {quiet['runs']}" if quiet else "-")
            + " | "
            + (
                f"{quiet['worst_cell_fired']} / {quiet['worst_cell_runs']} ({quiet['worst_cell']})"
                if quiet
                else "-"
            )
            + " | "
            + (f"{loaded['fired']} / {loaded['runs']}" if loaded else "-")
            + " |"
        )
    if not summary["rules"]:
        lines.append("| (none fired) | | | |")
    if summary.get("information"):
        said = [
            f"`{rule}` "
            + ", ".join(f"{v['fired']} / {v['runs']} {kind}" for kind, v in row.items())
            for rule, row in summary["information"].items()
        ]
        lines += ["", "Information (true of a healthy server, no alarm): " + "; ".join(said) + "."]
    lines += [
        "",
        "| host | runs | healthy | unhealthy | inconclusive | tails on the host | "
        "`host_contended` | worst cell (healthy) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, v in summary["verdicts"].items():
        lines.append(
            f"| {kind} | {v['runs']} | {v['healthy']} | {v['unhealthy']} | {v['inconclusive']} | "
            f"{v['tails_on_host']} | {v['host_contended']} | "
            f"{v['worst_cell_healthy']} / {v['worst_cell_runs']} ({v['worst_cell']}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each cell")
    parser.add_argument("--quick", action="store_true", help="the CI subset (see above)")
    parser.add_argument("--only", nargs="+", default=[], help="servers whose names hold these")
    parser.add_argument("--protocols", nargs="+", default=["grpc", "sse"], choices=["grpc", "sse"])
    parser.add_argument("--lengths", nargs="+", default=list(LENGTHS), choices=list(LENGTHS))
    parser.add_argument("--hosts", nargs="+", default=["quiet", "loaded"])
    parser.add_argument("--venvs", default="/work/venvs", help="LitServe's venv: VENVS/litserve")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="each bench through cadence.cli.main in this process (the CI test), not a new one",
    )
    parser.add_argument("--out", default="results/false_alarms.json")
    parser.add_argument(
        "--keep", default="", help="a folder to keep every run's result JSON in (its evidence)"
    )
    parser.add_argument(
        "--reread",
        nargs="+",
        default=[],
        metavar="DIR",
        help="bench nothing: read the runs kept in these folders (--keep) again with the "
        "rules of the day, and count as a measured matrix does",
    )
    args = parser.parse_args(argv)
    chosen = servers(Path(args.venvs))
    if args.quick:
        chosen = [s for s in chosen if s.name in QUICK]
        args.lengths, args.hosts = ["short"], ["quiet"]
    if args.only:
        chosen = [s for s in chosen if any(o in s.name for o in args.only)]
    planned = 0 if args.reread else sum(len(cells(s, args)) for s in chosen) * args.runs
    print(
        f"{len(chosen)} servers, {planned} runs (about {planned * 5 / 60:.0f} min)",
        file=sys.stderr,
        flush=True,
    )
    started = time.monotonic()
    records: list[dict] = reread([Path(d) for d in args.reread]) if args.reread else []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for server in [] if args.reread else chosen:
            try:
                records += measure(server, args, Path(tmp))
            except RuntimeError as e:
                skipped[server.name] = str(e)
                print(f"{server.name}: skipped: {e}", file=sys.stderr, flush=True)
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_at_end": os.getloadavg(),
        },
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/false_alarms.py " + " ".join(argv or sys.argv[1:]),
        "runs_per_cell": args.runs,
        "streams": STREAMS,
        "lengths": {name: LENGTHS[name] for name in args.lengths},
        "hosts": args.hosts,
        "took_s": round(time.monotonic() - started),
        "skipped": skipped,
        "summary": summarize(records),
        "records": records,
    }
    print(markdown(result))
    if skipped:
        print("skipped: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(
        f"`{result['command']}`, {result['date']}, {platform.node()} "
        f"({os.cpu_count()} CPUs), {result['took_s']} s\n\n" + markdown(result)
    )
    return result


if __name__ == "__main__":
    main()
