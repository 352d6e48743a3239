"""The learner's attention: packed rows (a micro-batch's rows concatenated into one sequence,
no padding), and padded rows under the masks the learner builds.

Padded rows cost the widest row's length for every row (a long-tailed batch spent 30% of its
attention and MLP work on padding); packed, a micro-batch costs its real tokens. The rows'
boundaries (`PackedRows`: cumulative lengths, computed on the host from the batch's lengths and
copied once) travel to every layer as a keyword argument (`PACKED_ROWS`; transformers hands a
decoder's keyword arguments down to each attention call), with the model's layout
(`services.model_layout`), from which each layer takes its own mask by its index: causal, a
sliding window, or chunks. The attention implementation registered here as `LEARNER_ATTENTION`
reads them:

- on CUDA, `torch.nn.attention.varlen.varlen_attn` (torch 2.10+: flash-attention's
  variable-length kernel, causal, grouped-query, a sliding window from torch 2.11), with no
  flash-attn package. It is called with only the arguments this torch's signature takes (2.10
  has no `scale`: the scale is folded into the query), and packing is chosen by itself only on
  a device where a small call of it has run (`varlen_problem`): a build may import the kernel
  and still have none for the device;
- elsewhere (the CPU reference that CI checks packed == padded with, and float32 on CUDA),
  each row on its own with its layer's mask, soft-capped where the family caps its attention.

A call without packed rows is a padded one: its mask goes to SDPA as given (None: plain causal
attention, SDPA's `is_causal`). The implementation has no mask builder in transformers'
registry, so a decoder loaded with it builds no mask of its own: it neither reads the padding
mask back from the device to decide whether it may skip one (a host sync per forward) nor
builds one the learner did not ask for. The learner passes every mask explicitly
(`ResponseLogProbs`), so every family SDPA serves is loaded with it, padded or packed.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from services.model_layout import CHUNKED, FULL, SLIDING, LayerAttention, ModelLayout

# No "sdpa" in the name: transformers checks any name holding it against the family's SDPA
# support, which Gemma 2 (soft-capped attention) lacks though its packed rows are served here.
LEARNER_ATTENTION = "kpo_learner"
# The keyword argument that carries `PackedRows` from the decoder's call to every attention call.
PACKED_ROWS = "kpo_packed_rows"


@dataclass(frozen=True)
class PackedRows:
    """Where each row of a packed sequence starts: `bounds` on the host (0, l0, l0 + l1, ...),
    `cumulative` the same as int32 on the device, `longest` the longest row (rounded up by the
    caller where fewer distinct values help compiled code: it is only an upper bound), and the
    `layout` of the model whose layers attend over them."""

    bounds: tuple[int, ...]
    cumulative: Tensor
    longest: int
    layout: ModelLayout

    @classmethod
    def of(
        cls, lengths: Sequence[int], device: torch.device, layout: ModelLayout, longest: int = 0
    ) -> PackedRows:
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
            layout,
        )


# Read once: the signature does not change, and this runs in every layer's forward.
@functools.cache
def _varlen_parameters() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_takes_window() -> bool:
    """Whether this torch's variable-length kernel takes a sliding window (2.11+)."""
    return varlen_available() and "window_size" in _varlen_parameters()


def _varlen_options(layer: LayerAttention) -> dict[str, Any]:
    """Causal attention (within the layer's window) in varlen_attn's spelling: `window_size`
    from torch 2.11, `is_causal` in 2.10; and whether it takes grouped-query inputs itself."""
    parameters = _varlen_parameters()
    if "window_size" in parameters:
        # flash-attention's window counts the keys before the query: a window of w keys
        # ending at the query is (w - 1, 0), as transformers' flash path spells it.
        left = layer.span - 1 if layer.span is not None else -1
        options: dict[str, Any] = {"window_size": (left, 0)}
    elif layer.span is None:
        options = {"is_causal": True}
    else:
        raise ValueError("this torch's varlen_attn takes no sliding window (torch 2.11+ does)")
    return {**options, "enable_gqa": True} if "enable_gqa" in parameters else options


def _repeat_heads(states: Tensor, groups: int) -> Tensor:
    """[X, H_kv, D] -> [X, H_kv * groups, D], each key/value head serving its query heads."""
    return states if groups == 1 else states.repeat_interleave(groups, dim=1)


