"""Serving overhead of the streaming core: workloads W1-W3 of the streaming-core issue.

Each workload starts a fresh `cadence serve` (synthetic engine, two CPU workers) and drives
it with `cadence bench`'s load generator in separate processes, then checks the targets.

    python benchmarks/serving_overhead.py [--out results/serving_overhead.json] [--only W1]
    python benchmarks/serving_overhead.py --fronts 1 2      # W2 and W3 with 1, then 2 fronts
    python benchmarks/serving_overhead.py --burst 3 --out results/serving_overhead_w1_burst.json

Targets (2 cores, client on the same machine):
  W1  --step-ms 20, 256 streams x 128 tokens together: chunk gap - 20 ms p99 <= 2 ms,
      token delay (step end -> client) p99 <= 5 ms, TTFT p99 <= 100 ms.
  W2  the same with 1024 streams: wall time <= 1.15 x ideal, token delay p99 <= 40 ms.
  W3  --step-ms 0, 512 streams: >= 150,000 tokens/s delivered.
  --burst N: N pairs of W1 on cadence and on the plain grpc.aio reference, in ABBA order,
      the synthetic engine given the reference's timing (a 20 ms step, no prefill cost):
      cadence's TTFT p99 <= the reference's + one step, front CPU per chunk <= 1.05x.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import psutil

from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.servers.server_process import ServerProcess

_REFERENCE = Path(__file__).with_name("plain_grpc_reference.py")

WORKLOADS = {
    "W1": {"step_ms": 20.0, "streams": 256, "max_tokens": 128},
    "W2": {"step_ms": 20.0, "streams": 1024, "max_tokens": 128},
    "W3": {"step_ms": 0.0, "streams": 512, "max_tokens": 512},
}


def _cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of the front and of each of its workers so far (with --fronts N, the
    other fronts are `front1`...)."""
    front = psutil.Process(pid)
    out = {"front": sum(front.cpu_times()[:2])}
    workers = 0
    for child in front.children():
        cmdline = child.cmdline()
        if "cadence.lifecycle.front_child" in cmdline:
            out[f"front{cmdline[cmdline.index('cadence.lifecycle.front_child') + 1]}"] = sum(
                child.cpu_times()[:2]
            )
        else:
            out[f"worker{workers}"] = sum(child.cpu_times()[:2])
            workers += 1
    return out


def _chunks_per_front(banner: str) -> dict[str, float]:
    """`cadence_chunks_total` of each front, from the one metrics endpoint."""
    match = re.search(r"metrics on (\S+):(\d+)", banner)
    if not match:
        return {}
    with urllib.request.urlopen(
        f"http://{match.group(1)}:{match.group(2)}/metrics", timeout=10
    ) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'cadence_chunks_total(?:\{front="(\d+)"\})? (\S+)', line)
        if m:
            out["front" if m.group(1) in (None, "0") else f"front{m.group(1)}"] = float(m.group(2))
    return out


_FRONTS_CHANNELS = 8
"""gRPC connections per load process in the --fronts runs (1 and N fronts alike)."""


def run_fronts(name: str, fronts: int, procs: int) -> dict:
    """W2 or W3 with `--fronts N`: each front's CPU per chunk it sent, and the client's."""
    spec = WORKLOADS[name]
    args = (
        "--devices",
        "cpu:2",
        "--step-ms",
        str(spec["step_ms"]),
        "--fronts",
        str(fronts),
        "--max-concurrent",
        str(max(1024, spec["streams"])),
        "--max-batch",
        "1024",
        "--metrics-port",
        "0",
    )
    with ServerProcess(*args) as server:
        before = _cpu_s(server.pid)
        chunks_before = _chunks_per_front(server.banner)
        workload = Workload(
            requests=spec["streams"],
            concurrency=spec["streams"],
            warmup=2,
            shape=RequestShape(max_tokens=(spec["max_tokens"],) * 2),
        )
        # Several connections per load process: the kernel spreads connections, not
        # streams, over the fronts (with one or two, all may land on one front).
        result = msgspec.to_builtins(
            run_bench(server.target, workload, processes=procs, channels=_FRONTS_CHANNELS)
        )
        after = _cpu_s(server.pid)
        chunks = _chunks_per_front(server.banner)
    result.pop("records")
    result["server_cpu_s"] = {k: after[k] - before.get(k, 0.0) for k in after}
    result["server_args"] = list(args)
    chunks = {k: v - chunks_before.get(k, 0.0) for k, v in chunks.items()}
    result["front_chunks"] = chunks
    result["front_cpu_per_chunk_us"] = {
        k: result["server_cpu_s"][k] / chunks[k] * 1e6 for k in chunks if chunks[k]
    }
    result["targets"] = check_targets(name, spec, result)
    return result


