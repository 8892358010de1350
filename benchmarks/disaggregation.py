"""Disaggregated serving (issue 54) against chunked prefill, on two synthetic workers, in one
sitting: long prompts (16-3,000 tokens) arriving open loop among decoding streams.

Three servers of two workers each, the same load on each:

- colocated: `--devices cpu:2` (each worker prefills whole prompts inside its decode steps);
- colocated with a step budget: `--devices cpu:2 --itl-target-ms 40` (chunked prefill);
- disaggregated: `--prefill-devices cpu:1 --decode-devices cpu:1` (prompts over
  --disaggregate-above, 256 by default, prefilled on worker 0 and handed to worker 1; the
  decoders' 16-token prompts run whole on worker 1).

Every worker is `--step-ms 20 --per-seq-ms 0.05 --prefill-ms-per-token 0.1` (a 3,000-token
prefill costs 300 ms) with the hand-off's default cost (128 KiB a token over 25 GB/s: 16 ms
for 3,000 tokens). The decoding streams come from the lab's bench (closed loop, 16-token
prompts, 64-192 tokens each): their ITL, TTFT, tokens/s and integrity. The long prompts come
from a cadence.client script in its own process: Poisson arrivals at --rate per second,
lengths uniform in 16-3,000, 16 tokens each: their TTFT.

    flock /tmp/cadence-bench.lock python benchmarks/disaggregation.py \\
        [--duration 30] [--streams 32] [--rate 1] [--out results/disaggregation.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
from collections import Counter
from pathlib import Path

import msgspec

from cadence.lab.analysis.stats import distribution
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.servers.server_process import ServerProcess

ENGINE = ("--step-ms", "20", "--per-seq-ms", "0.05", "--prefill-ms-per-token", "0.1")
SETUPS = {
    "colocated": ("--devices", "cpu:2"),
    "colocated --itl-target-ms 40": ("--devices", "cpu:2", "--itl-target-ms", "40"),
    "disaggregated 1+1": ("--prefill-devices", "cpu:1", "--decode-devices", "cpu:1"),
}
PROMPT_TOKENS = (16, 3000)
LONG_OUTPUT = 16
_BENCH_START_S = 3.0
"""The bench's load processes start about this long after run_bench is called."""


def _long_prompts(target: str, duration: float, rate: float, out) -> None:
    """Send prompts of PROMPT_TOKENS tokens at Poisson arrivals (`rate` a second) for
    `duration` s, from when the bench's load starts; put each one's (TTFT ms or None,
    tokens, error, prompt length)."""
    import asyncio
    import random
    import time

    from cadence.client import AsyncClient

    rng = random.Random(1)

    async def one(client: AsyncClient, i: int, length: int, results: list) -> None:
        prompt = [rng.randrange(32, 127) for _ in range(length)]
        sent = time.monotonic()
        first, tokens = None, 0
        try:
            async for chunk in client.generate(
                prompt, max_tokens=LONG_OUTPUT, request_id=f"long-{i}"
            ):
                first = first or time.monotonic()
                tokens += len(chunk.token_ids)
            results.append(((first - sent) * 1e3, tokens, "", length))
        except Exception as exc:
            results.append((None, tokens, type(exc).__name__, length))

    async def main() -> list:
        results: list = []
        async with AsyncClient(target) as client:
            await asyncio.sleep(_BENCH_START_S)
            tasks, start, i = [], time.monotonic(), 0
            at = rng.expovariate(rate)
            while at < duration:
                await asyncio.sleep(max(0.0, start + at - time.monotonic()))
                length = rng.randint(*PROMPT_TOKENS)
                tasks.append(asyncio.create_task(one(client, i, length, results)))
                i += 1
                at += rng.expovariate(rate)
            await asyncio.gather(*tasks)
        return results

    out.put(asyncio.run(main()))


def _percentiles(values: list[float], digits: int = 1) -> dict:
    if not values:
        return {}
    dist = msgspec.to_builtins(distribution(values))
    return {k: round(dist[k], digits) for k in ("p50", "p90", "p99", "max")}


