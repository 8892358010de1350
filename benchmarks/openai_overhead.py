"""Issue 18's benchmark: W1 and W2 of serving_overhead.py over SSE (cadence's --http-port),
beside the same over gRPC (cadence.v1) and beside a bare SSE reference (sse_reference.py:
aiohttp with no cadence code, all streams woken at one instant per step), in one run.

Per server: front CPU per chunk, ITL p99, token delay p99 (step end -> client), TTFT p99.
Targets: cadence over SSE within 1.3x of the bare reference on token delay p99 and on ITL p99
overhead (ITL p99 - step), and at most half of cadence over gRPC's, same run.

    flock /tmp/cadence-bench.lock python benchmarks/openai_overhead.py \
        [--out results/openai_overhead.json] [--only W1] [--procs 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path

import msgspec
import psutil
from serving_overhead import WORKLOADS, _cpu_s

from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.cadence_v1 import CADENCE
from cadence.lab.load.openai_http import OpenAITarget
from cadence.lab.load.plan import RequestShape
from cadence.lab.servers.server_process import ServerProcess

_REFERENCE = Path(__file__).with_name("sse_reference.py")
SERVERS = ("grpc", "sse", "sse-reference")


def run(name: str, server_kind: str, procs: int) -> dict:
    spec = WORKLOADS[name]
    if server_kind == "sse-reference":
        args, command = ("--step-ms", str(spec["step_ms"])), [sys.executable, str(_REFERENCE)]
    else:
        command = None
        args = (
            "--devices",
            "cpu:2",
            "--step-ms",
            str(spec["step_ms"]),
            "--max-concurrent",
            str(max(1024, spec["streams"])),
            "--max-batch",
            "1024",
        )
        if server_kind == "sse":
            args += ("--http-port", "0")
    with ServerProcess(*args, command=command) as server:
        openai = None
        if server_kind != "grpc":
            host, port = re.search(r"\(http on (\S+):(\d+)\)", server.banner).groups()
            openai = OpenAITarget(f"http://{host}:{port}", "cadence")
        before = _cpu_s(server.pid)
        workload = Workload(
            requests=spec["streams"],
            concurrency=spec["streams"],
            warmup=2,
            shape=RequestShape(max_tokens=(spec["max_tokens"],) * 2),
        )
        result = msgspec.to_builtins(
            run_bench(server.target, workload, processes=procs, protocol=openai or CADENCE)
        )
        after = _cpu_s(server.pid)
    front_cpu = after["front"] - before["front"]
    row = {
        "requests_ok": result["requests_ok"],
        "errors_by_code": result["errors_by_code"],
        "chunks": result["chunks"],
        "chunk_tokens_mean": result["chunk_tokens"]["mean"],
        "front_cpu_s": front_cpu,
        "front_cpu_per_chunk_us": front_cpu / result["chunks"] * 1e6 if result["chunks"] else None,
        "itl_p99_ms": result["itl_ms"]["p99"],
        "itl_p99_overhead_ms": result["itl_ms"]["p99"] - spec["step_ms"],
        "token_delay_p99_ms": result.get("token_delay_ms", {}).get("p99"),
        "ttft_p99_ms": result["ttft_ms"]["p99"],
        "wall_s": result["wall_s"],
        "integrity": result["integrity"],
        "client_cpu_per_chunk_us": result["client"]["cpu_per_chunk_us"],
        "server_args": [*(["sse_reference.py"] if command else []), *args],
    }
    return row


def targets(rows: dict) -> dict:
    """cadence over SSE against the bare reference (1.3x) and against cadence over gRPC
    (0.5x) on token delay p99 and ITL p99 overhead."""
    sse, ref, grpc = rows["sse"], rows["sse-reference"], rows["grpc"]
    out = {}
    for key in ("token_delay_p99_ms", "itl_p99_overhead_ms"):
        out[key] = {
            "sse": sse[key],
            "sse_reference": ref[key],
            "grpc": grpc[key],
            "within_1.3x_of_reference": sse[key] <= 1.3 * max(ref[key], 0.0) if ref[key] else None,
            "at_most_half_of_grpc": sse[key] <= 0.5 * grpc[key],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/openai_overhead.json")
    parser.add_argument("--only", action="append", choices=("W1", "W2"))
    parser.add_argument("--procs", type=int, default=2)
    args = parser.parse_args()
    results = {
        "command": " ".join(["python", "benchmarks/openai_overhead.py", *sys.argv[1:]]),
        "machine": {
            "cpus": psutil.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "workloads": {},
    }
    for name in args.only or ("W1", "W2"):
        rows = {kind: run(name, kind, args.procs) for kind in SERVERS}
        results["workloads"][name] = {"servers": rows, "targets": targets(rows)}
        for kind, r in rows.items():
            print(
                f"{name} {kind:13s} front {r['front_cpu_per_chunk_us']:6.1f} us/chunk  "
                f"ITL p99 {r['itl_p99_ms']:6.2f}  token delay p99 "
                f"{r['token_delay_p99_ms'] or float('nan'):6.2f}  TTFT p99 "
                f"{r['ttft_p99_ms']:6.1f} ms  tokens/chunk {r['chunk_tokens_mean']:.2f}  "
                f"ok {r['requests_ok']} {r['errors_by_code'] or ''}",
                flush=True,
            )
        print(f"{name} targets {json.dumps(results['workloads'][name]['targets'])}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():  # the run history stays in the file, newest first
        previous = json.loads(out.read_text())
        results["previous_runs"] = [
            {k: v for k, v in previous.items() if k != "previous_runs"},
            *previous.get("previous_runs", []),
        ]
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
