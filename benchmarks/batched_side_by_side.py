"""One batched step function served seven ways, side by side in one sitting, each driven by
`cadence bench` over the protocol the server speaks:

    flock /work/bench.lock python benchmarks/batched_side_by_side.py \\
        [--streams 16 64 256] [--max-tokens 64] [--rounds 2] [--open-s 6] \\
        [--venvs /work/venvs] [--out results/batched_side_by_side.json]

The function is benchmarks/batched_step.py's (numpy, one BLAS thread, a fixed cost plus a
cost per sequence per step). Servers, one at a time, one worker / replica / instance each:

| row | server | protocol |
|---|---|---|
| cadence step | `cadence serve --engine benchmarks.batched_step:StepModel` | cadence.v1 gRPC |
| cadence step (OpenAI) | the same server | OpenAI /v1/completions SSE |
| cadence generate_stream | `--engine benchmarks.batched_step:GeneratorModel --batch-timeout-ms 10` | cadence.v1 |
| cadence --app | `--app benchmarks.batched_step:per_request` (one request per generator) | cadence.v1 |
| LitServe | batching + streaming behind its OpenAISpec (benchmarks/batched_peers.py) | OpenAI /v1/chat/completions SSE |
| Ray Serve | `@serve.batch` async generator, FastAPI ingress (batched_peers.py) | OpenAI /v1/completions SSE |
| PyTriton | `@batch` generator, decoupled, dynamic batcher (batched_peers.py) | KServe gRPC ModelStreamInfer |

Each server gets closed-loop cells (`streams` streams at once, `rounds` requests each, after
2 warm-up requests) and then one open-loop cell: Poisson arrivals at 70% of the best
closed-loop tokens/s it reached, for `open-s` seconds. Every server may batch up to 256
sequences (LitServe, Ray Serve and PyTriton gather for 10 ms, as the generator shape does).
`cadence --app` serves one sequence per step, so its cells are smaller (16 tokens, one
request per stream, no 256 streams: the executor's one thread would take minutes). The limit
is the function alone in a loop (batched_step.step_loop), measured at the start and the end.
The cadence step server runs first and again last, so the table shows the sitting's drift.

Peers run from their own venvs under --venvs: litserve/, rayserve/, and peers/pytriton311/
(../shared/peers/setup.sh with PEERS_DIR); one that is missing or fails to start is skipped
and the result says why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_cell import bench, free_port, wait_http

ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
OPEN_LOAD = 0.7
APP_TOKENS = 16


def _env() -> dict:
    path = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")]
    return dict(os.environ, **ONE_THREAD, PYTHONPATH=os.pathsep.join(filter(None, path)))


@contextlib.contextmanager
def _process(
    command: list[str], ready_url: str, env: dict | None = None, ready_timeout: float = 120.0
):
    """A server in its own process group (its children too); stopped with SIGINT, then
    SIGTERM, then SIGKILL of the whole group."""
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env or _env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(ready_url, process, ready_timeout)
        yield process
    finally:
        _stop_group(process)


def _stop_group(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            process.poll()  # reaps the leader, so that only live members answer below
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
    process.wait()


@contextlib.contextmanager
def cadence(*args: str):
    http = free_port()
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "cadence.cli",
        "serve",
        *args,
        "--devices",
        "cpu:1",
        "--max-batch",
        "256",
        "--port",
        str(port),
        "--http-port",
        str(http),
        "--served-model-name",
        "m",
        "--log-level",
        "WARNING",
    ]
    with _process(command, f"http://127.0.0.1:{http}/health"):
        yield {
            "cadence": f"127.0.0.1:{port}",
            "openai": f"http://127.0.0.1:{http}",
            "pid": None,
            "server": "cadence serve " + " ".join(args),
        }


@contextlib.contextmanager
def peer(name: str, venvs: Path):
    """A peer of batched_peers.py from its venv."""
    python = {
        "litserve": venvs / "litserve" / "bin" / "python",
        "rayserve": venvs / "rayserve" / "bin" / "python",
        "pytriton": venvs / "peers" / "pytriton311" / "bin" / "python",
    }[name]
    if not python.exists():
        raise RuntimeError(f"no venv: {python} is missing")
    port = free_port()
    command = [
        str(python),
        str(ROOT / "benchmarks" / "batched_peers.py"),
        name,
        "--port",
        str(port),
        "--max-batch",
        "256",
    ]
    env = dict(os.environ, **ONE_THREAD)
    env.pop("PYTHONPATH", None)
    if name == "pytriton":
        http = free_port()
        command += ["--http-port", str(http), "--metrics-port", str(free_port())]
        # The wheel's Python backend stub links libpython: pyenv's, not the system's.
        libdir = subprocess.run(
            [str(python), "-c", ("import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, env.get("LD_LIBRARY_PATH")]))
        ready = f"http://127.0.0.1:{http}/v2/models/batched/ready"
        target = {"kserve": f"127.0.0.1:{port}"}
    elif name == "litserve":
        ready = f"http://127.0.0.1:{port}/health"
        target = {"openai": f"http://127.0.0.1:{port}"}
    else:
        ready = f"http://127.0.0.1:{port}/-/healthz"
        target = {"openai": f"http://127.0.0.1:{port}"}
    with _process(command, ready, env, ready_timeout=180):
        if name == "rayserve":  # the proxy answers before the app is deployed
            _wait_rayserve(target["openai"])
        yield {
            **target,
            "pid": None,
            "server": f"batched_peers.py {name} ({_version(python, name)})",
        }


def _wait_rayserve(base: str, timeout: float = 120.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    body = json.dumps({"prompt": "x", "max_tokens": 1, "stream": True}).encode()
    while True:
        try:
            request = urllib.request.Request(
                base + "/v1/completions", body, {"content-type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=10) as reply:
                if reply.status == 200:
                    reply.read()
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("Ray Serve's app never answered")
        time.sleep(0.5)


def _version(python: Path, name: str) -> str:
    package = {"litserve": "litserve", "rayserve": "ray", "pytriton": "nvidia-pytriton"}[name]
    return subprocess.run(
        [
            str(python),
            "-c",
            (f"from importlib.metadata import version; print('{package}', version('{package}'))"),
        ],
        check=False,
        capture_output=True,
        text=True,
    ).stdout.strip()


def limit(batches: list[int], steps: int = 100) -> list[dict]:
    """The function alone in a loop, in a fresh process with one BLAS thread."""
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); "
        "from batched_step import step_loop; "
        f"print(json.dumps([step_loop(b, {steps}) for b in {batches!r}]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [
        {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
        for r in json.loads(out)
    ]


def cells(
    name: str, target: dict, protocol: str, streams: list[int], args, tmp: Path, pid: int | None
) -> list[dict]:
    """Closed loop at each stream count, then open loop at 70% of the best tokens/s."""
    model = {"cadence": "m", "openai": "m", "kserve": "batched"}[protocol]
    extra: tuple[str, ...] = ()
    if name == "LitServe":
        extra = ("--endpoint", "chat")
    if protocol == "kserve":
        extra = ("--kserve-inputs", "N=max_tokens:batched")
    app = name == "cadence --app"
    tokens = APP_TOKENS if app else args.max_tokens
    rounds = 1 if app else args.rounds
    rows = []
    for s in streams:
        if app and s > 64:
            continue
        print(f"{name}: {s} streams ...", file=sys.stderr, flush=True)
        rows.append(
            bench(
                target[protocol],
                protocol,
                model,
                tmp / "bench.json",
                streams=s,
                requests=s * rounds,
                max_tokens=tokens,
                server_pid=pid,
                extra=extra,
            )
        )
    best = max((r["tokens_per_s"] for r in rows if r["requests_ok"]), default=0)
    if best and args.open_s > 0:
        rate = OPEN_LOAD * best / tokens
        print(f"{name}: open loop at {rate:.1f} requests/s ...", file=sys.stderr, flush=True)
        rows.append(
            bench(
                target[protocol],
                protocol,
                model,
                tmp / "bench.json",
                rate=rate,
                requests=max(10, int(rate * args.open_s)),
                max_tokens=tokens,
                server_pid=pid,
                extra=extra,
            )
        )
    for r in rows:
        r.update(server=name, max_tokens=tokens)
    return rows


def table(result: dict) -> str:
    """The result as markdown: one line per cell, then the issue's targets as ratios."""
    lines = [
        (
            "| server | loop | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p99 (ms) | "
            "chunk gap p99 (ms) | front CPU µs/token | server CPU µs/token | requests OK |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        loop = (
            f"closed {r['streams']}"
            if r["loop"] == "closed"
            else f"open {r['rate_per_s']:.0f} req/s"
        )
        lines.append(
            f"| {r['server']} | {loop} | {r['tokens_per_s']:,.0f} | {_f(r['ttft_p50_ms'])} | "
            f"{_f(r['ttft_p99_ms'])} | {_f(r['itl_p99_ms'])} | {_f(r.get('chunk_gap_p99_ms'))} | "
            f"{_f(r['front_cpu_us_per_token'])} | {_f(r['server_cpu_us_per_token'])} | "
            f"{r['requests_ok']}/{r['requests']} |"
        )
    return "\n".join(lines)


STEP_ROWS = (
    ("cadence step", "start"),
    ("cadence step (OpenAI)", "start"),
    ("cadence step, again", "end"),
)
"""The step API's runs (first and last of the sitting, and the first one's server over
OpenAI), each with the loop measured next to it: each target is given for all."""


def targets(result: dict) -> list[str]:
    """Each of the issue's targets with the measured figures and their ratio, for each of the
    step API's two runs (the sitting's spread)."""

    def cell(server: str, streams: int | None = None) -> dict | None:
        loop = "closed" if streams else "open"
        return next(
            (
                r
                for r in result["rows"]
                if r["server"] == server
                and r["loop"] == loop
                and (streams is None or r["streams"] == streams)
            ),
            None,
        )

    limits = {when: {r["batch"]: r for r in result["limit"][when]} for when in ("start", "end")}
    out = []
    for name, when in STEP_ROWS:
        limit = limits[when]
        for n in (64, 256):
            step = cell(name, n)
            if step and n in limit:
                loop = limit[n]["tokens_per_s"]
                out.append(
                    f"{name}, {n} streams: {step['tokens_per_s']:,.0f} tokens/s against "
                    f"the function's own loop {loop:,.0f} (measured at the sitting's "
                    f"{when}): {step['tokens_per_s'] / loop:.2f}x (target >= 0.9)"
                )
        open_ = cell(name)
        if open_ and 1 in limit:
            for n in (64, 256):
                bound = limit[1]["step_ms"] + 2 * limit[n]["step_ms"]
                out.append(
                    f"{name}, open loop at 70%: TTFT p99 {open_['ttft_p99_ms']:.1f} ms "
                    f"against prefill + 2 steps at batch {n} = {bound:.1f} ms: "
                    f"{open_['ttft_p99_ms'] / bound:.2f}x (target <= 1)"
                )
                bound = limit[n]["step_ms"] + 5
                out.append(
                    f"{name}, open loop at 70%: ITL p99 {open_['itl_p99_ms']:.1f} ms "
                    f"against a step at batch {n} + 5 ms = {bound:.1f} ms: "
                    f"{open_['itl_p99_ms'] / bound:.2f}x (target <= 1)"
                )
    steps = [c for c in (cell(name, 64) for name, _ in STEP_ROWS) if c]
    for other in ("cadence --app", "cadence generate_stream", "LitServe", "Ray Serve", "PyTriton"):
        peer = cell(other, 64)
        if peer is None or not steps:
            continue
        tokens = sorted(s["tokens_per_s"] / peer["tokens_per_s"] for s in steps)
        ttft = sorted(s["ttft_p99_ms"] / peer["ttft_p99_ms"] for s in steps)
        out.append(
            f"64 streams, step API / {other}: tokens/s {tokens[0]:.2f}-{tokens[-1]:.2f}x"
            + (" (target >= 3)" if other == "cadence --app" else " (target > 1)")
            + f", TTFT p99 {ttft[0]:.2f}-{ttft[-1]:.2f}x (target < 1; "
            f"{other} {peer['ttft_p99_ms']:,.1f} ms)"
        )
    return out


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream")
    parser.add_argument(
        "--open-s",
        type=float,
        default=6.0,
        help="open loop: seconds' worth of requests (0: no open loop)",
    )
    parser.add_argument(
        "--limit-steps",
        type=int,
        default=100,
        help="steps of the function alone, at each batch size",
    )
    parser.add_argument("--venvs", default="/work/venvs")
    parser.add_argument("--only", nargs="*", default=None, help="run only these rows")
    parser.add_argument("--out", default="results/batched_side_by_side.json")
    parser.add_argument("--table", metavar="JSON", help="print a result as markdown; run nothing")
    args = parser.parse_args()
    if args.table:
        result = json.loads(Path(args.table).read_text())
        print(table(result))
        print("\n".join(f"- {line}" for line in targets(result)))
        return
    venvs = Path(args.venvs)
    batches = sorted(set(args.streams) | {1})
    step = ("--engine", "benchmarks.batched_step:StepModel")
    runs = [
        ("cadence step", lambda: cadence(*step), ("cadence", "openai")),
        (
            "cadence generate_stream",
            lambda: cadence(
                "--engine", "benchmarks.batched_step:GeneratorModel", "--batch-timeout-ms", "10"
            ),
            ("cadence",),
        ),
        (
            "cadence --app",
            lambda: cadence("--app", "benchmarks.batched_step:per_request"),
            ("cadence",),
        ),
        ("LitServe", lambda: peer("litserve", venvs), ("openai",)),
        ("Ray Serve", lambda: peer("rayserve", venvs), ("openai",)),
        ("PyTriton", lambda: peer("pytriton", venvs), ("kserve",)),
        ("cadence step, again", lambda: cadence(*step), ("cadence",)),
    ]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = os.getloadavg()
    limits = {"start": limit(batches, args.limit_steps)}
    rows, skipped, servers = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, start, protocols in runs:
            if args.only is not None and name not in args.only:
                continue
            try:
                with start() as target:
                    servers[name] = target["server"]
                    for protocol in protocols:
                        label = (
                            name
                            if protocol in ("cadence", "kserve") or name != "cadence step"
                            else f"{name} (OpenAI)"
                        )
                        for r in cells(
                            name, target, protocol, args.streams, args, Path(tmp), target["pid"]
                        ):
                            r.update(server=label, protocol=protocol)
                            print(
                                json.dumps(
                                    {
                                        k: r[k]
                                        for k in (
                                            "server",
                                            "loop",
                                            "streams",
                                            "rate_per_s",
                                            "tokens_per_s",
                                            "ttft_p99_ms",
                                            "itl_p99_ms",
                                            "front_cpu_us_per_token",
                                            "requests_ok",
                                            "requests",
                                        )
                                    }
                                ),
                                flush=True,
                            )
                            rows.append(r)
            except (RuntimeError, subprocess.CalledProcessError) as exc:
                skipped[name] = str(exc)
                print(f"{name} skipped: {exc}", file=sys.stderr, flush=True)
    limits["end"] = limit(batches, args.limit_steps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "command": "flock /work/bench.lock python " + " ".join(sys.argv),
                "started": started,
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "load_average_before": load_before,
                "load_average_after": os.getloadavg(),
                "python": platform.python_version(),
                "max_tokens": args.max_tokens,
                "rounds": args.rounds,
                "app_max_tokens": APP_TOKENS,
                "open_load": OPEN_LOAD,
                "open_s": args.open_s,
                "limit": limits,
                "servers": servers,
                "rows": rows,
                "skipped": skipped,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
