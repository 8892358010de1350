"""The `cadence bench` command line."""

from __future__ import annotations

import argparse
import json
import sys


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure a running server: TTFT, ITL, tails, segments")
    p.add_argument("--target", required=True, help="HOST:PORT of the server")
    p.add_argument("--concurrency", type=int, default=64, help="streams open at once (closed loop)")
    p.add_argument("--requests", type=int, default=None, help="requests in all (default: --concurrency)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0, help="requests per process sent first, not counted")
    p.add_argument("--timeout", type=float, default=None, help="per-request deadline (s)")
    p.add_argument("--procs", type=int, default=1, help="load-generating processes")
    p.add_argument("--channels", type=int, default=1, help="gRPC connections per process")
    p.add_argument("--read-delay-ms", type=float, default=0.0,
                   help="pause after each chunk, to play a slow-reading client")
    p.add_argument("--no-timing", action="store_true", help="do not ask for server timestamps")
    p.add_argument("--json", dest="json_path", default=None, help="write every aggregate and raw record here")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> None:
    from cadence.lab.bench import Workload, print_summary, run_bench

    workload = Workload(
        requests=args.requests or args.concurrency,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        prompt_tokens=args.prompt_tokens,
        seed=args.seed,
        include_timing=not args.no_timing,
        timeout_s=args.timeout,
        warmup=args.warmup,
        read_delay_ms=args.read_delay_ms,
    )
    try:
        result = run_bench(args.target, workload, processes=args.procs, channels=args.channels)
    except RuntimeError as exc:
        sys.exit(f"cadence bench: {exc}")
    print_summary(result)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f)
