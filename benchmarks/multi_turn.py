"""Multi-turn conversations (issue 39 item 4's target): turn >= 2 TTFT with prefix caching and
prefix-aware routing, against both off and against caching with load-only routing, on two
workers, in one sitting.

A scripted cadence.v1 client holds 32 conversations of 6 turns: a shared system prompt, then
per turn a user message, the request carrying the whole history (every earlier message and
answer), 32 tokens of answer, and a pause of 0.5-1.5 s before the next turn (the same seeded
script for every configuration). Two shapes: a long system prompt (1,024 tokens) with short
user turns (64), where most of a history is the prefix every worker holds; and a shorter
system prompt (256) with long user turns (256: pasted documents, retrieved passages), where
most of it is the conversation's own. Two synthetic workers with a torch-like
step (`--step-ms 10 --per-seq-ms 0.25 --prefill-ms-per-token 0.1`: the prefill cost per token
twice the torch engine's `tiny` on this CPU host, results/torch_engine.json; the step longer,
to leave the 2-core host room for the client), so a turn-6 history of 1,500-2,000 tokens costs
150-200 ms of prefill when computed whole. Each worker's cache (`--kv-cache-tokens 32768`)
holds its half of the conversations at their longest.

Integrity: every stream's chunks must be contiguous (index = tokens before) and give exactly
its max_tokens; and since the engine's output depends only on the prompt, every configuration
must give every conversation the same answers (same prompts, same tokens).

    flock /work/bench.lock python benchmarks/multi_turn.py [--out results/multi_turn.json]
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
    "cpu:2",
    "--step-ms",
    "10",
    "--per-seq-ms",
    "0.25",
    "--prefill-ms-per-token",
    "0.1",
    "--kv-cache-tokens",
    "32768",
    "--heartbeat-timeout",
    "10",
)
"""A cache of 32k tokens a worker holds its half of the conversations at turn 6 (32 x about
2,000 tokens in the long-turn shape), not all of them. Without prefix caching a step may
prefill a dozen whole histories, seconds of modelled time in which the worker's loop sends no
heartbeat: the timeout is raised past it."""
CONFIGS = {
    "both off": (),
    "caching, load-only routing": ("--prefix-caching", "--routing", "load"),
    "caching + prefix routing": ("--prefix-caching", "--routing", "prefix"),
}
CONVERSATIONS, TURNS = 32, 6
SHAPES = {"long system prompt": (1024, 64), "long user turns": (256, 256)}
"""(system prompt, user turn) tokens (bytes: the synthetic engine's tokens)."""
ANSWER_TOKENS = 32
_WORDS = [
    "stream",
    "token",
    "latency",
    "card",
    "batch",
    "step",
    "queue",
    "client",
    "server",
    "worker",
    "engine",
    "cadence",
    "first",
    "gap",
    "tail",
    "rhythm",
    "network",
    "request",
    "response",
    "prefix",
    "cache",
    "route",
]


def _text(rng: random.Random, size: int) -> str:
    out = ""
    while len(out) < size:
        out += rng.choice(_WORDS) + " "
    return out[:size]


async def conversation(
    client: AsyncClient, i: int, system: str, user_tokens: int, rng: random.Random, records: list
) -> None:
    await asyncio.sleep(rng.uniform(0, 2.0))  # conversations start spread over 2 s
    history = system
    for turn in range(TURNS):
        history += f"\nUser {i}: " + _text(rng, user_tokens - 9) + "\nAssistant:"
        sent = time.monotonic()
        first, chunks = None, []
        async for chunk in client.generate(
            history, max_tokens=ANSWER_TOKENS, request_id=f"c{i}-t{turn}"
        ):
            first = first or time.monotonic()
            chunks.append(chunk)
        tokens = [t for c in chunks for t in c.token_ids]
        contiguous = [c.index for c in chunks] == [
            sum(len(c.token_ids) for c in chunks[:k]) for k in range(len(chunks))
        ]
        answer = "".join(c.text for c in chunks)
        records.append(
            {
                "conversation": i,
                "turn": turn,
                "ttft_ms": (first - sent) * 1e3,
                "prompt_chars": len(history),
                "cached_tokens": chunks[-1].cached_tokens,
                "whole": contiguous and len(tokens) == ANSWER_TOKENS,
                "tokens": tokens,
            }
        )
        history += answer
        await asyncio.sleep(rng.uniform(0.5, 1.5))


async def drive(target: str, system_tokens: int, user_tokens: int) -> list:
    records: list = []
    rng = random.Random(7)
    system = _text(rng, system_tokens)
    seeds = [rng.randrange(1 << 30) for _ in range(CONVERSATIONS)]
    async with AsyncClient(target) as client:
        await asyncio.gather(
            *(
                conversation(client, i, system, user_tokens, random.Random(seeds[i]), records)
                for i in range(CONVERSATIONS)
            )
        )
    return records


def _ms(values: list[float]) -> dict:
    dist = msgspec.to_builtins(distribution(values))
    return {k: round(dist[k], 1) for k in ("p50", "p90", "p99", "max")}


def run_once(flags: tuple[str, ...], shape: tuple[int, int]) -> tuple[dict, dict]:
    with ServerProcess(*SERVER, *flags) as server:
        started = time.monotonic()
        records = asyncio.run(drive(server.target, *shape))
        wall = time.monotonic() - started
    later = [r for r in records if r["turn"] >= 1]
    summary = {
        "flags": " ".join(flags) or "(none)",
        "requests": len(records),
        "wall_s": round(wall, 1),
        "turn1_ttft_ms": _ms([r["ttft_ms"] for r in records if r["turn"] == 0]),
        "turn2plus_ttft_ms": _ms([r["ttft_ms"] for r in later]),
        "turn2plus_cached_share": round(
            sum(r["cached_tokens"] for r in later) / sum(r["prompt_chars"] for r in later), 3
        ),
        "streams_not_whole": sum(not r["whole"] for r in records),
    }
    answers = {(r["conversation"], r["turn"]): r["tokens"] for r in records}
    return summary, answers


def run_shape(shape: tuple[int, int]) -> dict:
    """The three configurations on one shape of conversation."""
    runs, answers = {}, []
    for name, flags in CONFIGS.items():
        runs[name], got = run_once(flags, shape)
        answers.append(got)
    best = runs["caching + prefix routing"]["turn2plus_ttft_ms"]["p99"]
    return {
        "system_prompt_tokens": shape[0],
        "user_turn_tokens": shape[1],
        "runs": runs,
        "turn2plus_ttft_p99_over_prefix_routing": {
            name: round(run["turn2plus_ttft_ms"]["p99"] / best, 2) for name, run in runs.items()
        },
        "integrity": {
            "streams_not_whole": sum(r["streams_not_whole"] for r in runs.values()),
            "same_answers_in_every_configuration": all(a == answers[0] for a in answers[1:]),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/multi_turn.json")
    args = parser.parse_args()
    shapes = {name: run_shape(shape) for name, shape in SHAPES.items()}
    out = {
        "what": f"{CONVERSATIONS} conversations x {TURNS} turns on 2 workers: a shared "
        f"system prompt, user turns, {ANSWER_TOKENS}-token answers, the whole history "
        "re-sent each turn, 0.5-1.5 s between turns; TTFT at the client (cadence.v1)",
        "server": "cadence serve " + " ".join(SERVER),
        "command": "flock /work/bench.lock python benchmarks/multi_turn.py",
        "host": {
            "cores": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "note": "a 2-core host; figures are A/B within this one run",
        },
        "date": datetime.date.today().isoformat(),
        "shapes": shapes,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for shape_name, shape in shapes.items():
        print(f"{shape_name}:")
        for name, run in shape["runs"].items():
            print(
                f"{name:>28}: turn>=2 TTFT p50 {run['turn2plus_ttft_ms']['p50']:.0f} ms, "
                f"p99 {run['turn2plus_ttft_ms']['p99']:.0f} ms, cached share "
                f"{run['turn2plus_cached_share']}, not whole {run['streams_not_whole']}, "
                f"{run['wall_s']} s"
            )
        print("  p99 over prefix routing's:", shape["turn2plus_ttft_p99_over_prefix_routing"])
        print("  integrity:", shape["integrity"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
