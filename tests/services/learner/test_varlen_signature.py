"""torch's variable-length attention kernel is called with only the arguments its signature
takes (torch 2.10: no `scale`, no window, no grouped-query; 2.11+: all three), and packing is
chosen by itself only where a probe of the kernel ran on the device.

The kernel runs on CUDA only, so here `torch.nn.attention.varlen.varlen_attn` is replaced by
pure-torch functions with each version's exact signature, computing each row's attention with
SDPA at the kernel's default scale unless given one; the probe's decision is checked by handing
it such a function (or a broken one) and a CPU device.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.nn import functional
from torch.nn.attention import varlen

from services.learner import packed_attention, sharding
from services.learner.packed_attention import (
    PackedRows,
    _varlen,
    _varlen_parameters,
    varlen_kernel_problem,
    varlen_problem,
    varlen_takes_window,
)
from services.learner.sharding import pack_rows
from services.model_layout import FULL, SLIDING, LayerAttention, ModelLayout
from services.spec import LearnerConfig

CPU = torch.device("cpu")
LENGTHS = (5, 2, 7)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
# Far from the default 1/sqrt(16) = 0.25: a kernel left at its default scale differs by ~1.
SCALE = 0.7
TOLERANCE = 1e-5
LLAMA = ModelLayout("llama", (LayerAttention(FULL),))
BFLOAT16_CUDA = {"device": "cuda", "compute_dtype": "bfloat16"}


def row_bounds(cumulative: Tensor) -> list[tuple[int, int]]:
    bounds = [int(bound) for bound in cumulative.tolist()]
    return list(itertools.pairwise(bounds))


def windowed_mask(length: int, window: tuple[int, int]) -> Tensor:
    """flash-attention's (left, right) window over one row: -1 leaves that side unbounded."""
    left, right = window
    query = torch.arange(length)[:, None]
    key = torch.arange(length)[None, :]
    allowed = torch.ones(length, length, dtype=torch.bool)
    if right >= 0:
        allowed &= key <= query + right
    if left >= 0:
        allowed &= query - key <= left
    return allowed


def varlen_attn_2_10(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seq_q: Tensor,
    cu_seq_k: Tensor,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    is_causal: bool = False,
) -> Tensor:
    """torch 2.10's signature: each row's attention at the default scale 1/sqrt(D), query and
    key/value heads equal (SDPA refuses others without `enable_gqa`)."""
    assert return_aux is None and torch.equal(cu_seq_q, cu_seq_k)
    outs = []
    for start, end in row_bounds(cu_seq_q):
        q, k, v = (states[start:end].transpose(0, 1) for states in (query, key, value))
        outs.append(functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal))
    return torch.cat([out.transpose(0, 1) for out in outs])


class VarlenAttn211:
    """torch 2.11's signature (scale, window, grouped-query), recording each call's options."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        cu_seq_q: Tensor,
        cu_seq_k: Tensor,
        max_q: int,
        max_k: int,
        *,
        return_aux: Any = None,
        scale: float | None = None,
        window_size: tuple[int, int] = (-1, -1),
        enable_gqa: bool = False,
    ) -> Tensor:
        options = {"scale": scale, "window_size": window_size, "enable_gqa": enable_gqa}
        self.calls.append({"query": query, **options})
        outs = []
        for start, end in row_bounds(cu_seq_q):
            q, k, v = (states[start:end].transpose(0, 1) for states in (query, key, value))
            mask = windowed_mask(end - start, window_size)
            outs.append(
                functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
                ).transpose(0, 1)
            )
        return torch.cat(outs)


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Callable[..., Any]], None]]:
    """Install a function as torch's varlen_attn; the signature cache is cleared on the way in
    and out, so neither this test nor the next reads another function's parameters."""

    def install(kernel: Callable[..., Any]) -> None:
        monkeypatch.setattr(varlen, "varlen_attn", kernel)
        _varlen_parameters.cache_clear()

    yield install
    monkeypatch.undo()
    _varlen_parameters.cache_clear()


