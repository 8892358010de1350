"""What the load sends: each request's plan (ids, prompt, length), how requests are made
from a seed, and when they arrive in an open loop."""

from __future__ import annotations

import random

import msgspec


class RequestPlan(msgspec.Struct, frozen=True, array_like=True):
    """One request to send."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    number: int = 0
    """The request's number in the run (i); warm-up requests count apart."""


class RequestShape(msgspec.Struct, frozen=True, kw_only=True):
    """How requests are made: lengths fixed or uniform in [lo, hi], or prompts from a file.

    Request i is the same whichever process sends it and however often the run is repeated
    with the same seed.
    """

    prompt_tokens: tuple[int, int] = (16, 16)
    max_tokens: tuple[int, int] = (128, 128)
    prompts: list[tuple[list[int], int]] = []
    """(prompt token ids, max_tokens or 0 for the shape's) pairs, cycled; from a JSONL file."""
    seed: int = 0

    def request(self, i: int) -> RequestPlan:
        rng = random.Random(self.seed * 1_000_003 + i)
        max_tokens = rng.randint(*self.max_tokens)
        if self.prompts:
            prompt, fixed = self.prompts[i % len(self.prompts)]
            return RequestPlan(f"bench-{i}", prompt, fixed or max_tokens, i)
        prompt = [rng.randrange(32, 127) for _ in range(rng.randint(*self.prompt_tokens))]
        return RequestPlan(f"bench-{i}", prompt, max_tokens, i)


def poisson_offsets(rate: float, seed: int):
    """Arrival times (seconds from the start) of a Poisson process: exponential gaps."""
    rng = random.Random(seed)
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        yield t
