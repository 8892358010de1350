"""cadence and Ray Serve serving the same token function, driven by the same client.

    pip install "ray[serve]==2.60.0"      # Serve's own dependencies, beyond the .[ray] extra
    python benchmarks/ray_serve_peer.py [--streams 1 32 256] [--tokens 50] [--rounds 3]
        [--out results/ray_serve_peer.json]

The token function of the bring-your-own-model issue: N tokens (N = max_tokens), each after
`await asyncio.sleep(0.010)`, so the ideal is a first token at 10 ms, a gap of 10 ms and 100
tokens/s per stream.

- cadence: `cadence serve --app examples.token_app:async_tokens --devices cpu:1`.
- Ray Serve (`ray[serve]`, the version beside cadence's `.[ray]` extra): one replica of a
  deployment whose `Generate` is the same async generator, behind Serve's gRPC proxy, which
  serves cadence's own `cadence.v1.Inference` service (Serve takes a user's servicer
  function), with `max_ongoing_requests` raised to 1024 (Serve's default of 5 would queue
  every stream past the fifth; cadence runs with `--max-concurrent 1024`).

Both speak `cadence.v1.Inference/Generate`, so one client drives both: `cadence bench`'s load
generator in one process, closed loop, `streams` streams open at once, `rounds` x `streams`
requests after 2 warm-up requests, no server timestamps (Ray Serve has none to give).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import time
from pathlib import Path

import msgspec

from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.servers.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
DELAY_S = 0.010
SERVICER = "cadence.proto.v1.inference_pb2_grpc.add_InferenceServicer_to_server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(streams: int, tokens: int, rounds: int) -> Workload:
    return Workload(
        requests=streams * rounds,
        concurrency=streams,
        warmup=2,
        include_timing=False,
        shape=RequestShape(max_tokens=(tokens, tokens), prompt_tokens=(8, 8)),
    )


def row(server: str, streams: int, result: dict) -> dict:
    keep = {"ttft_ms": ("p50", "p99"), "itl_ms": ("p50", "p99"), "chunk_gap_ms": ("p50",)}
    out = {
        "server": server,
        "streams": streams,
        "tokens_per_s": round(result["tokens_per_s"], 1),
        "requests_ok": result["requests_ok"],
        "requests": result["requests"],
        "errors": result["errors_by_code"],
        "integrity": result["integrity"],
    }
    for metric, stats in keep.items():
        for stat in stats:
            out[f"{metric}_{stat}"] = round(result[metric][stat], 2)
    return out


def start_ray_serve(port: int):
    """A local Ray with Serve's gRPC proxy on `port` and one replica of the token deployment."""
    import ray
    from ray import serve

    from cadence.proto.v1 import inference_pb2 as pb

    @serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
    class Tokens:
        async def Generate(self, request: pb.GenerateRequest):
            last = request.max_tokens - 1
            for i in range(request.max_tokens):
                await asyncio.sleep(DELAY_S)
                yield pb.GenerateChunk(
                    request_id=request.request_id,
                    index=i,
                    token_ids=[i % 256],
                    text=chr(i % 95 + 32),
                    finish_reason=pb.FINISH_REASON_LENGTH if i == last else 0,
                )

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT / "src")}},
    )
    serve.start(
        http_options={"host": "127.0.0.1", "port": _free_port()},
        grpc_options={"port": port, "grpc_servicer_functions": [SERVICER]},
    )
    serve.run(Tokens.bind(), name="tokens")
    return ray, serve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--tokens", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results/ray_serve_peer.json")
    args = parser.parse_args()
    rows = []
    with ServerProcess(
        "--app", "examples.token_app:async_tokens", "--devices", "cpu:1", "--max-concurrent", "1024"
    ) as server:
        for streams in args.streams:
            result = msgspec.to_builtins(
                run_bench(server.target, workload(streams, args.tokens, args.rounds))
            )
            rows.append(row("cadence", streams, result))
            print(json.dumps(rows[-1]), flush=True)
    port = _free_port()
    started = time.monotonic()
    ray, serve = start_ray_serve(port)
    print(f"Ray Serve up in {time.monotonic() - started:.1f} s", flush=True)
    try:
        for streams in args.streams:
            result = msgspec.to_builtins(
                run_bench(f"127.0.0.1:{port}", workload(streams, args.tokens, args.rounds))
            )
            rows.append(row("ray serve", streams, result))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    import ray as ray_module

    out = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "ray": ray_module.__version__,
        },
        "tokens": args.tokens,
        "delay_ms": DELAY_S * 1e3,
        "rounds": args.rounds,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
