"""A paged KV cache: fixed-size blocks of token slots, handed to sequences and taken back.

The cache is allocated once, at start-up, with a stated capacity in tokens. A sequence gets
every block it can need (prompt + max_tokens) when it is admitted, so a running sequence
never runs out of room; a sequence that cannot get its blocks waits in the scheduler's queue
until others finish (or, with --preempt, a lower-priority one is preempted and recomputed
later). Blocks come back the moment a sequence finishes or is cancelled.

Prefix caching (--prefix-caching): a block whose slots are all written is registered under
the chained hash of its tokens (cadence.prefix_hash: its own and every one before it). A
later sequence whose prompt starts with the same tokens takes those blocks as they are,
read-only (`match`; it writes only past them), and prefills the rest. Each block counts the
sequences that hold it; one that none holds keeps its contents and its hash, in LRU order,
until a sequence needs a block and the free list is empty (`allocate` evicts the least
recently released first).

Keys and values are stored per layer as [slots, kv_heads, head_dim], slot = block *
block_size + offset; attention reads a sequence's past by gathering its blocks.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from cadence.wording import counted


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
            raise ValueError(f"the KV cache must hold at least {counted(block_size, 'token')}")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self.capacity_tokens = self.num_blocks * block_size
        """Tokens the cache holds, all sequences together (rounded down to whole blocks)."""
        slots = self.capacity_tokens
        self.keys = [
            torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(layers)
        ]
        self.values = [
            torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(layers)
        ]
        # Popped from the end: the lowest-numbered blocks go out first.
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._refs = [0] * self.num_blocks
        """Sequences holding each block."""
        self._by_hash: dict[bytes, int] = {}
        """Registered full blocks by the chained hash of their tokens."""
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Registered blocks no sequence holds, least recently released first."""

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
        """Token slots not held by any sequence (cached prefixes none holds included)."""
        return (len(self._free) + len(self._evictable)) * self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold `tokens` tokens."""
        return -(-tokens // self.block_size)

    def allocate(self, tokens: int) -> list[int] | None:
        """Blocks for `tokens` tokens, or None (and nothing taken) when too few are free;
        cached prefixes that no sequence holds are evicted for them, oldest first."""
        return self.allocate_blocks(self.blocks_for(tokens))

    def allocate_blocks(self, need: int) -> list[int] | None:
        free = self._free
        short = need - len(free)
        if short > len(self._evictable):
            return None
        cut = len(free) - min(need, len(free))
        taken = free[cut:]
        del free[cut:]
        taken.reverse()
        if short > 0:
            evictable, by_hash, hash_of = self._evictable, self._by_hash, self._hash_of
            for _ in range(short):
                block, _ = evictable.popitem(last=False)
                del by_hash[hash_of.pop(block)]
                taken.append(block)
            # In address order, as the free list's are: evicted blocks come in the order
            # they were released (a sequence's last first, sequences interleaved), and
            # attention gathers a sequence's blocks in table order.
            taken.sort()
        refs = self._refs
        for block in taken:
            refs[block] = 1
        return taken

    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest leading run of `hashes`, now held by the caller
        (one more holder each; `free` gives them back)."""
        by_hash, refs, evictable = self._by_hash, self._refs, self._evictable
        found = []
        for h in hashes:
            block = by_hash.get(h)
            if block is None:
                break
            if not refs[block]:
                del evictable[block]
            refs[block] += 1
            found.append(block)
        return found

    def register(self, block: int, block_hash: bytes) -> None:
        """`block`'s slots are all written and hold the tokens `block_hash` names; later
        sequences may share it. A hash another block holds already stays with that one."""
        if block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash

    def forget_prefixes(self) -> None:
        """Unregister every cached prefix (after warm-up: its throw-away prompts)."""
        for block in self._evictable:
            self._free.append(block)
        self._evictable.clear()
        self._by_hash.clear()
        self._hash_of.clear()

    def free(self, blocks: list[int]) -> None:
        """Give a sequence's blocks back; a registered one none holds stays cached. The
        last blocks go first, so a prefix's tail is evicted before its head."""
        refs, hashed = self._refs, self._hash_of
        for block in reversed(blocks):
            refs[block] -= 1
            if refs[block]:
                continue
            if block in hashed:
                self._evictable[block] = None
            else:
                self._free.append(block)

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one cached token takes on one rank (keys and values, every layer)."""
        return 2 * layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
