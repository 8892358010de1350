"""Chunked prefill (issue 39 item 1): 64 decoding streams while 4k-token prompts arrive at 1/s,
without a step budget and with --itl-target-ms, in one sitting.

One synthetic worker (`--devices cpu:1 --step-ms 20 --prefill-ms-per-token 0.1`: twice the
torch engine's `tiny` costs on this CPU host, results/torch_engine.json, so that 64 streams
leave the 2-core host room for its clients; a 4,096-token prefill costs 410 ms). Each server
configuration gets the same load at once: the decoding streams from the lab's bench (what

    cadence bench --target T --concurrency 64 --prompt-tokens 16 --max-tokens 64:192 \\
        --duration 60

runs: their ITL, and integrity), and the long prompts from a cadence.client script in its own
process (Poisson arrivals at 1/s, 16 tokens each, ids `long-N` so they never collide with the
bench's `bench-N`): their TTFT, from sending to the first token, and their token count.

    flock /tmp/cadence-bench.lock python benchmarks/chunked_prefill.py \\
        [--duration 60] [--targets 40,60,100] [--out results/chunked_prefill.json]
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

SERVER = ("--devices", "cpu:1", "--step-ms", "20", "--prefill-ms-per-token", "0.1")
STREAMS = 64
LONG_PROMPT = 4096


def _decoders(duration: float) -> Workload:
    return Workload(
        concurrency=STREAMS,
        duration_s=duration,
        shape=RequestShape(prompt_tokens=(16, 16), max_tokens=(64, 192)),
    )


def _long_prompts(target: str, duration: float, out) -> None:
    """Send LONG_PROMPT-token prompts at Poisson arrivals (1/s) for `duration` s (after the
    bench's load processes are up); put each one's (TTFT ms or None, tokens, error)."""
    import asyncio
    import random
    import time

    from cadence.client import AsyncClient

    rng = random.Random(1)

    async def one(client: AsyncClient, i: int, results: list) -> None:
        prompt = [rng.randrange(32, 127) for _ in range(LONG_PROMPT)]
        sent = time.monotonic()
        first, tokens = None, 0
        try:
            async for chunk in client.generate(prompt, max_tokens=16, request_id=f"long-{i}"):
                first = first or time.monotonic()
                tokens += len(chunk.token_ids)
            results.append(((first - sent) * 1e3, tokens, ""))
        except Exception as exc:
            results.append((None, tokens, type(exc).__name__))

    async def main() -> list:
        results: list = []
        async with AsyncClient(target) as client:
            await asyncio.sleep(_BENCH_START_S)
            tasks, start, i = [], time.monotonic(), 0
            at = rng.expovariate(1.0)
            while at < duration:
                await asyncio.sleep(max(0.0, start + at - time.monotonic()))
                tasks.append(asyncio.create_task(one(client, i, results)))
                i += 1
                at += rng.expovariate(1.0)
            await asyncio.gather(*tasks)
        return results

    out.put(asyncio.run(main()))


_BENCH_START_S = 3.0
"""The bench's load processes start about this long after run_bench is called."""


def _ttft_summary(results: list) -> dict:
    ttfts = [t for t, _, _ in results if t is not None]
    dist = msgspec.to_builtins(distribution(ttfts))
    return {
        "requests": len(results),
        "requests_ok": len(ttfts),
        "ttft_ms": {k: round(dist[k], 1) for k in ("p50", "p90", "p99", "max")},
        "errors": dict(Counter(e for _, _, e in results if e)),
        "short_streams": sum(1 for t, n, _ in results if t is not None and n != 16),
    }


def _summary(result: dict) -> dict:
    return {
        "requests": result["requests"],
        "requests_ok": result["requests_ok"],
        "itl_ms": {k: round(result["itl_ms"][k], 2) for k in ("p50", "p90", "p99", "max")},
        "ttft_ms": {k: round(result["ttft_ms"][k], 1) for k in ("p50", "p90", "p99", "max")},
        "errors": result["errors_by_code"],
        "integrity": result["integrity"],
    }


def run_once(flags: tuple[str, ...], duration: float) -> dict:
    """Both workloads against one server started with `flags`."""
    with ServerProcess(*SERVER, *flags) as server:
        queue = multiprocessing.Queue()
        longs = multiprocessing.Process(target=_long_prompts, args=(server.target, duration, queue))
        longs.start()
        decoders = msgspec.to_builtins(run_bench(server.target, _decoders(duration)))
        long_result = queue.get(timeout=duration + 300)
        longs.join(60)
    d, lp = _summary(decoders), _ttft_summary(long_result)
    return {
        "flags": " ".join(flags) or "(none)",
        "decoding_streams": d,
        "long_prompts": lp,
        "itl_p99_over_p50": round(d["itl_ms"]["p99"] / d["itl_ms"]["p50"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument(
        "--targets",
        default="40,60,100",
        help="--itl-target-ms values to run after the run without one",
    )
    parser.add_argument("--out", default="results/chunked_prefill.json")
    args = parser.parse_args()
    runs = [run_once((), args.duration)]
    for target in args.targets.split(","):
        runs.append(run_once(("--itl-target-ms", target), args.duration))
    today = runs[0]
    for run in runs[1:]:
        run["vs_no_budget"] = {
            "itl_p99": round(
                run["decoding_streams"]["itl_ms"]["p99"]
                / today["decoding_streams"]["itl_ms"]["p99"],
                3,
            ),
            "itl_p50": round(
                run["decoding_streams"]["itl_ms"]["p50"]
                / today["decoding_streams"]["itl_ms"]["p50"],
                3,
            ),
            "long_ttft_p99": round(
                run["long_prompts"]["ttft_ms"]["p99"] / today["long_prompts"]["ttft_ms"]["p99"], 3
            ),
        }
    out = {
        "what": f"{STREAMS} decoding streams (16-token prompts, 64-192 tokens each, closed "
        f"loop) while {LONG_PROMPT}-token prompts (16 tokens each) arrive at 1/s "
        f"(Poisson), {args.duration:g} s a run",
        "server": "cadence serve " + " ".join(SERVER),
        "command": "python benchmarks/chunked_prefill.py "
        + " ".join(
            f"--{k} {v}" for k, v in (("duration", f"{args.duration:g}"), ("targets", args.targets))
        ),
        "host": {
            "cores": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "date": datetime.date.today().isoformat(),
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for run in runs:
        d, lp = run["decoding_streams"], run["long_prompts"]
        print(
            f"{run['flags']:>20}: decoders ITL p50 {d['itl_ms']['p50']:.1f} ms, p99 "
            f"{d['itl_ms']['p99']:.1f} ms (p99/p50 {run['itl_p99_over_p50']}); long "
            f"prompts TTFT p50 {lp['ttft_ms']['p50']:.0f} ms, p99 {lp['ttft_ms']['p99']:.0f} "
            f"ms; errors {d['errors'] or lp['errors'] or 'none'}, integrity "
            f"{d['integrity']}, long streams short {lp['short_streams']}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
