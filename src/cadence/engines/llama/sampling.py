"""Choosing each sequence's next token from its logits: greedy, or temperature / top-k / top-p
sampling with one random generator per sequence.

A request that sets no sampling parameter (temperature 0) is decoded greedily. A sampled
sequence draws from its own `torch.Generator`, seeded from the engine's seed and the
request's seed, so its tokens depend only on its own logits and seed, never on which other
sequences share its batch.
"""

from __future__ import annotations

import torch

from cadence.vocabulary import Sampling


class Sampler:
    """One sequence's sampling parameters and random state."""

    __slots__ = ("temperature", "top_p", "top_k", "generator")

    def __init__(self, sampling: Sampling, engine_seed: int, device: torch.device) -> None:
        self.temperature = sampling.temperature
        # The wire protocol uses 0 for "off" in both fields.
        self.top_p = sampling.top_p if 0 < sampling.top_p < 1 else 1.0
        self.top_k = sampling.top_k
        self.generator: torch.Generator | None = None
        if self.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(mix_seed(engine_seed, sampling.seed))

    @property
    def greedy(self) -> bool:
        return self.generator is None


def mix_seed(engine_seed: int, request_seed: int) -> int:
    """One 63-bit seed from the engine's and the request's, so both change the draw."""
    return (request_seed * 0x9E3779B97F4A7C15 + engine_seed) % (1 << 63)


def sample(logits: torch.Tensor, samplers: list[Sampler]) -> list[int]:
    """The next token of each row of `logits` ([B, vocab], float32)."""
    choice = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(samplers) if not s.greedy]
    if not rows:
        return choice.tolist()
    picked = [samplers[i] for i in rows]
    device = logits.device
    sub = logits[rows] / torch.tensor([s.temperature for s in picked], device=device)[:, None]
    sorted_logits, order = sub.sort(dim=-1, descending=True)
    vocab = sub.shape[-1]
    rank = torch.arange(vocab, device=device)[None, :]
    top_k = torch.tensor([s.top_k or vocab for s in picked], device=device)[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k, float("-inf"))
    top_p = torch.tensor([s.top_p for s in picked], device=device)[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
    before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill((before >= top_p) & (rank > 0), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    for j, (i, s) in enumerate(zip(rows, picked)):
        k = torch.multinomial(probs[j], 1, generator=s.generator)
        choice[i] = order[j, k[0]]
    return choice.tolist()