def _long_summary(results: list) -> dict:
    return {
        "requests": len(results),
        "requests_ok": sum(1 for t, *_ in results if t is not None),
        "ttft_ms": _percentiles([t for t, *_ in results if t is not None]),
        "ttft_ms_over_1000_tokens": _percentiles(
            [t for t, _, _, n in results if t is not None and n > 1000]
        ),
        "errors": dict(Counter(e for _, _, e, _ in results if e)),
        "short_streams": sum(1 for t, n, _, _ in results if t is not None and n != LONG_OUTPUT),
    }


def run_once(name: str, flags: tuple[str, ...], args: argparse.Namespace) -> dict:
    """Both loads against one server started with `flags`."""
    with ServerProcess(*ENGINE, *flags) as server:
        queue = multiprocessing.Queue()
        longs = multiprocessing.Process(
            target=_long_prompts, args=(server.target, args.duration, args.rate, queue)
        )
        longs.start()
        result = run_bench(
            server.target,
            Workload(
                concurrency=args.streams,
                duration_s=args.duration,
                shape=RequestShape(prompt_tokens=(16, 16), max_tokens=(64, 192)),
            ),
        )
        decoders = msgspec.to_builtins(result)
        long_result = queue.get(timeout=args.duration + 300)
        longs.join(60)
    itl, ttft = decoders["itl_ms"], decoders["ttft_ms"]
    return {
        "setup": name,
        "flags": " ".join(flags),
        "decoding_streams": {
            "requests": decoders["requests"],
            "requests_ok": decoders["requests_ok"],
            "itl_ms": {k: round(itl[k], 2) for k in ("p50", "p90", "p99", "max")},
            "itl_p99_over_p50": round(itl["p99"] / itl["p50"], 2),
            "ttft_ms": {k: round(ttft[k], 1) for k in ("p50", "p90", "p99", "max")},
            "tokens_per_s": round(decoders["tokens_per_s"], 1),
            "errors": decoders["errors_by_code"],
            "integrity": decoders["integrity"],
        },
        "long_prompts": _long_summary(long_result),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--streams", type=int, default=32, help="decoding streams (closed loop)")
    parser.add_argument("--rate", type=float, default=1.0, help="long prompts a second")
    parser.add_argument("--out", default="results/disaggregation.json")
    args = parser.parse_args()
    runs = [run_once(name, flags, args) for name, flags in SETUPS.items()]
    out = {
        "what": f"{args.streams} decoding streams (16-token prompts, 64-192 tokens each, closed "
        f"loop) while prompts of {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens ({LONG_OUTPUT} "
        f"tokens each) arrive at {args.rate:g}/s (Poisson), {args.duration:g} s a run, two "
        "synthetic workers",
        "engine": "cadence serve " + " ".join(ENGINE),
        "command": (
            f"python benchmarks/disaggregation.py --duration {args.duration:g} "
            f"--streams {args.streams} --rate {args.rate:g}"
        ),
        "host": {
            "cores": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "note": "a 2-core host shared with other work: clients, front and workers on it",
        },
        "date": datetime.date.today().isoformat(),
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for run in runs:
        d, lp = run["decoding_streams"], run["long_prompts"]
        print(
            f"{run['setup']:>30}: decoders ITL p50 {d['itl_ms']['p50']:.1f} p99 "
            f"{d['itl_ms']['p99']:.1f} ms (p99/p50 {d['itl_p99_over_p50']}), TTFT p50 "
            f"{d['ttft_ms']['p50']:.0f} p99 {d['ttft_ms']['p99']:.0f} ms, "
            f"{d['tokens_per_s']:.0f} tok/s; long prompts TTFT p50 "
            f"{lp['ttft_ms'].get('p50', float('nan')):.0f} p99 "
            f"{lp['ttft_ms'].get('p99', float('nan')):.0f} ms; errors "
            f"{d['errors'] or lp['errors'] or 'none'}, integrity {d['integrity']}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
