"""The decode batch of `--engine transformers` (cadence.engines.transformers_model): the KV
caches of the sequences it steps, one row each, in one transformers `DynamicCache`.

transformers has no call that stacks per-sequence caches into a batch or splits one back, so
this module does it over the cache's layers. Rows are left-padded to the longest: row `i`
holds its sequence's keys and values in the last columns, its attention-mask row has ones
there, and its position id is its own length. Padding shifts a row's query and its keys by
the same number of columns, so a sliding-window layer's window (a distance in columns) still
covers the row's own last tokens; such a layer keeps only the last `window - 1` columns, as
transformers' does. Layer kinds whose mask depends on absolute positions (chunked attention)
or that keep other state (linear attention, shared or quantized layers) are refused when the
model loads (`unsupported_layers`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.cache_utils import get_layer_types_and_kwargs

BATCHABLE_LAYERS = ("full_attention", "sliding_attention")


def unsupported_layers(config) -> list[str]:
    """The model's cache layer kinds that rows cannot hold (empty: all can)."""
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return sorted({t for t in layer_types if t not in BATCHABLE_LAYERS})


def new_cache(config) -> DynamicCache:
    """An empty cache for one sequence's prefill, laid out as transformers lays it out."""
    return DynamicCache(config=config)


class Rows:
    """The running sequences' caches as one left-padded batch (see the module docstring).

    `sources[i]` is where row `i` is copied from: a cache and its row there (a sequence's own
    prefill cache at row 0, or a row of the previous batch); `lengths[i]` its tokens."""

    __slots__ = ("cache", "mask", "positions", "width")

    def __init__(self, config, sources: list[tuple[DynamicCache, int]],
                 lengths: list[int]) -> None:
        width = max(lengths)
        cache = new_cache(config)
        first = sources[0][0]
        if not cache.layers:  # a config without layer kinds: transformers adds layers lazily
            cache.layers = [DynamicLayer() for _ in first.layers]
        for index, layer in enumerate(cache.layers):
            sliding = type(layer) is DynamicSlidingWindowLayer
            keep = min(width, layer.sliding_window - 1) if sliding else width
            keys = _stack([(c.layers[index].keys, r) for c, r in sources], lengths, keep)
            values = _stack([(c.layers[index].values, r) for c, r in sources], lengths, keep)
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            if sliding:
                layer.cumulative_length = width
        device = first.layers[0].keys.device
        self.cache = cache
        self.width = width
        """Columns of every row, padding included: the cache's length to transformers."""
        self.mask = torch.zeros((len(lengths), width + 1), dtype=torch.long, device=device)
        """The attention mask of the next forward: the rows' tokens and the new one."""
        for i, n in enumerate(lengths):
            self.mask[i, width - n:] = 1
        self.positions = torch.tensor(lengths, device=device)[:, None]
        """Each row's next position id: its own length."""

    def advanced(self) -> None:
        """The forward appended one token to every row."""
        self.width += 1
        self.positions += 1
        self.mask = torch.nn.functional.pad(self.mask, (0, 1), value=1)

    def row_cache(self, config, row: int, length: int) -> DynamicCache:
        """Row `row` (of `length` tokens) copied out as a cache of its own, without padding
        (a sequence leaving the batch but not released: paused)."""
        cache = new_cache(config)
        if not cache.layers:
            cache.layers = [DynamicLayer() for _ in self.cache.layers]
        for layer, source in zip(cache.layers, self.cache.layers):
            sliding = type(layer) is DynamicSlidingWindowLayer
            keep = min(length, layer.sliding_window - 1) if sliding else length
            keys = source.keys[row:row + 1, :, source.keys.shape[2] - keep:].clone()
            values = source.values[row:row + 1, :, source.values.shape[2] - keep:].clone()
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            if sliding:
                layer.cumulative_length = length
        return cache


def _stack(tensors: list[tuple[torch.Tensor, int]], lengths: list[int],
           keep: int) -> torch.Tensor:
    """Each row's last min(length, keep) columns, right-aligned in zeros: [rows, heads, keep,
    dim]."""
    sample = tensors[0][0]
    out = sample.new_zeros((len(tensors), sample.shape[1], keep, sample.shape[3]))
    for i, ((tensor, row), n) in enumerate(zip(tensors, lengths)):
        take = min(n, keep)
        out[i, :, keep - take:] = tensor[row, :, tensor.shape[2] - take:]
    return out