def _varlen(
    query: Tensor, key: Tensor, value: Tensor, rows: PackedRows, layer: LayerAttention, scale: float
) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    return _call_varlen(varlen_attn, query, key, value, rows.cumulative, rows.longest, layer, scale)


def _call_varlen(
    kernel: Callable[..., Any],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cumulative: Tensor,
    longest: int,
    layer: LayerAttention,
    scale: float,
) -> Tensor:
    """`kernel` (varlen_attn, or one of its signature) over packed rows, [X, H, D] in and out,
    with only the arguments this torch's signature takes."""
    if layer.kind == CHUNKED:
        raise ValueError("chunked attention layers cannot be packed on CUDA")
    options = _varlen_options(layer)
    if "enable_gqa" not in options:
        groups = query.shape[1] // key.shape[1]
        key, value = _repeat_heads(key, groups), _repeat_heads(value, groups)
    default_scale = query.shape[-1] ** -0.5
    if "scale" in _varlen_parameters():
        options["scale"] = scale
    elif scale != default_scale:
        # torch 2.10's kernel takes no scale and applies 1/sqrt(D): a query multiplied by
        # scale * sqrt(D) gives the scores scale * q.k. Skipped at the default scale (the usual
        # one, compared as the caller computes it), where it would only round the query.
        query = query * (scale / default_scale)
    out = kernel(query, key, value, cumulative, cumulative, longest, longest, **options)
    assert isinstance(out, Tensor)  # no auxiliary outputs asked for
    return out


def _row_attention(
    q: Tensor, k: Tensor, v: Tensor, layer: LayerAttention, scale: float, softcap: float | None
) -> Tensor:
    """One row's attention, [H, n, D] in and out, under the layer's mask."""
    length = q.shape[1]
    if softcap is None and not layer.binds(length):
        return functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    real = torch.ones((1, length), dtype=torch.bool, device=q.device)
    allowed = layer.allowed(real, torch.zeros(1, dtype=torch.long, device=q.device))[0]
    if softcap is None:
        return functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    # Soft-capped logits (Gemma 2): cap * tanh(s / cap) before the mask, as its eager path does.
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


# Left out of a compiled layer: its loop over the rows would specialise the graph on every
# layout of rows; it is the CPU reference, not the path compilation is for.
@torch.compiler.disable  # type: ignore[untyped-decorator]
def _per_row(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bounds: Sequence[int],
    layer: LayerAttention,
    scale: float,
    softcap: float | None,
) -> Tensor:
    """Each row's attention on its own, with the layer's mask: [X, H, D] in, [X, H, D] out;
    `bounds`: where each row starts (`PackedRows.bounds`)."""
    groups = query.shape[1] // key.shape[1]
    outs = []
    for start, end in itertools.pairwise(bounds):
        q = query[start:end].transpose(0, 1)  # [H, n, D]
        k = _repeat_heads(key[start:end], groups).transpose(0, 1)
        v = _repeat_heads(value[start:end], groups).transpose(0, 1)
        outs.append(_row_attention(q, k, v, layer, scale, softcap).transpose(0, 1))
    return torch.cat(outs) if outs else query.new_zeros(query.shape)


