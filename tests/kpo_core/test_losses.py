"""Aggregation modes, entropy and KL, against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from kpo_core.config import LOSS_AGG_MODES, LossAggMode
from kpo_core.losses import (
    LossNormaliser,
    aggregate_loss,
    entropy_from_logits,
    kl_k3,
    token_entropy,
)

# Two responses: [1, 2, 3] (3 tokens) and [4, pad, pad] (1 token), plus an empty one.
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [99.0, 99.0, 99.0]])
MASK = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 10 / 4),  # (1 + 2 + 3 + 4) / 4 tokens
        ("seq-mean-token-mean", (2 + 4) / 2),  # means 2 and 4; the empty response is left out
        ("seq-mean-token-sum", (6 + 4) / 2),  # sums 6 and 4
        ("seq-mean-token-sum-norm", (6 / 3 + 4 / 3) / 2),  # sums over the padded length T = 3
        ("token-sum", 10.0),
    ],
)
def test_aggregation_modes(mode: str, expected: float) -> None:
    assert aggregate_loss(PER_TOKEN, MASK, mode).item() == pytest.approx(expected)  # type: ignore[arg-type]


def test_seq_mean_token_sum_norm_uses_fixed_length() -> None:
    loss = aggregate_loss(PER_TOKEN, MASK, "seq-mean-token-sum-norm", norm_length=10)
    assert loss.item() == pytest.approx((6 / 10 + 4 / 10) / 2)


def test_all_empty_batch_gives_zero_not_nan() -> None:
    empty = torch.zeros_like(MASK)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"):
        assert aggregate_loss(PER_TOKEN, empty, mode).item() == 0.0  # type: ignore[arg-type]


def test_unknown_mode_lists_valid_modes() -> None:
    with pytest.raises(ValueError, match="valid modes: token-mean"):
        aggregate_loss(PER_TOKEN, MASK, "mean")  # type: ignore[arg-type]


def test_entropy_of_uniform_and_one_hot() -> None:
    logits = torch.zeros(1, 2, 8)
    logits[0, 1] = torch.tensor([100.0] + [0.0] * 7)
    entropy = token_entropy(logits)
    # Uniform over 8: log 8 = 2.0794; a (near) one-hot: 7 e^-100 * 100 ~ 0.
    assert entropy[0, 0].item() == pytest.approx(math.log(8), abs=1e-6)
    assert entropy[0, 1].item() == pytest.approx(0.0, abs=1e-30)
    mean = entropy_from_logits(logits, torch.tensor([[True, False]]))
    assert mean.item() == pytest.approx(math.log(8), abs=1e-6)


def test_chunked_entropy_equals_direct_and_is_differentiable() -> None:
    logits = torch.randn(3, 50, 97, generator=torch.Generator().manual_seed(0), requires_grad=True)
    direct = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    chunked = token_entropy(logits, chunk_tokens=7)
    torch.testing.assert_close(chunked, direct, rtol=0, atol=1e-5)
    mask = torch.rand(3, 50) > 0.5
    entropy_from_logits(logits, mask, chunk_tokens=16).backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_kl_k3_by_hand() -> None:
    logp = torch.tensor([math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.5), math.log(0.5)])
    # d = ref - logp = [0, log 2]: k3 = e^d - d - 1 = [0, 2 - 0.693147 - 1] = [0, 0.306853].
    torch.testing.assert_close(kl_k3(logp, ref), torch.tensor([0.0, 1.0 - math.log(2)]))


def test_entropy_ignores_zero_probability_tokens() -> None:
    # Two of four logits at -inf: the entropy of the other two, uniform, is log 2 (0 log 0 = 0).
    logits = torch.tensor([[[0.0, -math.inf, 0.0, -math.inf]]], requires_grad=True)
    entropy = token_entropy(logits)
    assert entropy.item() == pytest.approx(math.log(2), abs=1e-6)
    entropy.sum().backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())
    # A NaN logit is not hidden: the entropy of that position is NaN.
    assert token_entropy(torch.tensor([[[0.0, math.nan]]])).isnan().all()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_parts_normalised_by_the_whole_add_up_to_the_whole(mode: LossAggMode) -> None:
    """Row splits (micro-batches, ranks) each divided by the whole minibatch's counts sum to the
    loss of the whole; with their own counts they would not (the parts differ in size)."""
    generator = torch.Generator().manual_seed(5)
    per_token = torch.randn(6, 9, generator=generator, dtype=torch.float64)
    mask = torch.rand(6, 9, generator=generator) < 0.7
    mask[2] = False  # an empty response: left out of the sequence count
    whole = aggregate_loss(per_token, mask, mode, norm_length=12)
    normaliser = LossNormaliser.of(mask)
    assert normaliser.sequences == float((mask.sum(-1) > 0).sum()) == 5.0
    parts = [torch.tensor([0, 3]), torch.tensor([1, 2, 4, 5])]
    split = sum(aggregate_loss(per_token[rows], mask[rows], mode, 12, normaliser) for rows in parts)
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=0.0)
    if mode != "token-sum":
        unnormalised = sum(aggregate_loss(per_token[rows], mask[rows], mode, 12) for rows in parts)
        assert not torch.isclose(unnormalised, whole)


def test_parts_cropped_to_their_own_width_still_divide_by_the_whole_width() -> None:
    """seq-mean-token-sum-norm without norm_length divides by the padded width: a micro-batch
    of short rows, cropped to its own width, must still divide by the minibatch's."""
    per_token = torch.arange(1.0, 13.0, dtype=torch.float64).reshape(3, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    mode: LossAggMode = "seq-mean-token-sum-norm"
    whole = aggregate_loss(per_token, mask, mode)
    normaliser = LossNormaliser.of(mask)
    assert normaliser.width == 4
    short_rows = aggregate_loss(per_token[1:, :2], mask[1:, :2], mode, None, normaliser)
    long_row = aggregate_loss(per_token[:1], mask[:1], mode, None, normaliser)
    torch.testing.assert_close(short_rows + long_row, whole, rtol=1e-12, atol=0.0)
    assert LossNormaliser.of(mask, width=7).width == 7
