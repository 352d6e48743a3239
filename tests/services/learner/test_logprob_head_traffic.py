"""The fused log-prob head (`vocab_chunked_logprobs`): what it moves and multiplies, counted, and
its values and gradients against a straightforward full-logits reference.

The counts are those of benchmarks/bench_logprob_head.py (`HeadTraffic`, a TorchDispatchMode on
the eager path): elementwise bytes per position x vocabulary element and matrix products in
units of one [N, H] x [H, V] product. They depend on the shapes only, not on the machine.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from bench_logprob_head import GOALS, PATHS, Shape, count
from torch import Tensor

from services.learner.vocab_kernels import KERNELS, LogprobKernel, block_probs, block_stats
from services.learner.vocab_logprobs import vocab_chunked_logprobs

TOLERANCE = 1e-5
# No block size divides the vocabulary or the positions, and the hidden size is no block's.
VOCAB, HIDDEN, POSITIONS = 1009, 40, 70
SHAPE = Shape(positions=64, hidden=48, vocab=1000, chunk=16, vocab_chunk=256)


@pytest.fixture(scope="module")
def counts() -> dict[str, dict[str, float]]:
    return {path: count(SHAPE, path) for path in PATHS}


@pytest.mark.parametrize("path", ["fused+entropy", "fused"])
def test_the_fused_head_moves_no_more_than_the_goal_over_the_plain_one(
    counts: dict[str, dict[str, float]], path: str
) -> None:
    plain, fused = counts["plain"], counts[path]
    assert fused["bytes_per_element"] <= GOALS["bytes"] * plain["bytes_per_element"], fused
    # One product forward, three backward (recompute, d hidden, d weight): the plain's three
    # and the recomputation; the entropy costs none.
    assert plain["products"] == pytest.approx(3.0)
    assert fused["products"] == pytest.approx(4.0)
    assert fused["products"] <= plain["products"] + GOALS["products_over_plain"]


def test_the_fused_head_moves_a_third_of_what_the_old_one_did(
    counts: dict[str, dict[str, float]],
) -> None:
    for entropy in ("+entropy", ""):
        fused, old = counts["fused" + entropy], counts["old" + entropy]
        assert fused["bytes_per_element"] * 3 <= old["bytes_per_element"], (fused, old)
        assert fused["product_calls"] == old["product_calls"]


def reference(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """logp and entropy from the whole [N, V] logits: log_softmax, gather, -sum p log p."""
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * torch.where(logp_all.isneginf(), 0.0, logp_all)).sum(-1)
    return logp, entropy.detach()


def head(bias: bool, seed: int = 0) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """Hidden states (the last 5 positions a padded row's zeros), head, bias (one token at -inf),
    targets, and per-position loss weights that mask every third position and the padding."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(POSITIONS, HIDDEN, generator=generator)
    hidden[-5:] = 0.0
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.3
    bias_t = torch.randn(VOCAB, generator=generator) if bias else None
    if bias_t is not None:
        bias_t[11] = -torch.inf
    targets = torch.randint(0, VOCAB, (POSITIONS,), generator=generator)
    targets[targets == 11] = 12
    weights = torch.randn(POSITIONS, generator=generator)
    weights[::3], weights[-5:] = 0.0, 0.0
    for tensor in (hidden, weight, bias_t):
        if tensor is not None:
            tensor.requires_grad_()
    return hidden, weight, bias_t, targets, weights


def gradients(logp: Tensor, weights: Tensor, tensors: list[Tensor]) -> list[Tensor]:
    return list(torch.autograd.grad((logp * weights).sum(), tensors))


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("chunk", "vocab_chunk"), [(16, 100), (70, 1009), (3, 1)])
def test_values_and_gradients_equal_the_full_logits_reference(
    temperature: float, with_entropy: bool, bias: bool, chunk: int, vocab_chunk: int
) -> None:
    hidden, weight, bias_t, targets, weights = head(bias)
    tensors = [t for t in (hidden, weight, bias_t) if t is not None]
    want_logp, want_entropy = reference(hidden, weight, bias_t, targets, temperature)
    want = gradients(want_logp, weights, tensors)
    logp, entropy = vocab_chunked_logprobs(
        hidden, weight, bias_t, targets, temperature, chunk, vocab_chunk, with_entropy, "torch"
    )
    got = gradients(logp, weights, tensors)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=TOLERANCE)
    expected_entropy = want_entropy if with_entropy else torch.zeros_like(want_entropy)
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=TOLERANCE)
    for name, grad, expected in zip(("hidden", "weight", "bias"), got, want, strict=False):
        torch.testing.assert_close(grad, expected, rtol=0, atol=TOLERANCE, msg=name)
    assert bool((got[0][weights == 0] == 0).all())  # masked positions pass nothing back