def packed_inputs(dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    query = torch.randn(total, HEADS, HEAD_DIM, generator=generator, dtype=dtype)
    key = torch.randn(total, KV_HEADS, HEAD_DIM, generator=generator, dtype=dtype)
    value = torch.randn(total, KV_HEADS, HEAD_DIM, generator=generator, dtype=dtype)
    return query, key, value


def per_row_reference(query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
    """Each row's causal attention at `scale`, written out without the learner's code."""
    outs, start = [], 0
    for length in LENGTHS:
        q, k, v = (states[start : start + length].transpose(0, 1) for states in (query, key, value))
        out = functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True
        )
        outs.append(out.transpose(0, 1))
        start += length
    return torch.cat(outs)


def test_a_scale_reaches_torch_2_10_s_kernel_through_the_query(
    installed: Callable[[Callable[..., Any]], None],
) -> None:
    installed(varlen_attn_2_10)
    query, key, value = packed_inputs()
    rows = PackedRows.of(LENGTHS, CPU, LLAMA)
    out = _varlen(query, key, value, rows, LLAMA.layers[0], SCALE)
    want = per_row_reference(query, key, value, SCALE)
    default = per_row_reference(query, key, value, HEAD_DIM**-0.5)
    assert float((want - default).abs().max()) > 0.1  # the scale is seen at all
    torch.testing.assert_close(out, want, rtol=TOLERANCE, atol=TOLERANCE)
    at_default = _varlen(query, key, value, rows, LLAMA.layers[0], HEAD_DIM**-0.5)
    torch.testing.assert_close(at_default, default, rtol=TOLERANCE, atol=TOLERANCE)
    # Read once for both calls (it runs in every layer's forward).
    assert _varlen_parameters.cache_info().misses == 1
    assert not varlen_takes_window()


def test_torch_2_11_s_kernel_is_handed_the_scale_and_grouped_query_heads(
    installed: Callable[[Callable[..., Any]], None],
) -> None:
    kernel = VarlenAttn211()
    installed(kernel)
    query, key, value = packed_inputs()
    out = _varlen(query, key, value, PackedRows.of(LENGTHS, CPU, LLAMA), LLAMA.layers[0], SCALE)
    torch.testing.assert_close(out, per_row_reference(query, key, value, SCALE))
    (call,) = kernel.calls
    assert call["scale"] == SCALE and call["enable_gqa"] and call["window_size"] == (-1, 0)
    assert call["query"] is query  # not scaled on the way: the kernel scales
    assert varlen_takes_window()


def test_the_probe_passes_a_kernel_that_attends_as_per_row_attention_does(
    installed: Callable[[Callable[..., Any]], None],
) -> None:
    installed(varlen_attn_2_10)
    assert varlen_kernel_problem(varlen_attn_2_10, CPU) is None
    kernel = VarlenAttn211()
    installed(kernel)
    assert varlen_kernel_problem(kernel, CPU) is None
    # Full causal attention and a sliding window, each in bfloat16 at the probe's own scale.
    assert [call["window_size"] for call in kernel.calls] == [(-1, 0), (1, 0)]
    assert {call["query"].dtype for call in kernel.calls} == {torch.bfloat16}


def failing(error: Exception) -> Callable[..., Tensor]:
    """A kernel of torch 2.10's signature (`varlen_attn_2_10`'s: `inspect.signature` follows
    `__wrapped__`) that imports but cannot run here."""

    @functools.wraps(varlen_attn_2_10)
    def varlen_attn(*args: Any, **kwargs: Any) -> Tensor:
        raise error

    return varlen_attn


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA error: no kernel image is available for execution on the device"),
        NotImplementedError("varlen_attn: FlashAttention not built for sm_61"),
    ],
    ids=["runtime-error", "not-implemented"],
)
def test_the_probe_says_why_a_kernel_that_raises_cannot_pack(
    installed: Callable[[Callable[..., Any]], None], error: Exception
) -> None:
    broken = failing(error)
    installed(broken)
    problem = varlen_kernel_problem(broken, CPU)
    assert problem is not None and str(error) in problem


