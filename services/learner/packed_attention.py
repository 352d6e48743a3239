"""Attention over packed rows: a micro-batch's rows concatenated into one sequence, no padding.

Padded rows cost the widest row's length for every row (a long-tailed batch spent 30% of its
attention and MLP work on padding); packed, a micro-batch costs its real tokens. The rows'
boundaries (`PackedRows`: cumulative lengths, computed on the host from the batch's lengths and
copied once) travel to every layer in place of the attention mask, and the attention
implementation registered here as `PACKED_ATTENTION` reads them:

- on CUDA, `torch.nn.attention.varlen.varlen_attn` (torch 2.10+: flash-attention's
  variable-length kernel, causal, grouped-query), with no flash-attn package;
- elsewhere (the CPU reference that CI checks packed == padded with, and float32 on CUDA),
  causal SDPA row by row.

A model loaded with this implementation attends as SDPA when it is given an ordinary mask, so
the same model serves padded forwards too.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_ATTENTION = "kpo_packed_sdpa"


@dataclass(frozen=True)
class PackedRows:
    """Where each row of a packed sequence starts: `bounds` on the host (0, l0, l0 + l1, ...),
    `cumulative` the same as int32 on the device, `longest` the longest row (rounded up by the
    caller where fewer distinct values help compiled code: it is only an upper bound)."""

    bounds: tuple[int, ...]
    cumulative: Tensor
    longest: int

    @classmethod
    def of(cls, lengths: Sequence[int], device: torch.device, longest: int = 0) -> PackedRows:
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        cumulative = torch.tensor(bounds, dtype=torch.int32)
        if device.type == "cuda":
            cumulative = cumulative.pin_memory()
        return cls(
            tuple(bounds),
            cumulative.to(device, non_blocking=True),
            max(longest, *lengths, 1),
        )


class EveryLayer(dict[str, Any]):
    """The per-layer-type mask mapping a decoder takes, answering the same mask (packed rows,
    or a prepared padded mask) for every layer type: full and sliding attention alike, as a
    row is shorter than any window we train with. Given this, transformers builds no mask of
    its own (which would read the padding mask back to decide whether it can skip it)."""

    def __init__(self, mask: PackedRows | Tensor | None) -> None:
        super().__init__()
        self.mask = mask

    def __missing__(self, key: str) -> PackedRows | Tensor | None:
        return self.mask


# Read once: the signature does not change, and this runs in every layer's forward.
@functools.cache
def _varlen_options() -> dict[str, Any]:
    """Causal attention in varlen_attn's spelling: `window_size` from torch 2.11, `is_causal`
    in 2.10; and whether it takes grouped-query inputs itself."""
    from torch.nn.attention.varlen import varlen_attn

    parameters = inspect.signature(varlen_attn).parameters
    causal: dict[str, Any] = (
        {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    )
    return {**causal, "enable_gqa": True} if "enable_gqa" in parameters else causal


def _repeat_heads(states: Tensor, groups: int) -> Tensor:
    """[X, H_kv, D] -> [X, H_kv * groups, D], each key/value head serving its query heads."""
    return states if groups == 1 else states.repeat_interleave(groups, dim=1)


def _varlen(query: Tensor, key: Tensor, value: Tensor, rows: PackedRows, scale: float) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    options = dict(_varlen_options())
    if "enable_gqa" not in options:
        groups = query.shape[1] // key.shape[1]
        key, value = _repeat_heads(key, groups), _repeat_heads(value, groups)
    cumulative, longest = rows.cumulative, rows.longest
    out = varlen_attn(
        query, key, value, cumulative, cumulative, longest, longest, scale=scale, **options
    )
    assert isinstance(out, Tensor)  # no auxiliary outputs asked for
    return out


# Left out of a compiled layer: its loop over the rows would specialise the graph on every
# layout of rows; it is the CPU reference, not the path compilation is for.
@torch.compiler.disable  # type: ignore[untyped-decorator]
def _per_row(query: Tensor, key: Tensor, value: Tensor, rows: PackedRows, scale: float) -> Tensor:
    """Causal SDPA over each row on its own: [X, H, D] in, [X, H, D] out."""
    groups = query.shape[1] // key.shape[1]
    outs = []
    for start, end in zip(rows.bounds[:-1], rows.bounds[1:], strict=True):
        q = query[start:end].transpose(0, 1)  # [H, n, D]
        k = _repeat_heads(key[start:end], groups).transpose(0, 1)
        v = _repeat_heads(value[start:end], groups).transpose(0, 1)
        outs.append(
            functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(
                0, 1
            )
        )
    return torch.cat(outs) if outs else query.new_zeros(query.shape)


def packed_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | PackedRows | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention interface: query [1, H, X, D], key/value [1, H_kv, X, D] ->
    ([1, X, H, D], None). Any mask but `PackedRows` goes to SDPA unchanged."""
    if not isinstance(attention_mask, PackedRows):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed rows are one sequence, got a batch of {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (states[0].transpose(0, 1) for states in (query, key, value))  # [X, H, D]
    dtype = _half_dtype(q)
    if dtype is None:
        return _per_row(q, k, v, attention_mask, scale).unsqueeze(0), None
    # varlen_attn is a custom op autocast does not cast, and its kernels take one 16-bit
    # dtype; under autocast the rotary embedding hands q and k over in float32.
    q, k, v = (states.to(dtype) for states in (q, k, v))
    return _varlen(q, k, v, attention_mask, scale).unsqueeze(0), None


def _half_dtype(states: Tensor) -> torch.dtype | None:
    """The 16-bit dtype the variable-length kernel runs in here (autocast's, else the
    states'), or None where it cannot: off CUDA, or in float32."""
    if not states.is_cuda:
        return None
    device = states.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else states.dtype
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def register_packed_attention() -> str:
    """Make `PACKED_ATTENTION` a name `from_pretrained(attn_implementation=...)` accepts (its
    masks for padded forwards are SDPA's); returns the name."""
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
    return PACKED_ATTENTION


def varlen_available() -> bool:
    """Whether this torch has the variable-length attention kernel (2.10+)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True
