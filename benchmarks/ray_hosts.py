"""Streams from a worker on another host versus a worker beside the front, in one run.

Two network namespaces are the hosts (tests/netns_hosts.py): the front and one worker in
`a`, the other worker in `b`, placed by `--launcher ray`; requests and tokens cross the veth
link over CURVE-encrypted ZeroMQ. One `cadence bench` run (synthetic engine, 20 ms step) is
split by the worker that served each request: token delay (step end -> client), the
worker -> front transfer segment, and ITL.

    sudo .venv/bin/python benchmarks/ray_hosts.py [--out results/ray_hosts.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from cadence.lab.analysis.stats import summarize
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.records import RequestRecord

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.netns_hosts import Front, TwoHosts, netns_unavailable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/ray_hosts.json")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args()
    reason = netns_unavailable()
    if reason:
        raise SystemExit(f"cannot emulate two hosts here: {reason}")
    logs = Path(tempfile.mkdtemp(prefix="cadence-ray-bench-"))
    hosts = TwoHosts()
    try:
        started = time.monotonic()
        hosts.open(logs)
        front = Front(
            hosts, logs / "front.log", "--devices", "cpu:2", "--step-ms", str(args.step_ms)
        )
        print(f"two hosts and a Ray front up in {time.monotonic() - started:.1f} s")
        placed = {
            int(w): address
            for w, address in re.findall(r"worker (\d) placed on (\S+)", front.log.read_text())
        }
        workload = Workload(
            requests=args.requests,
            concurrency=args.concurrency,
            warmup=16,
            shape=RequestShape(max_tokens=(args.max_tokens, args.max_tokens)),
        )
        result = msgspec.to_builtins(run_bench(front.target, workload))
        front.stop()
    finally:
        hosts.close()

    records = [msgspec.convert(r, RequestRecord) for r in result["records"]]
    groups = {}
    for worker, address in sorted(placed.items()):
        where = "local" if address == TwoHosts.HEAD else "remote"
        part = msgspec.to_builtins(summarize([r for r in records if r.worker == worker]))
        groups[where] = {
            "worker": worker,
            "node": address,
            "requests": part["requests_ok"],
            "token_delay_ms": part["token_delay_ms"],
            "transfer_ms": part["segments_ms"]["transfer"],
            "itl_ms": part["itl_ms"],
            "ttft_ms": part["ttft_ms"],
        }
    local, remote = groups["local"], groups["remote"]
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "workload": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "step_ms": args.step_ms,
            "devices": "cpu:2 (one worker per namespace)",
        },
        "integrity": result["integrity"],
        "errors_by_code": result["errors_by_code"],
        "tokens_per_s": result["tokens_per_s"],
        "by_worker": groups,
        "remote_minus_local_ms": {
            metric: {q: remote[metric][q] - local[metric][q] for q in ("p50", "p99", "mean")}
            for metric in ("token_delay_ms", "transfer_ms", "itl_ms", "ttft_ms")
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"{'':16}{'local p50':>10}{'p99':>8}{'remote p50':>12}{'p99':>8}")
    for metric in ("token_delay_ms", "transfer_ms", "itl_ms", "ttft_ms"):
        print(
            f"{metric:16}{local[metric]['p50']:10.2f}{local[metric]['p99']:8.2f}"
            f"{remote[metric]['p50']:12.2f}{remote[metric]['p99']:8.2f}"
        )
    print(f"integrity {result['integrity']}, errors {result['errors_by_code']}; wrote {args.out}")


if __name__ == "__main__":
    main()