def test_a_block_whose_logits_are_all_minus_infinity_changes_nothing() -> None:
    """Blocks of one entry: the -inf token's block is all -inf for every position, whose
    softmax would be NaN; it must reach neither values nor gradients."""
    hidden, weight, bias_t, targets, weights = head(True)
    assert bias_t is not None
    want_logp, want_entropy = reference(hidden, weight, bias_t, targets, 1.0)
    want = gradients(want_logp, weights, [hidden, weight, bias_t])
    logp, entropy = vocab_chunked_logprobs(hidden, weight, bias_t, targets, 1.0, 8, 1, True)
    got = gradients(logp, weights, [hidden, weight, bias_t])
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=TOLERANCE)
    for grad, expected in zip(got, want, strict=True):
        assert bool(torch.isfinite(grad).all())
        torch.testing.assert_close(grad, expected, rtol=0, atol=TOLERANCE)


def test_a_vocabulary_all_at_minus_infinity_gives_nan_and_no_gradient() -> None:
    hidden, weight, _, targets, weights = head(False)
    bias = torch.full((VOCAB,), -torch.inf, requires_grad=True)
    logp, entropy = vocab_chunked_logprobs(hidden, weight, bias, targets, 1.0, 16, 100, True)
    assert bool(logp.isnan().all()) and bool(entropy.isnan().all())
    grads = gradients(torch.nan_to_num(logp), weights, [hidden, weight, bias])
    assert all(bool((grad == 0).all()) for grad in grads)


def test_bfloat16_products_give_the_log_probs_of_their_rounded_logits() -> None:
    """In bfloat16 the product's output is rounded and then divided by the temperature in
    float32 (as vLLM samples); the taken token's logit, a row of the head, is rounded the same
    way, so log-probs stay those of the rounded logits (at most 0: no logit above log Z)."""
    hidden, weight, _, targets, weights = head(False)
    h, w = hidden.detach().bfloat16(), weight.detach().bfloat16()
    logits = (h @ w.t()).float() / 0.7
    want = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logp, _ = vocab_chunked_logprobs(h, w, None, targets, 0.7, 16, 100, True)
    assert logp.dtype == torch.float32 and bool((logp <= 0).all())
    torch.testing.assert_close(logp, want, rtol=0, atol=1e-4)
    h.requires_grad_()
    logp, _ = vocab_chunked_logprobs(h, w, None, targets, 0.7, 16, 100, False)
    (grad,) = torch.autograd.grad((logp * weights).sum(), [h])
    assert grad.dtype == torch.bfloat16 and bool(torch.isfinite(grad).all())


def test_auto_is_eager_off_cuda() -> None:
    assert KERNELS.get("auto", torch.device("cpu"), torch.float32, 1.0) == (
        block_stats,
        block_probs,
    )
    assert KERNELS.get("torch", torch.device("cpu"), torch.bfloat16, 2.0) == (
        block_stats,
        block_probs,
    )


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs g++")
def test_the_compiled_kernel_equals_the_eager_one() -> None:
    """On CPU (inductor's C++ backend) the same functions as on CUDA; blocks of one shape (two
    chunks of 35 positions, the whole vocabulary) so that each compiles once."""
    hidden, weight, bias_t, targets, weights = head(True)
    assert bias_t is not None
    tensors = [hidden, weight, bias_t]
    results = []
    kernels: tuple[LogprobKernel, ...] = ("torch", "compiled")
    for kernel in kernels:
        logp, entropy = vocab_chunked_logprobs(
            hidden, weight, bias_t, targets, 0.8, 35, VOCAB, True, kernel
        )
        results.append((logp, entropy, gradients(logp, weights, tensors)))
    (logp, entropy, got), (c_logp, c_entropy, c_got) = results
    torch.testing.assert_close(c_logp, logp, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(c_entropy, entropy, rtol=0, atol=TOLERANCE)
    for grad, expected in zip(c_got, got, strict=True):
        torch.testing.assert_close(grad, expected, rtol=0, atol=TOLERANCE)