def learner_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention interface: query [1, H, X, D], key/value [1, H_kv, X, D] ->
    ([1, X, H, D], None). Without `PACKED_ROWS` the call is a padded one: its mask goes to SDPA."""
    rows: PackedRows | None = kwargs.pop(PACKED_ROWS, None)
    softcap = kwargs.get("softcap")
    if kwargs.get("s_aux") is not None:
        raise ValueError("packed attention does not add attention sinks (s_aux); pack_rows: false")
    if rows is None:
        if softcap is not None:
            raise ValueError("a padded forward of a soft-capped model needs eager attention")
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed rows are one sequence, got a batch of {query.shape[0]}")
    layer = rows.layout.layers[module.layer_idx]  # type: ignore[index]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (states[0].transpose(0, 1) for states in (query, key, value))  # [X, H, D]
    dtype = _half_dtype(q)
    if dtype is None or softcap is not None:
        return _per_row(q, k, v, rows.bounds, layer, scale, softcap).unsqueeze(0), None
    # varlen_attn is a custom op autocast does not cast, and its kernels take one 16-bit
    # dtype; under autocast the rotary embedding hands q and k over in float32.
    q, k, v = (states.to(dtype) for states in (q, k, v))
    return _varlen(q, k, v, rows, layer, scale).unsqueeze(0), None


def _half_dtype(states: Tensor) -> torch.dtype | None:
    """The 16-bit dtype the variable-length kernel runs in here (autocast's, else the
    states'), or None where it cannot: off CUDA, or in float32."""
    if not states.is_cuda:
        return None
    device = states.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else states.dtype
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def register_learner_attention() -> str:
    """Make `LEARNER_ATTENTION` a name `from_pretrained(attn_implementation=...)` accepts;
    returns the name."""
    AttentionInterface.register(LEARNER_ATTENTION, learner_attention)
    return LEARNER_ATTENTION


def varlen_available() -> bool:
    """Whether this torch has the variable-length attention kernel (2.10+)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


# The probe's two rows and heads: a few tokens each, two query heads over one key/value head
# (grouped-query, as most families attend) of a head size every flash kernel build takes.
PROBE_LENGTHS = (3, 5)
PROBE_HEADS, PROBE_KV_HEADS, PROBE_HEAD_DIM = 2, 1, 64
# bfloat16 inputs, float32 reference: a correct kernel is off by under 1e-2 on these unit-scale
# values (on CPU, SDPA in bfloat16: 4e-3, 7e-3 windowed), while on the same inputs a row seeing
# another row's keys is off by 2.6, an ignored window by 1.9, the default scale kept by 1.0.
PROBE_ATOL = 0.1


def varlen_kernel_problem(kernel: Callable[..., Any], device: torch.device) -> str | None:
    """Why `kernel` (torch's varlen_attn, or a function of its signature) cannot run packed
    rows on `device`; None if it can. It runs a tiny bfloat16 forward and backward over two
    rows through the learner's own call (`_call_varlen`: the options and scale this torch's
    signature takes; a sliding window too where it takes one), at a scale other than the
    default, and its output must match per-row attention."""
    window = [LayerAttention(SLIDING, 2)] if varlen_takes_window() else []
    try:
        for layer in [LayerAttention(FULL), *window]:
            error = _probe_error(kernel, device, layer)
            if error > PROBE_ATOL:
                return (
                    f"torch's variable-length attention kernel on {device} gives outputs "
                    f"{error:.3g} away from per-row attention ({layer.kind})"
                )
    except (RuntimeError, NotImplementedError) as error:
        return f"torch's variable-length attention kernel fails on {device}: {error}"
    return None


def _probe_error(kernel: Callable[..., Any], device: torch.device, layer: LayerAttention) -> float:
    """The largest difference of `kernel`'s output from per-row float32 attention on a tiny
    bfloat16 batch of `layer`'s mask, after a backward through it (which must run too)."""
    generator = torch.Generator().manual_seed(0)
    total = sum(PROBE_LENGTHS)
    shapes = [(total, heads, PROBE_HEAD_DIM) for heads in (PROBE_HEADS, PROBE_KV_HEADS)]
    query, key, value = (
        torch.randn(shape, generator=generator).to(device, torch.bfloat16).requires_grad_()
        for shape in (shapes[0], shapes[1], shapes[1])
    )
    bounds = (0, PROBE_LENGTHS[0], total)
    cumulative = torch.tensor(bounds, dtype=torch.int32, device=device)
    scale = 0.5 * PROBE_HEAD_DIM**-0.5
    out = _call_varlen(kernel, query, key, value, cumulative, max(PROBE_LENGTHS), layer, scale)
    torch.autograd.backward(out.float().sum())
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a kernel's launch error surfaces here, not at the call
    with torch.no_grad():
        want = _per_row(query.float(), key.float(), value.float(), bounds, layer, scale, None)
        return float((out.float() - want).abs().max())


def varlen_problem(device: torch.device) -> str | None:
    """Why torch's variable-length kernel cannot run packed rows on `device`; None if it can.
    Probed once per CUDA device (`varlen_kernel_problem`); off CUDA it never runs."""
    if device.type != "cuda":
        return f"torch's variable-length attention kernel runs on CUDA only, not {device.type}"
    if not varlen_available():
        return "this torch has no variable-length attention kernel (torch 2.10+ does)"
    if not torch.cuda.is_available():
        return "this process has no CUDA device"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_varlen_problem(index)


# Once per device: the answer does not change within a process, and a probe costs a few kernel
# launches (and their compilation, the first time).
@functools.cache
def _cuda_varlen_problem(index: int) -> str | None:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_kernel_problem(varlen_attn, torch.device("cuda", index))
