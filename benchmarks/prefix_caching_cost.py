"""What prefix caching costs where it can never pay: a workload whose prompts share no prefix,
served by the torch engine with prefix caching on and off (`--prefix-caching`,
`--no-prefix-caching`), A/B in one sitting. Its default is on where this cost is within 2% of
tokens/s (docs/models.md, "Prefix caching").

With caching on and nothing to share, the torch engine still does all of its bookkeeping:
it hashes every full block of each prompt when the sequence is admitted (`reserve`), looks
the hashes up, registers every block a step fills (prompt and outputs), reports each
sequence's cached tokens (none), and, once the cache is full of finished sequences' blocks,
evicts the least recently released on every allocation. The KV cache here (24,576 tokens)
holds the running batch (32 x 576 tokens) with little to spare, against the run's 55 k tokens:
most of the run is in that evicting state.

Two parts, `--rounds` rounds each:

  served   `cadence serve --engine torch --model tiny` (one worker; OMP_NUM_THREADS=1) with each
           flag, started afresh per run; `--streams` cadence.v1 streams, closed loop (a stream
           sends its next request when its last one ends), `--requests` requests of
           `--prompt` random token ids each (unique from their first block) and `--tokens`
           outputs; tokens/s is the outputs received over the run's wall time, and tokens
           per CPU second the outputs over the CPU time of the server's processes (front and
           worker) during the run.
  engine   the same workload through a BatchScheduler over each of two LlamaEngines in this
           process, one with caching and one without, stepped in lockstep (a step of one, a
           step of the other): no gRPC, no client; the engine's and the batching loop's own
           cost, both under the same load from the rest of the host. Tokens/s: the outputs
           over the time in each one's steps; per CPU second, over this thread's CPU time in
           them.

`tiny` (about 1 M parameters) is the worst case: the least model compute per token against
which the bookkeeping shows. The host is a 2-core machine shared with other work, whose load
moves wall-clock tokens/s by a factor of two within minutes: every figure is a median over
alternating runs with the spread beside it, and tokens per CPU second, which the other work
on the host moves less, is written beside tokens/s. The engine part's lockstep pairs are the
finest A/B this host allows; the served part shows the same cost end to end.

    flock /work/bench.lock python benchmarks/prefix_caching_cost.py [--rounds 6]
        [--out results/prefix_caching_cost.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

SERVER = (
    "--engine",
    "torch",
    "--model",
    "tiny",
    "--devices",
    "cpu:1",
    "--kv-cache-tokens",
    "24576",
    "--max-batch",
    "32",
)
FLAGS = {"on": "--prefix-caching", "off": "--no-prefix-caching"}


def workload(requests: int, prompt: int, seed: int = 11) -> list[list[int]]:
    """`requests` prompts of random byte tokens; no two share their first block (16 tokens)."""
    rng = random.Random(seed)
    prompts, firsts = [], set()
    while len(prompts) < requests:
        ids = [rng.randrange(256) for _ in range(prompt)]
        if bytes(ids[:16]) not in firsts:
            firsts.add(bytes(ids[:16]))
            prompts.append(ids)
    return prompts


# -- served ---------------------------------------------------------------------------------


async def _drive(
    target: str,
    prompts: list[list[int]],
    streams: int,
    tokens: int,
    server_cpu: Callable[[], float],
) -> dict:
    from cadence.client import AsyncClient

    queue = list(reversed(prompts))
    received = cached = short = 0

    async def stream(client: AsyncClient) -> None:
        nonlocal received, cached, short
        while queue:
            prompt = queue.pop()
            got = 0
            async for chunk in client.generate(prompt, max_tokens=tokens):
                got += len(chunk.token_ids)
                cached += chunk.cached_tokens
            received += got
            short += got != tokens

    async with AsyncClient(target) as client:
        # One request first: the server's first step is not the measurement.
        async for _ in client.generate([1] * 8, max_tokens=2):
            pass
        cpu = server_cpu()
        started = time.perf_counter()
        await asyncio.gather(*(stream(client) for _ in range(streams)))
        wall = time.perf_counter() - started
        cpu = server_cpu() - cpu
    return {
        "tokens_per_s": round(received / wall, 1),
        "tokens_per_cpu_s": round(received / cpu, 1),
        "wall_s": round(wall, 2),
        "server_cpu_s": round(cpu, 2),
        "outputs": received,
        "cached_tokens": cached,
        "short_streams": short,
    }


def served_run(flag: str, prompts: list[list[int]], streams: int, tokens: int) -> dict:
    from cadence.lab.servers.server_process import ServerProcess

    os.environ["OMP_NUM_THREADS"] = "1"  # the worker's torch threads, as the engine part's
    with ServerProcess(*SERVER, flag) as server:
        return asyncio.run(_drive(server.target, prompts, streams, tokens, _cpu_of(server.pid)))


def _cpu_of(pid: int) -> Callable[[], float]:
    """A function giving the CPU seconds (user and system) of `pid` and its children so far."""
    import psutil

    root = psutil.Process(pid)
    family = [root, *root.children(recursive=True)]

    def seconds() -> float:
        total = 0.0
        for p in family:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    return seconds


# -- engine only ----------------------------------------------------------------------------


def engines() -> dict:
    import torch

    from cadence.config import EngineConfig
    from cadence.engines.llama.engine import LlamaEngine

    torch.set_num_threads(1)
    built = {}
    for name, caching in (("on", True), ("off", False)):
        config = EngineConfig(
            name="torch",
            model="tiny",
            kv_cache_tokens=int(SERVER[SERVER.index("--kv-cache-tokens") + 1]),
            threads=1,
            prefix_caching=caching,
        )
        built[name] = LlamaEngine(config, "cpu")
        built[name].start()
    return built


def engine_round(built: dict, prompts: list[list[int]], streams: int, tokens: int, k: int) -> dict:
    """Both engines through the same workload in lockstep: a step of one, then a step of
    the other (which goes first alternates from step to step), so that whatever else the
    host runs slows both alike. Each engine's time is the sum of its own steps (admission,
    the engine's step, the batching loop's work on its output)."""
    from cadence.vocabulary import AddRequest
    from cadence.worker.batch_scheduler import BatchScheduler

    runs = {}
    for name, engine in built.items():
        runs[name] = {
            "scheduler": BatchScheduler(engine, 0, streams, report_cached=name == "on"),
            "waiting": list(reversed(prompts)),
            "seq_id": 0,
            "outputs": 0,
            "cached": 0,
            "wall": 0.0,
            "cpu": 0.0,
        }

    def add(run: dict) -> None:
        run["scheduler"].add(AddRequest(run["seq_id"], run["waiting"].pop(), tokens))
        run["seq_id"] += 1

    def step(run: dict) -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        out = run["scheduler"].step()
        if out is not None and not isinstance(out, list):
            run["outputs"] += len(out.seq_ids)
            run["cached"] += sum(out.cached_tokens.values())
            for _ in out.finished_ids:
                if run["waiting"]:
                    add(run)
        run["wall"] += time.perf_counter() - wall
        run["cpu"] += time.thread_time() - cpu

    for run in runs.values():
        for _ in range(min(streams, len(run["waiting"]))):
            add(run)
    first, second = runs["on"], runs["off"]
    while first["scheduler"].has_work or second["scheduler"].has_work:
        step(first)
        step(second)
        first, second = second, first
    out = {}
    for name, run in runs.items():
        built[name].cache.forget_prefixes()  # each round starts from an empty cache
        out[name] = {
            "round": k,
            "caching": name,
            "tokens_per_s": round(run["outputs"] / run["wall"], 1),
            "tokens_per_cpu_s": round(run["outputs"] / run["cpu"], 1),
            "steps_wall_s": round(run["wall"], 2),
            "steps_cpu_s": round(run["cpu"], 2),
            "outputs": run["outputs"],
            "cached_tokens": run["cached"],
        }
    return out


# -- the sitting ----------------------------------------------------------------------------


def summary(runs: list[dict], key: str) -> dict:
    """`key` (tokens_per_s or tokens_per_cpu_s) on against off: medians, spread, and the
    median of each round's own ratio (its two runs are back to back)."""
    by = {name: [r[key] for r in runs if r["caching"] == name] for name in FLAGS}
    med = {name: statistics.median(values) for name, values in by.items()}
    ratios = []
    for k in sorted({r["round"] for r in runs}):
        pair = {r["caching"]: r[key] for r in runs if r["round"] == k}
        if len(pair) == 2:
            ratios.append(pair["on"] / pair["off"])
    return {
        "median": med,
        "range": {n: [min(v), max(v)] for n, v in by.items()},
        "on_over_off_of_medians": round(med["on"] / med["off"], 4),
        "on_over_off_per_round": [round(r, 4) for r in ratios],
        "on_over_off_median_of_rounds": round(statistics.median(ratios), 4),
        "cost_percent": round((1 - statistics.median(ratios)) * 100, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--served-rounds", type=int, help="(default: --rounds)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--parts", default="engine,served")
    parser.add_argument("--out", default="results/prefix_caching_cost.json")
    args = parser.parse_args()
    prompts = workload(args.requests, args.prompt)
    parts = args.parts.split(",")
    load_before = os.getloadavg()
    out: dict = {
        "what": f"{args.requests} requests, {args.streams} closed-loop streams, prompts of "
        f"{args.prompt} random byte tokens sharing no prefix, {args.tokens} outputs each, greedy",
        "server": "OMP_NUM_THREADS=1 cadence serve "
        + " ".join(SERVER)
        + " [--prefix-caching | --no-prefix-caching]",
        "command": "flock /work/bench.lock python benchmarks/prefix_caching_cost.py "
        f"--rounds {args.rounds} --served-rounds {args.served_rounds or args.rounds} "
        f"--requests {args.requests}",
        "host": {
            "cores": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "note": "a 2-core host shared with other engineers' work during the sitting: "
            "on and off alternate (on-off, then off-on, ...) and the figures are medians",
            "load_average_at_start": [round(v, 2) for v in load_before],
        },
        "date": datetime.date.today().isoformat(),
    }
    built = engines() if "engine" in parts else {}
    for part in parts:
        runs = []
        for k in range(args.rounds if part == "engine" else args.served_rounds or args.rounds):
            if part == "engine":
                pair = engine_round(built, prompts, args.streams, args.tokens, k)
                runs += pair.values()
                print(part, k, pair, flush=True)
                continue
            for name in ("on", "off") if k % 2 == 0 else ("off", "on"):
                run = served_run(FLAGS[name], prompts, args.streams, args.tokens)
                runs.append({"round": k, "caching": name, **run})
                print(part, k, name, run, flush=True)
        out[part] = {
            "runs": runs,
            "tokens_per_cpu_s": summary(runs, "tokens_per_cpu_s"),
            "tokens_per_s": summary(runs, "tokens_per_s"),
        }
        print(part, {k: v for k, v in out[part].items() if k != "runs"}, flush=True)
    out["host"]["load_average_at_end"] = [round(v, 2) for v in os.getloadavg()]
    shared = sum(r["cached_tokens"] for p in parts for r in out[p]["runs"])
    out["integrity"] = {
        "cached_tokens_reported": shared,
        "short_streams": sum(r.get("short_streams", 0) for p in parts for r in out[p]["runs"]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
