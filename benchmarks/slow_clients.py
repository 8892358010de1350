"""1,000 streams that read one chunk a second, beside normal streams: the front's memory stays
bounded and the normal streams keep their inter-token latency (reliability issue, point 3).

One server (`--devices cpu:2 --step-ms 20`, default `--overflow merge`) and two runs of the
same normal workload (64 streams x 128 tokens, `cadence bench`'s load generator): first alone,
then while 1,000 slow streams (another load process, `--read-delay-ms 1000`, long requests)
are open. The front's RSS is sampled throughout. Target: normal ITL p99 within 10% of the run
without the slow streams; RSS flat while the slow streams run.

    python benchmarks/slow_clients.py [--out results/slow_clients.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import threading
import time
from pathlib import Path

import msgspec
import psutil

from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.servers.server_process import ServerProcess

SLOW = 1000
NORMAL = Workload(
    requests=512, concurrency=64, warmup=16, shape=RequestShape(max_tokens=(128, 128))
)


def _slow_streams(
    target: str, seconds: float, opened: multiprocessing.Event, default_window: bool = False
) -> None:
    """SLOW streams that read one chunk a second for `seconds`, in this process."""
    import asyncio

    import grpc

    from cadence.client import build_request
    from cadence.proto.v1 import inference_pb2_grpc as pb_grpc

    async def main() -> None:
        # A small receive window (1 KiB per stream, no BDP growth) makes these clients slow
        # at the transport, as a slow link is: with gRPC's default window (64 KiB and
        # growing) a client that reads one chunk a second still takes in every token as its
        # own message for the first ~30 s, and the front sends 50,000 messages a second.
        options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
        if default_window:
            options = []
        channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(8)]
        calls = [
            pb_grpc.InferenceStub(channels[i % 8]).Generate(
                build_request(f"slow {i}", max_tokens=16000), timeout=seconds + 60
            )
            for i in range(SLOW)
        ]
        await asyncio.gather(*(call.read() for call in calls))  # every stream is open
        opened.set()
        end = time.monotonic() + seconds

        async def read_slowly(call, phase: float) -> None:
            # Each stream reads at its own phase: 1,000 reads a second, not one burst.
            await asyncio.sleep(phase)
            while time.monotonic() < end:
                await call.read()
                await asyncio.sleep(1.0)

        await asyncio.gather(*(read_slowly(call, i / SLOW) for i, call in enumerate(calls)))
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()

    asyncio.run(main())


class RssSampler(threading.Thread):
    """The front's resident memory, every 0.5 s."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.samples: list[tuple[float, float]] = []
        self.stopped = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stopped.wait(0.5):
            self.samples.append(
                (time.monotonic() - self.t0, self.process.memory_info().rss / 2**20)
            )


def _itl(result: dict) -> dict:
    return {k: result["itl_ms"][k] for k in ("p50", "p90", "p99", "max")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/slow_clients.json")
    parser.add_argument(
        "--default-window",
        action="store_true",
        help="slow clients with gRPC's default receive window",
    )
    args = parser.parse_args()
    with ServerProcess(
        "--devices", "cpu:2", "--step-ms", "20", "--max-batch", "2048", "--max-concurrent", "2048"
    ) as server:
        rss = RssSampler(server.pid)
        rss.start()
        alone = msgspec.to_builtins(run_bench(server.target, NORMAL))
        rss_before = rss.samples[-1][1]
        opened = multiprocessing.Event()
        slow = multiprocessing.Process(
            target=_slow_streams, args=(server.target, 60.0, opened, args.default_window)
        )
        slow.start()
        if not opened.wait(60):
            raise SystemExit("the slow streams did not open")
        time.sleep(5)  # their buffers fill and start merging
        rss_slow_start = rss.samples[-1][1]
        beside = msgspec.to_builtins(run_bench(server.target, NORMAL))
        time.sleep(10)
        rss_slow_end = rss.samples[-1][1]
        slow.join(120)
        rss.stopped.set()
    ratio = beside["itl_ms"]["p99"] / alone["itl_ms"]["p99"]
    out = {
        "server": "--devices cpu:2 --step-ms 20 --overflow merge (default) --queue-capacity 64",
        "normal_workload": "512 requests, concurrency 64, 128 tokens",
        "slow_streams": f"{SLOW} streams reading one chunk per second, receive window "
        + ("gRPC's default" if args.default_window else "1 KiB per stream"),
        "alone": {
            "itl_ms": _itl(alone),
            "ttft_p99_ms": alone["ttft_ms"]["p99"],
            "integrity": alone["integrity"],
            "errors": alone["errors_by_code"],
        },
        "beside_slow": {
            "itl_ms": _itl(beside),
            "ttft_p99_ms": beside["ttft_ms"]["p99"],
            "integrity": beside["integrity"],
            "errors": beside["errors_by_code"],
        },
        "itl_p99_ratio": ratio,
        "target_met": ratio <= 1.10,
        "front_rss_mib": {
            "before_slow": rss_before,
            "slow_open": rss_slow_start,
            "slow_open_15s_later": rss_slow_end,
            "max": max(m for _, m in rss.samples),
        },
        "rss_samples": rss.samples,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(
        f"ITL p99 alone {alone['itl_ms']['p99']:.2f} ms, beside {SLOW} slow streams "
        f"{beside['itl_ms']['p99']:.2f} ms (x{ratio:.3f}; target <= 1.10: "
        f"{'met' if ratio <= 1.10 else 'NOT met'})"
    )
    print(
        f"front RSS: {rss_before:.1f} MiB before, {rss_slow_start:.1f} with the slow streams "
        f"open, {rss_slow_end:.1f} 15 s later; max {out['front_rss_mib']['max']:.1f}"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