def test_the_probe_refuses_a_kernel_that_attends_across_rows(
    installed: Callable[[Callable[..., Any]], None],
) -> None:
    installed(varlen_attn_2_10)

    @functools.wraps(varlen_attn_2_10)
    def one_sequence(
        query: Tensor, key: Tensor, value: Tensor, *rest: Any, **options: Any
    ) -> Tensor:
        """Ignores the rows' bounds: every token attends to the earlier rows too."""
        _, _, max_q, max_k = rest
        whole = torch.tensor([0, query.shape[0]], dtype=torch.int32)
        return varlen_attn_2_10(query, key, value, whole, whole, max_q, max_k, is_causal=True)

    problem = varlen_kernel_problem(one_sequence, CPU)
    assert problem is not None and "away from per-row attention" in problem


def test_auto_pads_and_true_refuses_where_the_kernel_does_not_run(
    installed: Callable[[Callable[..., Any]], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's verdict decides `pack_rows` on CUDA. The per-device probe needs a GPU, so
    here the same decision runs on the CPU with a broken kernel."""
    broken = failing(RuntimeError("no kernel image is available for execution on the device"))
    installed(broken)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(
        sharding, "varlen_problem", lambda device: varlen_kernel_problem(broken, CPU)
    )
    assert not pack_rows(LearnerConfig(**BFLOAT16_CUDA), cuda, LLAMA)
    with pytest.raises(ValueError, match=r"cannot be packed: .*no kernel image is available"):
        pack_rows(LearnerConfig(pack_rows=True, **BFLOAT16_CUDA), cuda, LLAMA)
    # Where the varlen kernel is not what packed rows run through, nothing is probed.
    assert pack_rows(LearnerConfig(pack_rows=True, device="cuda"), cuda, LLAMA)  # float32: per row
    flash = LearnerConfig(attn_implementation="flash_attention_2", **BFLOAT16_CUDA)
    assert pack_rows(flash, cuda, LLAMA)
    working = varlen_attn_2_10
    monkeypatch.setattr(
        sharding, "varlen_problem", lambda device: varlen_kernel_problem(working, CPU)
    )
    assert pack_rows(LearnerConfig(**BFLOAT16_CUDA), cuda, LLAMA)


def test_nothing_is_probed_off_cuda(installed: Callable[[Callable[..., Any]], None]) -> None:
    installed(failing(AssertionError("probed on the CPU")))
    assert pack_rows(LearnerConfig(pack_rows=True), CPU, LLAMA)  # per-row attention
    assert not pack_rows(LearnerConfig(), CPU, LLAMA)
    problem = varlen_problem(CPU)
    assert problem is not None and "CUDA only" in problem


def test_a_sliding_window_reaches_torch_2_11_s_kernel_as_flash_attention_spells_it(
    installed: Callable[[Callable[..., Any]], None],
) -> None:
    """A window of w keys ending at the query is flash-attention's (w - 1, 0)."""
    kernel = VarlenAttn211()
    installed(kernel)
    query, key, value = packed_inputs()
    layer = LayerAttention(SLIDING, 3)
    layout = ModelLayout("mistral", (layer,))
    out = _varlen(query, key, value, PackedRows.of(LENGTHS, CPU, layout), layer, SCALE)
    want = packed_attention._per_row(
        query, key, value, PackedRows.of(LENGTHS, CPU, layout).bounds, layer, SCALE, None
    )
    torch.testing.assert_close(out, want, rtol=TOLERANCE, atol=TOLERANCE)
    assert kernel.calls[0]["window_size"] == (2, 0)
