"""Chained hashes of a token sequence's blocks: the key of a cached prefix.

Block i's hash covers its own tokens and, through the hash of block i - 1, every token
before it, so two sequences share block i's hash only when they agree on their first
(i + 1) * block tokens. The torch engine's prefix cache keys KV blocks by it, the synthetic
engine models that cache with it, and the front's prefix-aware routing remembers the
prompts each worker was sent by it. BLAKE2b, 128 bits: a collision would serve one prompt
another's keys and values, so not Python's 64-bit `hash`.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from hashlib import blake2b

ROOT = b""
"""The parent hash of a sequence's first block."""
BLOCK = 16
"""Tokens per block: the torch engine's KV-cache page, and so the unit of a cached prefix for
the synthetic engine's model of that cache and for prefix-aware routing."""


def block_hashes(
    tokens: list[int] | bytes, block: int, blocks: int, parent: bytes = ROOT
) -> list[bytes]:
    """The chained hashes of the first `blocks` full blocks of `tokens` (fewer if it is
    shorter), `parent` being the hash of the block before the first."""
    blocks = min(blocks, len(tokens) // block)
    out = []
    for i in range(blocks):
        piece = tokens[i * block : (i + 1) * block]
        data = piece if isinstance(piece, bytes) else array("q", piece).tobytes()
        parent = blake2b(parent + data, digest_size=16).digest()
        out.append(parent)
    return out


class BlockLRU:
    """A set of block hashes held, least recently used first, at most `capacity` of them:
    what a prefix cache holds (the synthetic engine's model of the torch engine's), or what
    the front believes a worker's holds (prefix-aware routing)."""

    __slots__ = ("_held", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._held: OrderedDict[bytes, None] = OrderedDict()

    def match(self, hashes: list[bytes], touch: bool = False) -> int:
        """How many leading blocks of `hashes` are held (`touch`: made the most recent)."""
        held = self._held
        n = 0
        for h in hashes:
            if h not in held:
                break
            if touch:
                held.move_to_end(h)
            n += 1
        return n

    def record(self, hashes: list[bytes]) -> None:
        """These blocks are held now (the oldest forgotten past capacity). The first block is
        made the most recent: a prefix's tail is forgotten before its head, which every later
        block needs."""
        held = self._held
        for h in reversed(hashes):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def clear(self) -> None:
        self._held.clear()
