"""What tracing costs the front: `cadence serve --otlp-traces-endpoint` against the same server
without it, in ABBA rounds of one sitting (off, on, on, off, ...).

    python benchmarks/tracing_overhead.py [--rounds 2] [--out results/tracing_overhead.json]

Each run starts a fresh `cadence serve --devices cpu:2 --step-ms 20` and sends W1 of
serving_overhead.py (256 streams x 128 tokens at once, twice over); with tracing on, the
server exports to an OTLP receiver in this process (the lab's, standing in for a collector),
with the SDK's default batching. Reported per run: the front's CPU per chunk (psutil, the
front process alone), TTFT p99, ITL p99, and with tracing on the spans received. Target:
front CPU per chunk with tracing at most 1.05x without.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import psutil

from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.measure.trace_receiver import TraceReceiver
from cadence.lab.servers.server_process import ServerProcess

STREAMS, TOKENS, WAVES = 256, 128, 2


def one_run(traced: bool, receiver: TraceReceiver) -> dict:
    args = ["--devices", "cpu:2", "--step-ms", "20"]
    if traced:
        args += ["--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.port}"]
    before_spans = len(receiver.spans())
    with ServerProcess(*args) as server:
        front = psutil.Process(server.pid)
        cpu0 = sum(front.cpu_times()[:2])
        workload = Workload(
            requests=STREAMS * WAVES,
            concurrency=STREAMS,
            shape=RequestShape(max_tokens=(TOKENS, TOKENS)),
        )
        result = run_bench(server.target, workload, processes=2)
        cpu_s = sum(front.cpu_times()[:2]) - cpu0
    if traced:  # the last batch leaves at the server's stop
        receiver.wait_for({r.trace_id for r in result.records}, timeout_s=15)
    return {
        "tracing": traced,
        "requests_ok": result.requests_ok,
        "chunks": result.chunks,
        "front_cpu_s": round(cpu_s, 3),
        "front_cpu_per_chunk_us": round(cpu_s / result.chunks * 1e6, 2),
        "ttft_p99_ms": round(result.ttft_ms.p99, 1),
        "itl_p99_ms": round(result.itl_ms.p99, 2),
        "spans_received": len(receiver.spans()) - before_spans,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds (4 runs each)")
    parser.add_argument("--out", default="results/tracing_overhead.json")
    args = parser.parse_args()
    receiver = TraceReceiver(0)
    receiver.start()
    runs = []
    try:
        for _ in range(args.rounds):
            for traced in (False, True, True, False):
                run = one_run(traced, receiver)
                runs.append(run)
                print(json.dumps(run), flush=True)
    finally:
        receiver.stop()
    off = [r["front_cpu_per_chunk_us"] for r in runs if not r["tracing"]]
    on = [r["front_cpu_per_chunk_us"] for r in runs if r["tracing"]]
    ratio = statistics.median(on) / statistics.median(off)
    out = {
        "command": "python benchmarks/tracing_overhead.py " + " ".join(sys.argv[1:]),
        "host": {
            "cpus": psutil.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.node(),
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workload": {
            "streams": STREAMS,
            "max_tokens": TOKENS,
            "waves": WAVES,
            "step_ms": 20,
            "workers": 2,
        },
        "runs": runs,
        "front_cpu_per_chunk_us": {
            "off_median": statistics.median(off),
            "on_median": statistics.median(on),
        },
        "ratio_on_off": round(ratio, 3),
        "target_ratio": 1.05,
        "met": ratio <= 1.05,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"front CPU per chunk: off {statistics.median(off):.1f} µs, on "
        f"{statistics.median(on):.1f} µs (x{ratio:.3f}; target <= 1.05)"
    )


if __name__ == "__main__":
    main()
