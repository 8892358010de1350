"""The same token function served by cadence (`--app`) and by PyTriton (decoupled), same load.

    python benchmarks/app_vs_pytriton.py [--streams 32 256] [--tokens 50] [--rounds 3]
        [--with-sync] [--skip-pytriton] [--out results/app_vs_pytriton.json]

The function: N tokens (N = 50), each after a 10 ms sleep (`await asyncio.sleep` on both
sides: cadence's examples/token_app.py:async_tokens, PyTriton's `--mode async` model in
../shared/peers/pytriton_stream_server.py). Ideal: first token 10 ms, gap 10 ms.

The load: one client process (asyncio on uvloop, one gRPC channel), `streams` streams open
at once, closed loop, `rounds` x `streams` requests, 2 warm-up requests first. cadence is
driven by its own load generator (lab.bench.run_bench); PyTriton by
benchmarks/triton_stream_load.py (tritonclient's asyncio client, in the peer's venv), whose
raw records go through the same lab.stats.summarize, so TTFT, ITL and tokens/s have one
definition. PyTriton comes from ../shared/peers/setup.sh (PEERS_DIR, default /tmp/peers);
without it, only cadence runs and the report says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import msgspec
from peers import pytriton_server  # benchmarks/ is on sys.path when run as a script

from cadence.lab.analysis.stats import summarize
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.records import RequestRecord
from cadence.lab.servers.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
DELAY_MS = 10
WARMUP = 2


def _metrics(result: dict, client_cpu_share: float | None) -> dict:
    """The numbers this benchmark compares, from a lab.stats summary."""
    return {
        "ttft_p50_ms": result["ttft_ms"]["p50"],
        "ttft_p99_ms": result["ttft_ms"]["p99"],
        "itl_p50_ms": result["itl_ms"]["p50"],
        "itl_p99_ms": result["itl_ms"]["p99"],
        "chunk_gap_p50_ms": result["chunk_gap_ms"]["p50"],
        "tokens_per_s": result["tokens_per_s"],
        "requests_ok": result["requests_ok"],
        "requests": result["requests"],
        "integrity": result["integrity"],
        "client_cpu_share": client_cpu_share,
    }


def run_cadence(streams: int, tokens: int, rounds: int, app: str, threads: int) -> dict:
    env_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.environ["PYTHONPATH"] = env_path  # the worker imports examples.token_app
    args = (
        "--app",
        app,
        "--devices",
        "cpu:1",
        "--engine-threads",
        str(threads),
        "--max-concurrent",
        str(max(1024, streams)),
    )
    with ServerProcess(*args) as server:
        workload = Workload(
            requests=streams * rounds,
            concurrency=streams,
            warmup=WARMUP,
            include_timing=False,
            shape=RequestShape(prompt_tokens=(8, 8), max_tokens=(tokens, tokens)),
        )
        result = msgspec.to_builtins(run_bench(server.target, workload, processes=1))
    result.pop("records")
    out = _metrics(result, result["client"]["busiest_process_cpu_share"])
    out["server_args"] = list(args)
    out["server_cpu_pct"] = {
        name: p["cpu_pct_mean"] for name, p in result["system"].get("processes", {}).items()
    }
    return out


def run_pytriton(streams: int, tokens: int, rounds: int, peers: Path) -> dict:
    with pytriton_server(peers) as target:
        load = subprocess.run(
            [
                str(peers / "pytriton311" / "bin" / "python"),
                str(ROOT / "benchmarks" / "triton_stream_load.py"),
                "--url",
                target,
                "--streams",
                str(streams),
                "--requests",
                str(streams * rounds),
                "--tokens",
                str(tokens),
                "--delay-ms",
                str(DELAY_MS),
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
    out = json.loads(load.stdout)
    records = [RequestRecord(**r) for r in out["records"]]
    return _metrics(msgspec.to_builtins(summarize(records)), out["cpu_s"] / out["wall_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--tokens", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3, help="requests per stream")
    parser.add_argument(
        "--with-sync",
        action="store_true",
        help="also serve the blocking variant (time.sleep) with one executor thread per stream",
    )
    parser.add_argument("--skip-pytriton", action="store_true")
    parser.add_argument("--peers", default=os.environ.get("PEERS_DIR", "/tmp/peers"))
    parser.add_argument("--out", default="results/app_vs_pytriton.json")
    args = parser.parse_args()
    peers = Path(args.peers)
    have_pytriton = (peers / "pytriton311" / "bin" / "python").exists() and not args.skip_pytriton
    rows = []
    for streams in args.streams:
        runs = [
            (
                "cadence async",
                run_cadence,
                (streams, args.tokens, args.rounds, "examples.token_app:async_tokens", 1),
            )
        ]
        if args.with_sync:  # the blocking variant, one executor thread per stream
            runs.append(
                (
                    "cadence sync",
                    run_cadence,
                    (streams, args.tokens, args.rounds, "examples.token_app:sync_tokens", streams),
                )
            )
        if have_pytriton:
            runs.append(
                ("pytriton async", run_pytriton, (streams, args.tokens, args.rounds, peers))
            )
        for name, run, run_args in runs:
            print(f"{name}, {streams} streams ...", file=sys.stderr, flush=True)
            rows.append({"server": name, "streams": streams, **run(*run_args)})
    print(
        f"{'server':16} {'streams':>7} {'ttft p50':>9} {'ttft p99':>9} {'itl p50':>8} "
        f"{'itl p99':>8} {'tokens/s':>9} {'ok':>9} {'client cpu':>10}"
    )
    for r in rows:
        print(
            f"{r['server']:16} {r['streams']:>7} {r['ttft_p50_ms']:>9.2f} {r['ttft_p99_ms']:>9.2f} "
            f"{r['itl_p50_ms']:>8.2f} {r['itl_p99_ms']:>8.2f} {r['tokens_per_s']:>9.0f} "
            f"{r['requests_ok']:>4}/{r['requests']:<4} {r['client_cpu_share']:>9.0%}"
        )
    if not have_pytriton:
        print(f"PyTriton not measured: no {peers}/pytriton311 (run ../shared/peers/setup.sh)")
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "tokens": args.tokens,
        "delay_ms": DELAY_MS,
        "rounds": args.rounds,
        "pytriton": have_pytriton,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
