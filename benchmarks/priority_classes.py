"""Two classes of traffic (issue 39 item 2's target): interactive requests (priority 0) while
batch requests (priority 10) keep the server saturated; the interactive TTFT against its value
on an idle server, and the batch's progress, in one sitting.

One synthetic worker with a torch-like step (`--step-ms 10 --per-seq-ms 0.25
--prefill-ms-per-token 0.1`, as benchmarks/multi_turn.py) and `--max-batch 16`: the batch
class is 32 closed-loop streams of 256 tokens (64-token prompts), so 16 run and 16 wait at
every moment. The interactive class arrives at 2/s (Poisson, seeded): 64-token prompts, 16
tokens of answer. Four runs of the same script:

- idle: the interactive class alone;
- FCFS: with the batch load, every request priority 0 (cadence before priorities);
- priority: with the batch load at priority 10 (the interactive requests jump its queue but
  wait for a running batch stream to end);
- priority + --preempt: a waiting interactive request preempts the running batch stream of the
  lowest priority (recomputed later).

Integrity: every stream's chunks contiguous (index = tokens before) and exactly its
max_tokens, preempted ones included.

    flock /work/bench.lock python benchmarks/priority_classes.py [--duration 20]
        [--out results/priority_classes.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import time
from pathlib import Path

import msgspec

from cadence.client import AsyncClient
from cadence.lab.analysis.stats import distribution
from cadence.lab.servers.server_process import ServerProcess

SERVER = (
    "--devices",
    "cpu:1",
    "--step-ms",
    "10",
    "--per-seq-ms",
    "0.25",
    "--prefill-ms-per-token",
    "0.1",
    "--max-batch",
    "16",
)
BATCH_STREAMS, BATCH_TOKENS = 32, 256
INTERACTIVE_RATE, INTERACTIVE_TOKENS = 2.0, 16
PROMPT_TOKENS = 64


async def stream(client: AsyncClient, prompt: str, max_tokens: int, priority: int) -> dict:
    sent = time.monotonic()
    first, chunks = None, []
    async for chunk in client.generate(prompt, max_tokens=max_tokens, priority=priority):
        first = first or time.monotonic()
        chunks.append(chunk)
    tokens = sum(len(c.token_ids) for c in chunks)
    contiguous = [c.index for c in chunks] == [
        sum(len(c.token_ids) for c in chunks[:k]) for k in range(len(chunks))
    ]
    return {
        "ttft_ms": (first - sent) * 1e3,
        "tokens": tokens,
        "whole": contiguous and tokens == max_tokens,
    }


async def drive(target: str, duration: float, batch_priority: int | None) -> dict:
    rng = random.Random(3)
    stop = time.monotonic() + duration
    batch: list = []
    interactive: list = []

    async def batch_loop(client: AsyncClient, i: int) -> None:
        while time.monotonic() < stop:
            batch.append(
                await stream(
                    client, f"batch {i} " + "b" * PROMPT_TOKENS, BATCH_TOKENS, batch_priority
                )
            )

    async with AsyncClient(target) as client:
        loops = []
        if batch_priority is not None:
            loops = [asyncio.create_task(batch_loop(client, i)) for i in range(BATCH_STREAMS)]
            await asyncio.sleep(2.0)  # saturated before the first interactive request
        start, at, tasks, n = time.monotonic(), rng.expovariate(INTERACTIVE_RATE), [], 0
        while start + at < stop:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            tasks.append(
                asyncio.create_task(
                    stream(client, f"question {n} " + "q" * PROMPT_TOKENS, INTERACTIVE_TOKENS, 0)
                )
            )
            at += rng.expovariate(INTERACTIVE_RATE)
            n += 1
        interactive = await asyncio.gather(*tasks)
        await asyncio.gather(*loops)
    return {"interactive": interactive, "batch": batch}


def _ms(values: list[float]) -> dict:
    dist = msgspec.to_builtins(distribution(values))
    return {k: round(dist[k], 1) for k in ("p50", "p90", "p99", "max")}


def run_once(
    name: str, flags: tuple[str, ...], batch_priority: int | None, duration: float
) -> dict:
    with ServerProcess(*SERVER, *flags) as server:
        started = time.monotonic()
        got = asyncio.run(drive(server.target, duration, batch_priority))
        wall = time.monotonic() - started
    inter, batch = got["interactive"], got["batch"]
    return {
        "run": name,
        "flags": " ".join(flags) or "(none)",
        "batch_priority": batch_priority,
        "interactive_requests": len(inter),
        "interactive_ttft_ms": _ms([r["ttft_ms"] for r in inter]),
        "batch_requests_done": len(batch),
        "batch_tokens_per_s": round(sum(r["tokens"] for r in batch) / wall, 1),
        "streams_not_whole": sum(not r["whole"] for r in inter + batch),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--out", default="results/priority_classes.json")
    args = parser.parse_args()
    runs = [
        run_once("idle", (), None, args.duration),
        run_once("FCFS", (), 0, args.duration),
        run_once("priority", (), 10, args.duration),
        run_once("priority + preempt", ("--preempt",), 10, args.duration),
    ]
    idle = runs[0]["interactive_ttft_ms"]["p99"]
    for run in runs[1:]:
        run["interactive_ttft_p99_over_idle"] = round(run["interactive_ttft_ms"]["p99"] / idle, 2)
    out = {
        "what": f"interactive requests (priority 0, {INTERACTIVE_TOKENS} tokens, "
        f"{INTERACTIVE_RATE:g}/s Poisson) beside {BATCH_STREAMS} closed-loop batch "
        f"streams of {BATCH_TOKENS} tokens on a worker of --max-batch 16, "
        f"{args.duration:g} s a run; TTFT at the client (cadence.v1)",
        "server": "cadence serve " + " ".join(SERVER),
        "command": f"flock /work/bench.lock python benchmarks/priority_classes.py "
        f"--duration {args.duration:g}",
        "host": {
            "cores": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "note": "a 2-core host; figures are A/B within this one run",
        },
        "date": datetime.date.today().isoformat(),
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for run in runs:
        t = run["interactive_ttft_ms"]
        print(
            f"{run['run']:>20}: interactive TTFT p50 {t['p50']:.0f} ms, p99 {t['p99']:.0f} ms "
            f"(x{run.get('interactive_ttft_p99_over_idle', 1)} idle); batch "
            f"{run['batch_tokens_per_s']} tokens/s, {run['batch_requests_done']} done; not "
            f"whole {run['streams_not_whole']}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