_AS_REFERENCE = ("--prefill-ms-per-token", "0")
"""The synthetic engine's timing made the reference's: a step of --step-ms, nothing for the
prompt (the reference sleeps one step before its first token, whatever the prompt)."""


def run_workload(name: str, procs: int, plain: bool = False, engine: tuple[str, ...] = ()) -> dict:
    """One workload on a fresh cadence server, or on the plain grpc.aio reference server."""
    spec = WORKLOADS[name]
    if plain:
        args, command = ("--step-ms", str(spec["step_ms"])), [sys.executable, str(_REFERENCE)]
    else:
        command = None
        args = (
            "--devices",
            "cpu:2",
            "--step-ms",
            str(spec["step_ms"]),
            *engine,
            "--max-concurrent",
            str(max(1024, spec["streams"])),
            "--max-batch",
            "1024",
        )
    with ServerProcess(*args, command=command) as server:
        before = _cpu_s(server.pid)
        workload = Workload(
            requests=spec["streams"],
            concurrency=spec["streams"],
            warmup=2,
            shape=RequestShape(max_tokens=(spec["max_tokens"],) * 2),
        )
        result = msgspec.to_builtins(run_bench(server.target, workload, processes=procs))
        after = _cpu_s(server.pid)
    result.pop("records")
    result["server_cpu_s"] = {k: after[k] - before.get(k, 0.0) for k in after}
    result["server_args"] = ["plain_grpc_reference.py", *args] if plain else list(args)
    result["targets"] = check_targets(name, spec, result, plain)
    return result


def check_targets(name: str, spec: dict, r: dict, plain: bool = False) -> dict:
    """Each target: the measured value, the bound, and whether it was met."""

    def target(value: float, bound: float, at_most: bool = True) -> dict:
        return {
            "measured": value,
            "bound": bound,
            "met": value <= bound if at_most else value >= bound,
        }

    if plain:
        return {
            "chunk_gap_minus_step_p99_ms": target(r["chunk_gap_ms"]["p99"] - spec["step_ms"], 2.0),
            "ttft_p99_ms": target(r["ttft_ms"]["p99"], 100.0),
        }
    if name == "W1":
        return {
            "chunk_gap_minus_step_p99_ms": target(r["chunk_gap_ms"]["p99"] - spec["step_ms"], 2.0),
            "token_delay_p99_ms": target(r["token_delay_ms"]["p99"], 5.0),
            "ttft_p99_ms": target(r["ttft_ms"]["p99"], 100.0),
        }
    if name == "W2":
        ideal_s = spec["max_tokens"] * spec["step_ms"] / 1e3
        return {
            "wall_over_ideal": target(r["e2e_ms"]["max"] / 1e3 / ideal_s, 1.15),
            "token_delay_p99_ms": target(r["token_delay_ms"]["p99"], 40.0),
        }
    return {"tokens_per_s": target(r["tokens_per_s"], 150_000, at_most=False)}


def front_cpu_per_chunk_us(r: dict) -> float:
    return r["server_cpu_s"]["front"] / r["chunks"] * 1e6


def run_burst(pairs: int, procs: int) -> list[dict]:
    """W1 on cadence (the engine timed as the reference) and on the reference, in ABBA order
    so that a drift of the host's load falls on both; each pair with its burst targets."""
    out = []
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        runs = {plain: run_workload("W1", procs, plain, engine=_AS_REFERENCE) for plain in order}
        cadence, reference = runs[False], runs[True]
        step_ms = WORKLOADS["W1"]["step_ms"]
        ttft, ref_ttft = cadence["ttft_ms"]["p99"], reference["ttft_ms"]["p99"]
        cpu, ref_cpu = front_cpu_per_chunk_us(cadence), front_cpu_per_chunk_us(reference)
        pair = {
            "order": ["reference" if plain else "cadence" for plain in order],
            "cadence": cadence,
            "reference": reference,
            "targets": {
                "ttft_p99_over_reference_ms": {
                    "measured": ttft - ref_ttft,
                    "bound": step_ms,
                    "met": ttft - ref_ttft <= step_ms,
                },
                "front_cpu_per_chunk_ratio": {
                    "measured": cpu / ref_cpu,
                    "bound": 1.05,
                    "met": cpu / ref_cpu <= 1.05,
                },
            },
        }
        print(
            f"pair {i + 1} ({' then '.join(pair['order'])}): TTFT p99 {ttft:.1f} ms vs reference "
            f"{ref_ttft:.1f} ms; front CPU per chunk {cpu:.1f} vs {ref_cpu:.1f} µs "
            f"({cpu / ref_cpu:.2f}x); lost tokens {cadence['integrity']['lost_tokens']}"
        )
        for key, t in pair["targets"].items():
            print(
                f"    {key}: {t['measured']:.2f} (target {t['bound']}) {'met' if t['met'] else 'NOT met'}"
            )
        out.append(pair)
    return out


