"""How many chunks one load-generating process of `cadence bench` keeps up with.

The source is `plain_grpc_reference.py --step-ms 0`: a grpc.aio server that sends one-token
chunks as fast as gRPC takes them, never merged, so the client is offered more chunks than it
can take and its receive rate is its capacity (unless the source is the slower of the two:
the source's own CPU is reported beside it). The lab's target: at least 30,000 chunks/s per
process, beyond which `cadence bench --procs N` spreads the load and the diagnosis says when
the client was saturated.

The same source is also driven as any gRPC service (`cadence bench --protocol grpc`: the
method's types from proto/cadence/v1/inference.proto, tokens from `token_ids`, positions from
`index`), beside the cadence path without timing in the same run: that path must keep within
1.2x of the cadence path's chunks/s (nothing parsed between arrivals there either).

    python benchmarks/client_capacity.py [--streams 64] [--tokens 2000] [--out results/client_capacity.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import psutil

from cadence.lab.load.cadence_v1 import CadenceTarget
from cadence.lab.load.grpc_schema import from_protos
from cadence.lab.load.grpc_service import GrpcTarget
from cadence.lab.load.plan import RequestShape
from cadence.lab.load.processes import ProcessPlan, run_load
from cadence.lab.servers.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
SOURCE = [sys.executable, str(Path(__file__).with_name("plain_grpc_reference.py"))]
TARGET_CHUNKS_PER_S = 30_000
GRPC_PATH_RATIO = 1.2
"""The any-service path's chunks/s within this factor of the cadence path's (no timing)."""


def any_service() -> GrpcTarget:
    """The source driven as a service cadence did not write: types from its .proto."""
    schema = from_protos(
        ["cadence/v1/inference.proto"], [str(ROOT / "proto")], "cadence.v1.Inference/Generate"
    )
    return GrpcTarget(
        schema=schema,
        tokens_field="token_ids",
        index_field="index",
        request_json='{"prompt_token_ids": [1, 2, 3], "max_tokens": "{max_tokens}"}',
    )


def measure(
    target: str,
    source_pid: int,
    streams: int,
    tokens: int,
    rounds: int,
    include_timing: bool,
    procs: int,
    grpc: GrpcTarget | None = None,
) -> dict:
    plans = [
        ProcessPlan(
            process=k,
            processes=procs,
            target=target,
            shape=RequestShape(max_tokens=(tokens, tokens)),
            requests=streams * rounds,
            concurrency=streams // procs,
            include_timing=include_timing,
            warmup=4,
            protocol=grpc or CadenceTarget(),
        )
        for k in range(procs)
    ]
    source = psutil.Process(source_pid)
    started = time.monotonic()
    cpu0 = sum(source.cpu_times()[:2])
    results = run_load(plans)
    source_cpu = sum(source.cpu_times()[:2]) - cpu0
    elapsed = time.monotonic() - started
    chunks = sum(len(r.arrival_ns) for p in results for r in p.records)
    lost = sum(r.max_tokens - r.output_tokens for p in results for r in p.records)
    errors = sum(r.code != "OK" for p in results for r in p.records)
    wall = max(p.wall_s for p in results)
    per_proc = [
        {
            "process": p.process,
            "chunks_per_s": round(sum(len(r.arrival_ns) for r in p.records) / p.wall_s),
            "cpu_us_per_chunk": round(
                p.cpu_s / max(1, sum(len(r.arrival_ns) for r in p.records)) * 1e6, 1
            ),
            "cpu_share": round(p.cpu_s / p.wall_s, 2),
        }
        for p in results
    ]
    return {
        "protocol": "cadence" if grpc is None else "grpc",
        "procs": procs,
        "streams": streams,
        "tokens_per_stream": tokens,
        "include_timing": include_timing,
        "chunks": chunks,
        "errors": errors,
        "tokens_missing": lost,
        "chunks_per_s": round(chunks / wall),
        "per_process": per_proc,
        # The source's CPU spans the processes' start-up too, so it is a bound from above.
        "source_cpu_share": round(source_cpu / elapsed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=2000, help="chunks per stream")
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream")
    parser.add_argument("--procs", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--pairs",
        type=int,
        default=3,
        help="alternating runs of the cadence path and the any-service path",
    )
    parser.add_argument("--out", default="results/client_capacity.json")
    args = parser.parse_args()
    rows = []
    grpc = any_service()
    # The two untimed paths alternate, --pairs times, so that a busy moment of a shared host
    # does not fall on one of them only; the ratio is taken from their medians.
    runs = [(True, None)] + [(False, None), (False, grpc)] * args.pairs
    with ServerProcess("--step-ms", "0", command=SOURCE) as source:
        for procs in args.procs:
            for timing, target in runs:
                row = measure(
                    source.target,
                    source.pid,
                    args.streams,
                    args.tokens,
                    args.rounds,
                    timing,
                    procs,
                    target,
                )
                rows.append(row)
                p0 = row["per_process"][0]
                print(
                    f"procs {procs} {row['protocol']:7} timing {'on ' if timing else 'off'}: "
                    f"{row['chunks_per_s']:,} chunks/s; process 0 {p0['chunks_per_s']:,} "
                    f"chunks/s at {p0['cpu_us_per_chunk']} us CPU/chunk "
                    f"({p0['cpu_share']:.0%} of a core); source {row['source_cpu_share']:.0%} "
                    f"of a core; errors {row['errors']}, tokens missing {row['tokens_missing']}",
                    flush=True,
                )
    one = [r for r in rows if r["procs"] == 1]
    untimed = {
        protocol: statistics.median(
            r["per_process"][0]["chunks_per_s"]
            for r in one
            if not r["include_timing"] and r["protocol"] == protocol
        )
        for protocol in ("cadence", "grpc")
    }
    ratio = untimed["cadence"] / untimed["grpc"]
    result = {
        "machine": {"cpus": psutil.cpu_count(), "load_before": psutil.getloadavg()},
        "target_chunks_per_s_per_process": TARGET_CHUNKS_PER_S,
        "met": bool(one)
        and all(
            r["per_process"][0]["chunks_per_s"] >= TARGET_CHUNKS_PER_S
            for r in one
            if r["protocol"] == "cadence"
        ),
        "untimed_median_chunks_per_s": untimed,
        "grpc_path_slowdown": ratio,
        "grpc_path_met": ratio is not None and ratio <= GRPC_PATH_RATIO,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(
        f"target {TARGET_CHUNKS_PER_S:,} chunks/s per process met: {result['met']}; "
        f"any-service path {ratio:.2f}x slower than the cadence path (target <= "
        f"{GRPC_PATH_RATIO}x): {result['grpc_path_met']}; {args.out}"
    )


if __name__ == "__main__":
    main()
