"""A batched model's two shapes on cadence, the same step cost: `step(prefill, decode)`
against `generate_stream(batch)` (docs/models.md).

    python benchmarks/model_shapes.py [--streams 16 64] [--tokens 50] [--rounds 4]
        [--out results/model_shapes.json]

Both models take STEP_S (10 ms) per step whatever the batch, and give each sequence the next
byte of its prompt. One worker (`--devices cpu:1`), one client process with one channel,
closed loop: `streams` streams, each sending `rounds` requests of `tokens` tokens one after
another. The step shape admits a request at the next step; the generator shape gathers
requests for --batch-timeout-ms (10 ms) and then runs the batch to its end, so a request
that misses a batch waits for all of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_S = 0.010


class StepModel:
    def __init__(self, device: str) -> None:
        pass

    def step(self, prefill: list, decode: list) -> list[int]:
        time.sleep(STEP_S)
        batch = prefill + decode
        return [s.prompt_token_ids[s.generated % len(s.prompt_token_ids)] for s in batch]


class GeneratorModel:
    def __init__(self, device: str) -> None:
        pass

    def generate_stream(self, batch: list):
        for step in range(10**9):
            time.sleep(STEP_S)
            yield [s.prompt_token_ids[step % len(s.prompt_token_ids)] for s in batch]


async def _stream(client, tokens: int, rounds: int, ttfts: list[float], counts: list[int]) -> None:
    for _ in range(rounds):
        start, first, count = time.monotonic(), None, 0
        async for chunk in client.generate("abcdefgh", max_tokens=tokens):
            if first is None:
                first = time.monotonic() - start
            count += len(chunk.token_ids)
        ttfts.append(first)
        counts.append(count)


async def _drive(target: str, streams: int, tokens: int, rounds: int) -> dict:
    from cadence.client import AsyncClient

    ttfts: list[float] = []
    counts: list[int] = []
    async with AsyncClient(target) as client:
        await _stream(client, tokens, 2, [], [])  # warm-up
        start = time.monotonic()
        await asyncio.gather(
            *(_stream(client, tokens, rounds, ttfts, counts) for _ in range(streams))
        )
        elapsed = time.monotonic() - start
    q = statistics.quantiles(ttfts, n=100)
    return {
        "streams": streams,
        "tokens_per_s": round(sum(counts) / elapsed, 1),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1),
        "ttft_p99_ms": round(q[98] * 1e3, 1),
        "requests": len(ttfts),
        "tokens": sum(counts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--tokens", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="results/model_shapes.json")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    os.chdir(ROOT)
    path = [str(ROOT), os.environ.get("PYTHONPATH")]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, path))  # the workers import us
    from conftest import start_server

    rows = []
    for shape, model in (("step", "StepModel"), ("generate_stream", "GeneratorModel")):
        server = start_server("--engine", f"benchmarks.model_shapes:{model}", "--devices", "cpu:1")
        try:
            for streams in args.streams:
                row = {
                    "shape": shape,
                    **asyncio.run(_drive(server.target, streams, args.tokens, args.rounds)),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            server.stop()
    ideal = {s: round(s / STEP_S, 1) for s in args.streams}
    Path(args.out).write_text(
        json.dumps(
            {
                "command": "python " + " ".join(sys.argv),
                "step_ms": STEP_S * 1e3,
                "tokens": args.tokens,
                "rounds": args.rounds,
                "ideal_tokens_per_s": ideal,
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg(),
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
