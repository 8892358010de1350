"""What the front remembers of each worker's prefix cache: the block hashes of the prompts
it sent there, most recent last, as many as the worker's cache holds (`--kv-cache-tokens`).

An approximation kept without asking the workers: a worker may have evicted a prefix that the
index still names (the next request there computes it again and it is cached anew), and with
`--fronts N` each front knows only the prompts it routed itself.
"""

from __future__ import annotations

from cadence.prefix_hash import BLOCK, BlockLRU, block_hashes

TEXT_BLOCK = 64
"""Bytes of a text prompt per hashed block, for a worker that tokenizes text itself."""


def prompt_hashes(token_ids: list[int], text: str, limit_blocks: int) -> list[bytes]:
    """The prompt's block hashes: of its token ids, or of its UTF-8 text when the worker
    tokenizes (the front has no ids then)."""
    if token_ids:
        return block_hashes(token_ids, BLOCK, limit_blocks)
    return block_hashes(text.encode(), TEXT_BLOCK, limit_blocks)


class PrefixIndex:
    """Per worker, an LRU set of block hashes."""

    def __init__(self, workers: int, capacity_blocks: int) -> None:
        self.capacity = max(1, capacity_blocks)
        self._held = [BlockLRU(self.capacity) for _ in range(workers)]

    def match(self, worker: int, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` that `worker` was sent before."""
        return self._held[worker].match(hashes)

    def record(self, worker: int, hashes: list[bytes]) -> None:
        """`worker` now holds these blocks (the oldest held are forgotten past capacity)."""
        self._held[worker].record(hashes)

    def forget(self, worker: int) -> None:
        """The worker stopped: its cache is gone."""
        self._held[worker].clear()
