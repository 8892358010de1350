"""One batched step function, and every way benchmarks/batched_side_by_side.py serves it.

`StepFunction` is a toy decoder step in numpy on the CPU whose cost is a fixed part plus a part
per sequence, as a card's decode step is: the step's input is FIXED_ROWS rows of its own (the
fixed part) and one row per sequence (its last token's embedding), through two D x D
matmuls; each sequence's next token is a letter (byte ids 97..122, so every server streams
plain text). Everything that serves it here imports only numpy at the top, so each peer's
own venv can import this module:

- `StepModel`: cadence's step API (`step(prefill, decode)`, docs/models.md);
- `GeneratorModel`: cadence's batch-generator shape (`generate_stream(batch)`);
- `per_request`: a cadence `--app` function, one request per generator (batch of one);
- `step_loop`: the limit, the function called in a loop with no server.

BLAS threads are set to 1 before numpy loads (OMP_NUM_THREADS etc. in the servers' env): the
step runs on one core in every server, so the servers differ only in how they serve it.
"""

from __future__ import annotations

import time

import numpy as np

D = 512
FIXED_ROWS = 480
"""The step's fixed cost, in rows of the per-sequence work."""
LETTERS = 26
FIRST = 97  # "a"


class StepFunction:
    """`next_tokens(last)`: one step of a batch, `last` each sequence's last letter (0..25)."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.embed = rng.standard_normal((LETTERS, D), dtype=np.float32)
        self.weight = rng.standard_normal((D, D), dtype=np.float32) / 16
        self.fixed = rng.standard_normal((FIXED_ROWS, D), dtype=np.float32)

    def next_tokens(self, last: np.ndarray) -> np.ndarray:
        x = np.concatenate([self.fixed, self.embed[last]])
        h = np.tanh(x @ self.weight) @ self.weight
        return h[FIXED_ROWS:, :LETTERS].argmax(1)

    def step(self, last: list[int]) -> list[int]:
        """Token ids (bytes of letters) for sequences whose last letters are `last`."""
        return (self.next_tokens(np.asarray(last, dtype=np.int64)) + FIRST).tolist()


def first_letter(prompt: str | list[int]) -> int:
    """A sequence's state before its first step: a letter from its prompt."""
    if isinstance(prompt, str):
        prompt = list(prompt.encode())
    return (sum(prompt) if prompt else 0) % LETTERS


def step_loop(batch: int, steps: int) -> dict:
    """The limit: the function alone, `batch` sequences for `steps` steps."""
    fn = StepFunction()
    last = [i % LETTERS for i in range(batch)]
    for _ in range(5):
        fn.step(last)
    start = time.perf_counter()
    for _ in range(steps):
        last = [t - FIRST for t in fn.step(last)]
    elapsed = time.perf_counter() - start
    return {
        "batch": batch,
        "step_ms": elapsed / steps * 1e3,
        "tokens_per_s": batch * steps / elapsed,
    }


class StepModel:
    """cadence's step API."""

    def __init__(self, device: str) -> None:
        self.fn = StepFunction()

    def step(self, prefill: list, decode: list) -> list[int]:
        for seq in prefill:
            seq.state = first_letter(seq.prompt_token_ids)
        batch = prefill + decode
        tokens = self.fn.step([seq.state for seq in batch])
        for seq, token in zip(batch, tokens):
            seq.state = token - FIRST
        return tokens


class GeneratorModel:
    """cadence's batch-generator shape: the note's `for out in model.generate_stream(batch)`."""

    def __init__(self, device: str) -> None:
        self.fn = StepFunction()

    def generate_stream(self, batch: list):
        last = [first_letter(seq.prompt_token_ids) for seq in batch]
        while True:
            tokens = self.fn.step(last)
            last = [t - FIRST for t in tokens]
            yield tokens


_FN: StepFunction | None = None


def per_request(request, context):
    """cadence `--app`: one request per generator, so every step is a batch of one."""
    global _FN
    if _FN is None:
        _FN = StepFunction()
    last = first_letter(request.prompt_token_ids)
    for _ in range(request.max_tokens):
        token = _FN.step([last])[0]
        last = token - FIRST
        yield [token]
