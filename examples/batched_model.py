"""A batched model to copy: a byte-level bigram model in numpy, stepped as a batch.

cadence calls `step(prefill, decode)` once per engine step with every running sequence: the
new ones to prefill, the others to decode. This model keeps each sequence's last token in a
slot of one array (its "KV cache"), so a step is one gather and one vectorized sample for the
whole batch, however many sequences there are.

    cadence serve --engine examples.batched_model:BigramModel --devices cpu:2
    python examples/batched_model.py                       # the same, from Python
    cadence generate "The stream" --max-tokens 80

See docs/models.md for the contract.
"""

from __future__ import annotations

import numpy as np

import cadence

_TEXT = (
    "The stream carries each token to the client as soon as the step makes it. A batch of "
    "sequences shares every step of the model, so the card does the work of many at once. "
    "When a client cancels, the sequence leaves the batch at the next step and its slot is free. "
)


class BigramModel:
    """Next byte ~ P(next | last byte), counted from a short text."""

    max_batch = 256
    """Slots in the state array: at most this many sequences run at once."""

    def __init__(self, device: str) -> None:
        # Load weights on this worker's device here; `device` is "cpu" or "cuda:N".
        data = np.frombuffer(_TEXT.encode(), dtype=np.uint8)
        counts = np.ones((256, 256))  # add-one smoothing
        np.add.at(counts, (data[:-1], data[1:]), 1000.0)
        self.log_probs = np.log(counts / counts.sum(axis=1, keepdims=True))
        self.last = np.zeros(self.max_batch, dtype=np.int64)
        """Each slot's last token: the per-sequence state a real model keeps in its KV cache."""
        self.free = list(range(self.max_batch))
        self.rng = np.random.default_rng(0)

    def check(self, seq: cadence.Sequence) -> str | None:
        """Refuse what this model cannot run (INVALID_ARGUMENT, with this message)."""
        return None if seq.prompt_token_ids else "the prompt is empty"

    def reserve(self, seq: cadence.Sequence) -> bool:
        """Claim a slot just before the sequence is admitted; False: it waits for one."""
        if not self.free:
            return False
        seq.state = self.free.pop()
        return True

    def step(self, prefill: list[cadence.Sequence], decode: list[cadence.Sequence]) -> list[int]:
        for seq in prefill:  # "prefill": read the prompt into the sequence's slot
            self.last[seq.state] = seq.prompt_token_ids[-1]
        batch = prefill + decode
        slots = np.fromiter((seq.state for seq in batch), dtype=np.int64, count=len(batch))
        temperature = np.fromiter(
            (seq.sampling.temperature for seq in batch), dtype=np.float64, count=len(batch)
        )
        logits = self.log_probs[self.last[slots]]
        # Gumbel-max sampling, greedy where temperature is 0: one pass for the whole batch.
        noise = self.rng.gumbel(size=logits.shape) * temperature[:, None]
        tokens = np.argmax(logits + noise, axis=1)
        self.last[slots] = tokens
        return tokens.tolist()  # one token id per sequence, in prefill + decode order

    def release(self, seq: cadence.Sequence) -> None:
        """The sequence finished or was cancelled: give its slot back."""
        self.free.append(seq.state)


if __name__ == "__main__":  # workers import this file: keep serve() under the guard
    cadence.serve(BigramModel, devices="cpu:2", port=50051)
