"""Overload: ten times `--max-concurrent` arriving at once (reliability issue, point 2).

One server (`--devices cpu:2 --step-ms 20 --max-concurrent 64`). Run 1: 64 streams of 256
tokens alone. Run 2: the same 64 streams, while another process sends bursts of 640 requests
at once (one burst a second): every request beyond the limit must get RESOURCE_EXHAUSTED at
once, and the admitted streams must keep their inter-token latency.

    python benchmarks/overload.py [--out results/overload.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from collections import Counter
from pathlib import Path

import msgspec

from cadence.lab.analysis.stats import distribution
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.servers.server_process import ServerProcess

LIMIT = 64
BURST = 10 * LIMIT
ADMITTED = Workload(requests=LIMIT, concurrency=LIMIT, shape=RequestShape(max_tokens=(256, 256)))


def _bursts(target: str, delay: float, seconds: float, results) -> None:
    """After `delay` s (the admitted streams are open by then), one burst of BURST requests
    a second for `seconds`; each request's (code, ms)."""
    import asyncio

    import grpc

    from cadence.client import build_request
    from cadence.proto.v1 import inference_pb2_grpc as pb_grpc

    async def one(stub, i: int) -> tuple[str, float]:
        start = time.monotonic()
        call = stub.Generate(build_request(f"burst {i}", max_tokens=16), timeout=30)
        try:
            async for _ in call:
                pass
            return "OK", (time.monotonic() - start) * 1e3
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, (time.monotonic() - start) * 1e3

    async def main() -> list[tuple[str, float]]:
        channels = [grpc.aio.insecure_channel(target) for _ in range(4)]
        stubs = [pb_grpc.InferenceStub(c) for c in channels]
        for channel in channels:
            await channel.channel_ready()
        await asyncio.sleep(delay)
        out: list[tuple[str, float]] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            tick = time.monotonic()
            out += await asyncio.gather(*(one(stubs[i % 4], i) for i in range(BURST)))
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
        for channel in channels:
            await channel.close()
        return out

    results.extend(asyncio.run(main()))


def _itl(result: dict) -> dict:
    return {k: result["itl_ms"][k] for k in ("p50", "p90", "p99", "max")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/overload.json")
    args = parser.parse_args()
    with ServerProcess(
        "--devices", "cpu:2", "--step-ms", "20", "--max-concurrent", str(LIMIT)
    ) as server:
        alone = msgspec.to_builtins(run_bench(server.target, ADMITTED))
        with multiprocessing.Manager() as manager:
            results = manager.list()
            # The bench's load processes start together about 3 s after it is called.
            bursts = multiprocessing.Process(
                target=_bursts, args=(server.target, 4.0, 3.0, results)
            )
            bursts.start()
            beside = msgspec.to_builtins(run_bench(server.target, ADMITTED))
            bursts.join(60)
            burst_results = list(results)
    codes = Counter(code for code, _ in burst_results)
    refused_ms = [ms for code, ms in burst_results if code == "RESOURCE_EXHAUSTED"]
    ratio = beside["itl_ms"]["p99"] / alone["itl_ms"]["p99"]
    out = {
        "server": f"--devices cpu:2 --step-ms 20 --max-concurrent {LIMIT}",
        "admitted": f"{LIMIT} streams x 256 tokens",
        "bursts": f"{BURST} requests at once, once a second, during the second run",
        "alone": {
            "itl_ms": _itl(alone),
            "errors": alone["errors_by_code"],
            "integrity": alone["integrity"],
        },
        "beside_bursts": {
            "itl_ms": _itl(beside),
            "errors": beside["errors_by_code"],
            "integrity": beside["integrity"],
        },
        "itl_p99_ratio": ratio,
        "burst_codes": dict(codes),
        "refusal_ms": msgspec.to_builtins(distribution(refused_ms)),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(
        f"admitted streams: ITL p50/p99 alone {alone['itl_ms']['p50']:.2f}/"
        f"{alone['itl_ms']['p99']:.2f} ms, beside bursts {beside['itl_ms']['p50']:.2f}/"
        f"{beside['itl_ms']['p99']:.2f} ms (p99 x{ratio:.2f}); their errors "
        f"{beside['errors_by_code'] or 'none'}"
    )
    print(
        f"burst requests by code {dict(codes)}; refusal time p50/p99/max "
        f"{out['refusal_ms']['p50']:.1f}/{out['refusal_ms']['p99']:.1f}/"
        f"{out['refusal_ms']['max']:.1f} ms"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
