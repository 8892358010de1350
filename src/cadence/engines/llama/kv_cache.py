"""A paged KV cache: fixed-size blocks of token slots, handed to sequences and taken back.

The cache is allocated once, at start-up, with a stated capacity in tokens. A sequence gets
every block it can need (prompt + max_tokens) when it is admitted, so a running sequence
never runs out of room and nothing is ever evicted or recomputed; a sequence that cannot get
its blocks waits in the scheduler's queue until others finish. Blocks come back the moment a
sequence finishes or is cancelled.

Keys and values are stored per layer as [slots, kv_heads, head_dim], slot = block *
block_size + offset; attention reads a sequence's past by gathering its blocks.
"""

from __future__ import annotations

import torch


class KVCache:
    """Key/value tensors for every layer plus the free list of their blocks."""

    def __init__(
        self,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        capacity_tokens: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if capacity_tokens < block_size:
            raise ValueError(f"the KV cache must hold at least {block_size} tokens")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self.capacity_tokens = self.num_blocks * block_size
        """Tokens the cache holds, all sequences together (rounded down to whole blocks)."""
        slots = self.capacity_tokens
        self.keys = [torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        # Popped from the end: the lowest-numbered blocks go out first.
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def take_scratch_block(self) -> int:
        """One block out of the pool for good (padding rows write there); the capacity shrinks
        by it, so admission never waits for a block that will not come back."""
        if len(self._free) < 2:
            raise ValueError("the KV cache is too small to spare a scratch block")
        self.capacity_tokens -= self.block_size
        return self._free.pop()

    @property
    def usage(self) -> float:
        """The share of the cache's capacity that sequences hold, 0 to 1."""
        return 1.0 - self.free_tokens / self.capacity_tokens

    @property
    def free_tokens(self) -> int:
        """Token slots not held by any sequence."""
        return len(self._free) * self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold `tokens` tokens."""
        return -(-tokens // self.block_size)

    def allocate(self, tokens: int) -> list[int] | None:
        """Blocks for `tokens` tokens, or None (and nothing taken) when too few are free."""
        need = self.blocks_for(tokens)
        if need > len(self._free):
            return None
        taken = self._free[len(self._free) - need :]
        del self._free[len(self._free) - need :]
        taken.reverse()
        return taken

    def free(self, blocks: list[int]) -> None:
        """Give a sequence's blocks back."""
        self._free.extend(reversed(blocks))

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one cached token takes on one rank (keys and values, every layer)."""
        return 2 * layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
