"""The rows being decoded by the `hf` backend: their KV cache and attention mask, in one batch.

Rows of different lengths share one left-padded layout: every row's real tokens end at the
right edge, padding (attention mask 0, keys and values 0) fills the left. Continuous batching
needs three operations on it, all here: merge the cache of newly prefilled rows into the
running batch (left-padding whichever is shorter), drop rows that ended, and cut padding
columns that no remaining row needs. Positions are counted from each row's first real token
(`services.positions.position_ids_for`), so padding never shifts them.

Only caches that keep every column can be merged this way, so every attention layer is a
`GrowingLayer` (`new_cache`), sliding-window and chunked layers included: their keys older than
the window stay cached and the mask hides them (the model builds each layer type's mask from
the batch's 2-D mask, its window counted in columns, which within a row's right-aligned real
tokens are its token distances). That costs a windowed layer the memory and attention width of
a full one, and serves every family the learner scores (`services.model_layout`); any other
cache layer (linear attention, recurrent state) is refused by name.

A `GrowingLayer` also fixes a cost: transformers' `DynamicLayer`
concatenates a layer's whole cache with each decoded token, so a response of n tokens copies
O(n^2) keys and values, which was a quarter of the streaming engine's time on CPU. A growing
layer writes into spare capacity instead and reallocates geometrically, amortised O(1) per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

# Spare columns a growing layer reserves when it reallocates: this share of its length, at least
# the minimum (so the many short reallocations of a young batch are few).
_GROWTH_SHARE = 0.5
_MIN_GROWTH_COLUMNS = 32


class GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A full-attention cache layer that appends into preallocated capacity.

    `keys` and `values` read as views of the filled columns (B, H, L, D) of buffers
    (B, H, capacity, D); assigning either replaces its buffer (capacity = the assigned length),
    so code written for `DynamicLayer` that reassigns them keeps working. Keys and values keep
    their own lengths: code that reassigns one and then reads the other sees the other unchanged.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor | None] = {"keys": None, "values": None}
        self._lengths = {"keys": 0, "values": 0}
        super().__init__()  # type: ignore[no-untyped-call]

    def _filled(self, name: str) -> torch.Tensor | None:
        buffer = self._buffers[name]
        return None if buffer is None else buffer[..., : self._lengths[name], :]

    def _assign(self, name: str, value: torch.Tensor | None) -> None:
        self._buffers[name] = value
        self._lengths[name] = 0 if value is None or value.dim() < 2 else value.shape[-2]

    @property
    def keys(self) -> torch.Tensor | None:
        return self._filled("keys")

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._assign("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        return self._filled("values")

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._assign("values", value)

    def capacity(self, name: str = "keys") -> int:
        """Columns the buffer of `name` ("keys" or "values") holds, filled or spare."""
        buffer = self._buffers[name]
        return 0 if buffer is None or buffer.dim() < 2 else buffer.shape[-2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new columns (B, H, n, D); return the filled keys and values."""
        if not self.is_initialized:
            self.device = key_states.device
            self.is_initialized = True
        for name, states in (("keys", key_states), ("values", value_states)):
            self._append(name, states)
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        return keys, values

    def _append(self, name: str, states: torch.Tensor) -> None:
        length = self._lengths[name]
        needed = length + states.shape[-2]
        if needed > self.capacity(name):
            spare = max(int(needed * _GROWTH_SHARE), _MIN_GROWTH_COLUMNS)
            buffer = states.new_empty((*states.shape[:-2], needed + spare, states.shape[-1]))
            if length:
                filled = self._filled(name)
                assert filled is not None
                buffer[..., :length, :] = filled
            self._buffers[name] = buffer
        filled_to = self._buffers[name]
        assert filled_to is not None
        filled_to[..., length:needed, :] = states
        self._lengths[name] = needed

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices`, and the spare capacity with them."""
        for name, buffer in self._buffers.items():
            if buffer is not None and self._lengths[name]:
                self._buffers[name] = buffer[indices, ...]


def new_cache(config: PretrainedConfig) -> DynamicCache:
    """The cache of a prefill: `config`'s layers, each attention layer (full, sliding or
    chunked: transformers' `DynamicLayer` and its sliding subclass) a `GrowingLayer`."""
    cache = DynamicCache(config=config)
    cache.layers = [
        GrowingLayer() if isinstance(layer, DynamicLayer) else layer for layer in cache.layers
    ]
    return cache


def left_pad(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id rows into (input_ids, attention_mask), both (B, max_len) int64."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        if row:
            input_ids[index, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[index, width - len(row) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def _attention_layers(cache: DynamicCache) -> list[DynamicLayer]:
    layers: list[DynamicLayer] = []
    for index, layer in enumerate(cache.layers):
        if type(layer) not in (DynamicLayer, GrowingLayer):
            raise NotImplementedError(
                "continuous batching merges attention KV caches only; "
                f"layer {index} is {type(layer).__name__}"
            )
        assert isinstance(layer, DynamicLayer)  # for mypy: `type(...) is` does not narrow
        if layer.keys is None or layer.values is None:
            raise ValueError(f"layer {index} of the KV cache was never filled by a forward")
        layers.append(layer)
    return layers


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`tensor` left-padded with zeros to `width` along `dim` (counted from the end)."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = [0, 0] * (-dim - 1) + [missing, 0]
    return F.pad(tensor, pad)


class RunningBatch:
    """KV cache (each layer's keys/values (B, H, L, D)) and attention mask (B, L) of B rows.

    Invariant: the cache holds L columns for every row, and `mask[b]` is 1 exactly over row
    b's real tokens (right-aligned). The next token fed to row b sits at position
    `mask[b].sum()`.
    """

    def __init__(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        self.cache = cache
        self.mask = mask

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    def next_positions(self) -> torch.Tensor:
        """(B, 1) position of the token each row is fed next."""
        return self.mask.sum(dim=-1, keepdim=True)

    def mask_with_next(self) -> torch.Tensor:
        """The mask for a decode step: this batch's columns plus one real column for the fed
        token. After the forward, `fed_one` makes it the batch's mask."""
        return F.pad(self.mask, (0, 1), value=1)

    def fed_one(self) -> None:
        """Record that one token per row was fed (its keys and values are now cached)."""
        self.mask = self.mask_with_next()

    def merge(self, other: RunningBatch) -> None:
        """Append `other`'s rows after this batch's, left-padding the shorter of the two."""
        width = max(self.mask.shape[-1], other.mask.shape[-1])
        for mine, theirs in zip(
            _attention_layers(self.cache), _attention_layers(other.cache), strict=True
        ):
            assert mine.keys is not None and mine.values is not None
            assert theirs.keys is not None and theirs.values is not None
            mine.keys = torch.cat(
                [_pad_left(mine.keys, width, -2), _pad_left(theirs.keys, width, -2)]
            )
            mine.values = torch.cat(
                [_pad_left(mine.values, width, -2), _pad_left(theirs.values, width, -2)]
            )
        self.mask = torch.cat([_pad_left(self.mask, width, -1), _pad_left(other.mask, width, -1)])

    def select(self, keep: torch.Tensor) -> None:
        """Keep the rows `keep` (indices, in the new order) and cut padding columns that no
        kept row uses, so a long row that ended stops costing attention width."""
        self.cache.batch_select_indices(keep)
        self.mask = self.mask[keep]
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0, 0]) if used.numel() else self.mask.shape[-1]
        if first > 0:
            for layer in _attention_layers(self.cache):
                assert layer.keys is not None and layer.values is not None
                layer.keys = layer.keys[..., first:, :]
                layer.values = layer.values[..., first:, :]
            self.mask = self.mask[:, first:]
