"""New calls arriving while other streams keep the front busy: how fast the front takes them in.

One server (`--devices cpu:2 --step-ms 20`); two load processes each open half of a first wave
of streams (128 tokens), wait until those stream, then open half of a second wave. The second
wave's time to first token measures how fast the front accepts calls while the first wave's
tokens flow. Run once per `--accept-ahead` value (0: grpc.aio's own accept loop, which asks its
core for one call at a time; see cadence.net.call_acceptor).

    python benchmarks/accept_burst.py [--first 640] [--second 384] [--ahead 0 64] [--runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time
from pathlib import Path

import msgspec

from cadence.lab.analysis.stats import distribution
from cadence.lab.servers.server_process import ServerProcess


async def _waves(target: str, first: int, second: int, delay_s: float) -> list[float]:
    import grpc

    from cadence.client import build_request
    from cadence.proto.v1 import inference_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(target)
    stub = pb_grpc.InferenceStub(channel)
    request = build_request("burst", max_tokens=128)
    ttft: list[float] = []

    async def one(record: bool) -> None:
        start = time.monotonic()
        first_chunk = True
        async for _chunk in stub.Generate(request):
            if first_chunk and record:
                ttft.append((time.monotonic() - start) * 1e3)
            first_chunk = False

    tasks = [asyncio.create_task(one(False)) for _ in range(first)]
    await asyncio.sleep(delay_s)
    tasks += [asyncio.create_task(one(True)) for _ in range(second)]
    await asyncio.gather(*tasks)
    await channel.close()
    return ttft


def _load(target: str, first: int, second: int, delay_s: float, out: mp.Queue) -> None:
    from cadence import event_loop

    out.put(event_loop.run(_waves(target, first, second, delay_s)))


def run(ahead: int, first: int, second: int, delay_s: float) -> dict:
    args = (
        "--devices",
        "cpu:2",
        "--step-ms",
        "20",
        "--max-concurrent",
        str(first + second),
        "--max-batch",
        "1024",
        "--accept-ahead",
        str(ahead),
    )
    with ServerProcess(*args) as server:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        half = (server.target, first // 2, second // 2, delay_s, out)
        procs = [ctx.Process(target=_load, args=half) for _ in range(2)]
        start = time.monotonic()
        for p in procs:
            p.start()
        ttft = [t for _ in procs for t in out.get()]
        for p in procs:
            p.join()
        wall = time.monotonic() - start
    return {
        "accept_ahead": ahead,
        "wall_s": wall,
        "second_wave_ttft_ms": msgspec.structs.asdict(distribution(ttft)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", type=int, default=640)
    parser.add_argument("--second", type=int, default=384)
    parser.add_argument("--delay", type=float, default=0.3, help="seconds between the waves")
    parser.add_argument("--ahead", type=int, nargs="+", default=[0, 64])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", default="results/accept_burst.json")
    args = parser.parse_args()
    results = []
    for _ in range(args.runs):
        for ahead in args.ahead:
            r = run(ahead, args.first, args.second, args.delay)
            d = r["second_wave_ttft_ms"]
            print(
                f"--accept-ahead {ahead:>3}: second wave ({args.second}) TTFT p50 {d['p50']:.0f} "
                f"p90 {d['p90']:.0f} max {d['max']:.0f} ms; run {r['wall_s']:.2f} s",
                flush=True,
            )
            results.append(r)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "server": "--devices cpu:2 --step-ms 20",
                "first_wave": args.first,
                "second_wave": args.second,
                "delay_s": args.delay,
                "tokens": 128,
                "runs": results,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
