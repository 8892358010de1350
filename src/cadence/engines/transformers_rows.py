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

from collections.abc import Callable
from functools import partial

import torch
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

BATCHABLE_LAYERS = ("full_attention", "sliding_attention")


def unsupported_layers(config) -> list[str]:
    """The model's cache layer kinds that rows cannot hold (empty: all can)."""
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return sorted({t for t in layer_types if t not in BATCHABLE_LAYERS})


def zero_padding(cache: DynamicCache, mask: torch.Tensor) -> None:
    """Zero the keys and values of a left-padded prefill's padding columns (`mask` 0): the
    forward computed something there, possibly NaN, and a masked column is still multiplied
    by its attention weight of 0 in later forwards."""
    for layer in cache.layers:
        keys, values = _tensors(layer)
        columns = keys.shape[2]
        padding = (mask[:, -columns:] == 0)[:, None, :, None]
        keys.masked_fill_(padding, 0)
        values.masked_fill_(padding, 0)


def _layer_part(index: int, part: int, cache: DynamicCache) -> torch.Tensor:
    """Layer `index`'s keys (`part` 0) or values (1) in `cache`."""
    return _tensors(cache.layers[index])[part]


def _tensors(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled layer's keys and values. Rows hold dynamic attention layers only (the others
    are refused when the model loads: `unsupported_layers`)."""
    assert isinstance(layer, DynamicLayer) and layer.keys is not None and layer.values is not None
    return layer.keys, layer.values


def new_cache(config, layers: int = 0) -> DynamicCache:
    """An empty cache laid out as transformers lays it out; for a config without layer kinds
    (transformers then adds layers lazily), `layers` plain ones to fill by hand."""
    cache = DynamicCache(config=config)
    if not cache.layers and layers:
        cache.layers = [DynamicLayer() for _ in range(layers)]
    return cache


def _fill(layer, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
    """Make `layer` hold `keys` and `values` for a row (or rows) of `length` tokens."""
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    if type(layer) is DynamicSlidingWindowLayer:
        layer.cumulative_length = length


def _kept(layer, length: int) -> int:
    """Columns `layer` keeps of `length` tokens: a sliding window keeps its last window - 1."""
    if type(layer) is DynamicSlidingWindowLayer:
        return min(length, layer.sliding_window - 1)
    return length


class Rows:
    """The running sequences' caches as one left-padded batch (see the module docstring), its
    padding zeros.

    `sources[i]` is where row `i` is copied from: a cache and its row there (a sequence's own
    prefill cache at row 0, or a row of the previous batch); `lengths[i]` its tokens."""

    __slots__ = ("cache", "mask", "positions", "width")

    def __init__(self, config, sources: list[tuple[DynamicCache, int]], lengths: list[int]) -> None:
        width = max(lengths)
        first = sources[0][0]
        cache = new_cache(config, len(first.layers))
        device = _tensors(first.layers[0])[0].device
        gather = _Gather(sources, device)
        lengths_t = torch.tensor(lengths, device=device)
        for index, layer in enumerate(cache.layers):
            keep = _kept(layer, width)
            _fill(
                layer,
                gather(partial(_layer_part, index, 0), keep),
                gather(partial(_layer_part, index, 1), keep),
                width,
            )
        self.cache = cache
        self.width = width
        """Columns of every row, padding included: the cache's length to transformers."""
        self.mask = (torch.arange(width + 1, device=device) >= (width - lengths_t)[:, None]).long()
        """The attention mask of the next forward: the rows' tokens and the new one."""
        self.positions = lengths_t[:, None]
        """Each row's next position id: its own length."""

    def advanced(self) -> None:
        """The forward appended one token to every row."""
        self.width += 1
        self.positions += 1
        self.mask = torch.nn.functional.pad(self.mask, (0, 1), value=1)

    def row_cache(self, config, row: int, length: int) -> DynamicCache:
        """Row `row` (of `length` tokens) copied out as a cache of its own, without padding
        (a sequence leaving the batch but not released: paused)."""
        cache = new_cache(config, len(self.cache.layers))
        for layer, source in zip(cache.layers, self.cache.layers):
            keep = _kept(layer, length)
            keys, values = _tensors(source)
            _fill(
                layer,
                keys[row : row + 1, :, keys.shape[2] - keep :].clone(),
                values[row : row + 1, :, values.shape[2] - keep :].clone(),
                length,
            )
        return cache


class _Gather:
    """Copies rows out of a few source caches into one batch, in the order asked for, with
    one index_select per source and tensor rather than one copy per row."""

    def __init__(self, sources: list[tuple[DynamicCache, int]], device) -> None:
        groups: dict[int, tuple[DynamicCache, list[int], list[int]]] = {}
        for i, (cache, row) in enumerate(sources):
            _, rows, order = groups.setdefault(id(cache), (cache, [], []))
            rows.append(row)
            order.append(i)
        self._groups = [(c, torch.tensor(rows, device=device)) for c, rows, _ in groups.values()]
        order = [i for _, _, o in groups.values() for i in o]
        self._back = None
        if order != list(range(len(order))):
            self._back = torch.empty(len(order), dtype=torch.long, device=device)
            self._back[torch.tensor(order, device=device)] = torch.arange(len(order), device=device)

    def __call__(
        self, tensor_of: Callable[[DynamicCache], torch.Tensor], keep: int
    ) -> torch.Tensor:
        """[rows, heads, keep, dim]: each row's last `keep` columns, left-padded with zeros
        when its source has fewer. Sources hold zeros left of a row's tokens (`zero_padding`),
        so a row's padding is zeros either way."""
        parts = []
        for cache, rows in self._groups:
            t = tensor_of(cache).index_select(0, rows)
            have = t.shape[2]
            parts.append(
                t[:, :, have - keep :]
                if have >= keep
                else torch.nn.functional.pad(t, (0, 0, keep - have, 0))
            )
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out if self._back is None else out.index_select(0, self._back)
