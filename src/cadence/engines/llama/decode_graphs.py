"""CUDA graphs for decode-only steps: one captured graph per (batch, cache width) bucket.

A decode step of a small model on a GPU is mostly kernel launches: dozens per layer, each
costing CPU time that dwarfs the work. A CUDA graph records one step's launches once and
replays them with one call. A graph has fixed shapes and fixed buffer addresses, so each
bucket owns static input tensors; a step whose batch and cache width fit a bucket is padded
up to it:

- the batch to the next power of two (1, 2, 4, ... up to `--cuda-graph-batch`);
- the cache blocks per sequence to the next power of two, so that attention gathers no more
  than twice what the longest sequence holds.

Padding rows decode token 0 at position 0 and write their key and value to a scratch block
that the cache never hands to a sequence; their logits are dropped. Real rows' unused block
columns point at block 0 and are masked out, as in the eager path. Steps with prefill, a
batch or width beyond the largest bucket, or tensor parallelism run eagerly.

Graphs are captured lazily, the first time a bucket is needed, and at most `max_graphs` of
them; warm-up captures the batch buckets at the smallest width. With `capture=False` (CPU,
and the tests) the padded step runs eagerly instead, which checks the padding and masking
that the graphs replay.
"""

from __future__ import annotations

import logging

import torch

from cadence.engines.llama.kv_cache import KVCache
from cadence.engines.llama.model import LlamaModel
from cadence.engines.llama.plan import StepInputs

log = logging.getLogger("cadence.torch")

_MIN_WIDTH = 4
"""Smallest bucket of cache blocks per sequence (64 tokens with 16-token blocks)."""


def _bucket(n: int, lowest: int = 1) -> int:
    size = lowest
    while size < n:
        size *= 2
    return size


class _Bucket:
    """Static inputs of one (batch, width) shape, and its graph once captured."""

    def __init__(
        self, batch: int, width: int, block_size: int, scratch: int, device: torch.device
    ) -> None:
        slots = width * block_size
        self.batch = batch
        self.scratch_block, self.scratch_slot = scratch, scratch * block_size
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=device)
        self.write_index = torch.full((batch,), self.scratch_slot, dtype=torch.int64, device=device)
        self.blocks = torch.full((batch, width), scratch, dtype=torch.int64, device=device)
        self.mask = torch.zeros(batch, 1, 1, slots, dtype=torch.bool, device=device)
        self.mask[..., 0] = True  # a padding row attends to its own scratch slot
        self.inputs = StepInputs(
            tokens=self.tokens,
            positions=self.positions,
            write_index=self.write_index,
            prefill_count=0,
            prefill_tokens=0,
            prefill_pad_index=None,
            prefill_width=0,
            prefill_mask=None,
            decode_count=batch,
            decode_blocks=self.blocks,
            decode_mask=self.mask,
            last_index=torch.arange(batch, device=device),
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def load(self, step: StepInputs) -> None:
        """Copy a decode step's inputs in; the rows past it become padding again."""
        # A decode step (decode_count > 0) always carries its blocks and mask (plan.unpack).
        assert step.decode_blocks is not None and step.decode_mask is not None
        n, wd = step.decode_count, step.decode_blocks.shape[1]
        self.tokens[:n].copy_(step.tokens)
        self.positions[:n].copy_(step.positions)
        self.write_index[:n].copy_(step.write_index)
        self.blocks[:n, :wd].copy_(step.decode_blocks)
        self.blocks[:n, wd:] = 0
        used = step.decode_mask.shape[-1]
        self.mask[:n, ..., :used].copy_(step.decode_mask)
        self.mask[:n, ..., used:] = False
        if n < self.batch:
            self.tokens[n:] = 0
            self.positions[n:] = 0
            self.write_index[n:] = self.scratch_slot
            self.blocks[n:] = self.scratch_block
            self.mask[n:] = False
            self.mask[n:, ..., 0] = True


class DecodeGraphs:
    """Runs decode-only steps through padded, static-shape buckets (see the module docstring)."""

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        *,
        max_batch: int,
        capture: bool,
        max_graphs: int = 64,
    ) -> None:
        self._model = model
        self._cache = cache
        self.max_batch = _bucket(max(1, max_batch))
        self.max_width = _bucket(-(-model.context // cache.block_size), _MIN_WIDTH)
        self._capture = capture
        self._max_graphs = max_graphs
        self.scratch_block = cache.take_scratch_block()
        """The cache block padding rows write to; no sequence ever gets it."""
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool: torch.cuda._POOL_HANDLE | None = None
        self.failed = False
        """A capture failed once: every later step runs eagerly (logged once)."""
        self.replays = 0
        """Steps run through a bucket (replayed graphs, or padded eager steps)."""

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The (batch, width) buckets made so far, sorted."""
        return sorted(self._buckets)

    def fits(self, step: StepInputs) -> bool:
        """Whether this step can go through a bucket."""
        if self.failed or step.prefill_count != 0 or not 0 < step.decode_count <= self.max_batch:
            return False
        # A decode step (decode_count > 0) always carries its blocks (plan.unpack).
        assert step.decode_blocks is not None
        return step.decode_blocks.shape[1] <= self.max_width

    def warm_up(self) -> None:
        """Capture every batch bucket at the smallest width (the common case: short contexts)."""
        batch = 1
        while batch <= self.max_batch and not self.failed:
            self._get(batch, _MIN_WIDTH)
            batch *= 2

    def run(self, step: StepInputs) -> torch.Tensor | None:
        """Logits [decode_count, vocab] of a step that `fits`."""
        n = step.decode_count
        assert step.decode_blocks is not None  # a step that fits is a decode step
        bucket = self._get(_bucket(n), _bucket(step.decode_blocks.shape[1], _MIN_WIDTH))
        if bucket is None:
            return self._model.forward(step, self._cache)
        bucket.load(step)
        self.replays += 1
        if bucket.graph is None:
            logits = self._model.forward(bucket.inputs, self._cache)
        else:
            bucket.graph.replay()
            logits = bucket.logits
        return None if logits is None else logits[:n]

    def _get(self, batch: int, width: int) -> _Bucket | None:
        key = (batch, width)
        bucket = self._buckets.get(key)
        if bucket is not None:
            return bucket
        if len(self._buckets) >= self._max_graphs:
            return None
        bucket = _Bucket(
            batch, width, self._cache.block_size, self.scratch_block, self._model.device
        )
        if self._capture:
            try:
                self._record(bucket)
            except Exception as exc:
                self.failed = True
                # A capture that fails in capture_end leaves its stream current; eager steps
                # must run on the default stream again.
                torch.cuda.set_stream(torch.cuda.default_stream(self._model.device))
                log.warning("CUDA graph capture failed (%r); decode steps run without graphs", exc)
                return None
        self._buckets[key] = bucket
        return bucket

    def _record(self, bucket: _Bucket) -> None:
        # The documented recipe: warm up on a side stream (lazy initialisation, autotuning),
        # then capture on the graph's own stream; every graph shares one memory pool.
        model, cache = self._model, self._cache
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model.forward(bucket.inputs, cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.logits = model.forward(bucket.inputs, cache)
        bucket.graph = graph
