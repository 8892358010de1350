"""A timing model of a real engine, with no tensor work.

It isolates the serving layer: a step takes what a card would take (a base decode time, a
cost per sequence in the batch, a prefill cost per prompt token, optional jitter and a slow
first step), and every sequence gets one token per step. Tokens are bytes of a pseudo-text
built from the seed, read from the start of a word that depends on the prompt and seeds, so
output is readable and the same prompt with the same seeds gives the same tokens.

With prefix caching it models the torch engine's: the chained hashes of every sequence's
full blocks of 16 tokens (prompt and outputs) are remembered when it ends, up to
--kv-cache-tokens of them in LRU order, and a later prompt that starts with remembered blocks
prefills only the rest (the cached tokens cost no time). It holds no memory per token, so
its batch is never refused for cache room; `preempt` only restarts a sequence's prefill.
"""

from __future__ import annotations

import random
import time
import zlib
from bisect import bisect_left

from cadence.byte_tokenizer import ByteTokenizer
from cadence.config import EngineConfig
from cadence.engines.base import Sequence
from cadence.prefix_hash import BLOCK, BlockLRU, block_hashes
from cadence.vocabulary import AddRequest

_WORDS = (
    "the a stream token card batch step model latency queue buffer client server worker "
    "engine cadence first gap tail each every new piece moment output rhythm network side "
    "request response send read wait merge slot time fast slow steady bound context cancel"
).split()
_CORPUS_BYTES = 1 << 16


def _corpus(seed: int) -> bytes:
    rng = random.Random(seed)
    out = bytearray()
    while len(out) < _CORPUS_BYTES:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 14)))
        out += sentence.capitalize().encode() + b". "
    return bytes(out[:_CORPUS_BYTES])


_SPIN_S = 0.0005
"""The last half millisecond of a step is spun, not slept: time.sleep overshoots by 0.1-0.4
ms on a busy host, and a card's step does not, so sleeping alone made every modelled step
longer than asked and the lab's ITL with it (the served step's p50 against --step-ms is in
`results/lab_error.json`)."""


def _wait_until(deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining > _SPIN_S:
        time.sleep(remaining - _SPIN_S)
    while time.monotonic() < deadline:
        pass


def _place(seq: Sequence) -> int:
    """The sequence's first output's place in the corpus (its `state`, set at its prefill)."""
    place = seq.state
    assert isinstance(place, int)
    return place


class SyntheticEngine:
    """Steps take modelled time; see EngineConfig for the knobs."""

    name = "synthetic"
    vocab_size = ByteTokenizer.vocab_size
    takes_prefill_chunks = True
    """A chunk of k prompt tokens costs k x prefill_ms_per_token in its step."""

    def __init__(self, config: EngineConfig, worker: int = 0) -> None:
        self._config = config
        self._rng = random.Random(config.seed)
        self._corpus = _corpus(config.seed)
        self._word_starts = [
            0,
            *(i + 1 for i, byte in enumerate(self._corpus[:-1]) if byte == 0x20),
        ]
        """Where words begin: a sequence's text starts at one, not mid-word."""
        self._first_step = True
        by_worker = config.step_ms_by_worker
        self._step_s = (by_worker[worker % len(by_worker)] if by_worker else config.step_ms) / 1e3
        self._per_seq_s = config.per_seq_ms / 1e3
        self._prefill_s = config.prefill_ms_per_token / 1e3
        self._jitter_s = config.jitter_ms / 1e3
        self._prefixes = (
            BlockLRU(config.kv_cache_tokens // BLOCK) if config.prefix_caching else None
        )
        """Prefix caching: the block hashes held."""
        gbps = config.handoff_gbps
        self._handoff_s_per_token = config.handoff_bytes_per_token / (gbps * 1e9) if gbps else 0.0
        """Disaggregated serving: what moving one prompt token's state costs (export_state)."""

    def start(self) -> None:
        """Nothing to load."""

    def check(self, request: AddRequest) -> str | None:
        """Every prompt of byte tokens is acceptable."""
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"prompt_token_ids must be in [0, {self.vocab_size}); got {bad[0]}"
        return None

    def step(self, prefill: list[Sequence], decode: list[Sequence]) -> list[int]:
        """Produce one token per sequence once the modelled step time has passed."""
        start = time.monotonic()
        duration = self._step_s + self._per_seq_s * (len(prefill) + len(decode))
        if self._first_step:
            duration += self._config.first_step_ms / 1e3
            self._first_step = False
        if self._jitter_s:
            duration = max(0.0, duration + self._rng.gauss(0.0, self._jitter_s))
        corpus = self._corpus
        size = len(corpus)
        for seq in prefill:
            duration += self._prefill_s * (seq.prefill_to - seq.prefilled)
            if seq.state is None:
                key = bytes(seq.prompt_token_ids) + f"|{seq.sampling.seed}".encode()
                starts = self._word_starts
                k = bisect_left(starts, zlib.crc32(key, self._config.seed) % size)
                seq.state = starts[k % len(starts)]
        tokens = [corpus[(_place(s) + s.generated) % size] for s in prefill]
        tokens += [corpus[(_place(s) + s.generated) % size] for s in decode]
        _wait_until(start + duration)
        return tokens

    def reserve(self, seq: Sequence) -> bool:
        """Always room; with prefix caching, `seq.prefilled` is set to the leading tokens of
        its remembered blocks (never the last token)."""
        held = self._prefixes
        if held is not None:
            ids = seq.prefill_ids
            hashes = block_hashes(ids, BLOCK, (len(ids) - 1) // BLOCK)
            seq.prefilled = held.match(hashes, touch=True) * BLOCK
        return True

    def preempt(self, seq: Sequence) -> list[int]:
        """The sequence's tokens so far, to prefill again (its outputs are re-derived from
        its place in the corpus, which it keeps)."""
        return seq.request.prompt_token_ids + self._outputs(seq)

    def export_state(self, seq: Sequence) -> bytes:
        """Disaggregated serving: the sequence's state, after the time its KV cache would take
        to move (its tokens x --handoff-bytes-per-token over --handoff-gbps, waited here: a
        real engine copies the state out before it can send it). The bytes sent are only the
        sequence's place in the corpus."""
        tokens = len(seq.request.prompt_token_ids) + seq.generated
        if self._handoff_s_per_token:
            _wait_until(time.monotonic() + tokens * self._handoff_s_per_token)
        return _place(seq).to_bytes(8, "little")

    def import_state(self, seq: Sequence, data: bytes) -> bool:
        """Take a sequence another worker prefilled: it goes on from its place (always
        room: this engine holds no memory per token)."""
        seq.state = int.from_bytes(data, "little")
        return True

    def release(self, seq: Sequence) -> None:
        """Remember the sequence's blocks (prefix caching)."""
        held = self._prefixes
        if held is None or seq.state is None:
            return
        tokens = seq.request.prompt_token_ids + self._outputs(seq)
        held.record(block_hashes(tokens, BLOCK, len(tokens) // BLOCK))

    def _outputs(self, seq: Sequence) -> list[int]:
        if not seq.generated:  # (nothing to place: a sequence not yet stepped has no state)
            return []
        corpus, size, at = self._corpus, len(self._corpus), _place(seq)
        return [corpus[(at + i) % size] for i in range(seq.generated)]