def burst_summary(pairs: list[dict]) -> dict:
    """Each burst target's median over the pairs: one pair's CPU ratio moves by a tenth
    with the host's load, a median of several does not."""
    summary = {}
    for key, first in pairs[0]["targets"].items():
        median = statistics.median(p["targets"][key]["measured"] for p in pairs)
        summary[key] = {
            "median": median,
            "bound": first["bound"],
            "met": median <= first["bound"],
            "met_in_pairs": sum(p["targets"][key]["met"] for p in pairs),
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="results/serving_overhead.json")
    parser.add_argument("--only", action="append", choices=sorted(WORKLOADS))
    parser.add_argument("--procs", type=int, default=2, help="load-generating processes")
    parser.add_argument(
        "--plain",
        action="store_true",
        help="also run W1 against the plain grpc.aio reference server",
    )
    parser.add_argument(
        "--fronts",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="run W2 and W3 (or --only) once per number of fronts, e.g. 1 2",
    )
    parser.add_argument(
        "--burst",
        type=int,
        default=0,
        metavar="PAIRS",
        help="only the W1 burst beside the reference: PAIRS pairs in ABBA order",
    )
    args = parser.parse_args()
    results = {
        "machine": {
            "cpus": psutil.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "workloads": {},
    }
    if args.burst:
        results["command"] = " ".join(["python", *sys.argv])
        results["engine_as_reference"] = list(_AS_REFERENCE)
        results["pairs"] = run_burst(args.burst, args.procs)
        results["summary"] = burst_summary(results["pairs"])
        for key, t in results["summary"].items():
            print(
                f"median {key}: {t['median']:.2f} (target {t['bound']}) {'met' if t['met'] else 'NOT met'}, "
                f"met in {t['met_in_pairs']} of {len(results['pairs'])} pairs"
            )
        del results["workloads"]
    runs = [] if args.burst else [(name, False, None) for name in args.only or sorted(WORKLOADS)]
    if args.fronts:
        runs = [(name, False, n) for name in args.only or ("W2", "W3") for n in args.fronts]
    if args.plain:
        runs.append(("W1", True, None))
    for name, plain, fronts in runs:
        if fronts is not None:
            r = run_fronts(name, fronts, args.procs)
            name = f"{name}-fronts{fronts}"
        else:
            r = run_workload(name, args.procs, plain)
        name = f"{name}-plain-grpc" if plain else name
        results["workloads"][name] = r
        print(
            f"{name}: ttft p99 {r['ttft_ms']['p99']:.1f} ms, chunk gap p50/p99 "
            f"{r['chunk_gap_ms']['p50']:.2f}/{r['chunk_gap_ms']['p99']:.2f} ms, token delay p50/p99 "
            f"{r.get('token_delay_ms', {}).get('p50', float('nan')):.2f}/"
            f"{r.get('token_delay_ms', {}).get('p99', float('nan')):.2f} ms, "
            f"{r['tokens_per_s']:.0f} tokens/s, {r['chunk_tokens']['mean']:.2f} tokens/chunk, "
            f"wall {r['wall_s']:.2f} s, integrity {r['integrity']}, errors {r['errors_by_code']}"
        )
        print(
            f"    server CPU s {r['server_cpu_s']}, client {r['client']['cpu_per_chunk_us']:.0f} µs/chunk"
        )
        if "front_cpu_per_chunk_us" in r:
            print(
                f"    chunks per front {r['front_chunks']}, front CPU per chunk "
                f"{ {k: round(v, 1) for k, v in r['front_cpu_per_chunk_us'].items()} } µs"
            )
        for key, t in r["targets"].items():
            print(
                f"    {key}: {t['measured']:.2f} (target {t['bound']}) {'met' if t['met'] else 'NOT met'}"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
