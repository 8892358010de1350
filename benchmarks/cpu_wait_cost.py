"""What measuring each step's wait for a CPU costs the worker (`cadence.worker.cpu_wait`): one
`CpuWait.since_last()` per engine step, timed over many calls, for as many watched threads as
a worker may have (its step thread, plus torch's intra-op pool on a larger host).

    python benchmarks/cpu_wait_cost.py [--calls 20000] [--threads 1 2 4 8 16] [--out OUT]

Each row: the median over `--repeats` rounds of the mean time of one call (ns), and that
per watched thread. The threads watched are idle ones started here (a thread's schedstat
reads the same whatever it does); the reading is one `pread` per thread of a file kept open.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time

from cadence.worker.cpu_wait import CpuWait


def cost_ns(threads: int, calls: int, repeats: int) -> float:
    """The median over `repeats` rounds of one `since_last()`'s mean time, watching the
    calling thread and `threads - 1` idle ones."""
    stop = threading.Event()
    idle = [threading.Thread(target=stop.wait) for _ in range(threads - 1)]
    for t in idle:
        t.start()
    try:
        waits = CpuWait([threading.get_native_id(), *(t.native_id or 0 for t in idle)])
        assert waits.threads == threads
        rounds = []
        for _ in range(repeats):
            start = time.perf_counter_ns()
            for _ in range(calls):
                waits.since_last()
            rounds.append((time.perf_counter_ns() - start) / calls)
        waits.close()
        return statistics.median(rounds)
    finally:
        stop.set()
        for t in idle:
            t.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--out", help="also write the rows here (JSON)")
    args = parser.parse_args()
    rows = []
    print(f"{'threads':>7}  {'ns/step':>8}  {'ns/thread':>9}")
    for n in args.threads:
        ns = cost_ns(n, args.calls, args.repeats)
        rows.append({"threads": n, "ns_per_step": round(ns), "ns_per_thread": round(ns / n)})
        print(f"{n:>7}  {ns:>8.0f}  {ns / n:>9.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"host": platform.node(), "python": platform.python_version(), "rows": rows}, f
            )


if __name__ == "__main__":
    main()
