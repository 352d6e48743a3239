"""One shared suite that every registered estimator passes (STYLE.md habit 6)."""

from __future__ import annotations

import pytest
import torch

from kpo_core.losses import NonFiniteInputError, policy_loss
from kpo_core.ratios import ESTIMATORS

NAMES = sorted(ESTIMATORS)
B, T = 4, 9


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logp = -1.0 + 0.3 * torch.randn(B, T, generator=generator, dtype=torch.float64)
    ref_logp = logp + 0.05 * torch.randn(B, T, generator=generator, dtype=torch.float64)
    advantages = torch.tensor([1.0, -0.5, 0.8, -1.2], dtype=torch.float64)
    lengths = torch.tensor([9, 5, 7, 1])
    mask = torch.arange(T)[None] < lengths[:, None]
    return logp, ref_logp, advantages, mask


def loss_and_grad(name: str, logp, ref_logp, advantages, mask, **kwargs):
    logp = logp.clone().requires_grad_()
    loss, metrics = policy_loss(name, logp, ref_logp, advantages, mask, **kwargs)
    loss.backward()
    return loss.detach(), logp.grad, metrics


@pytest.mark.parametrize("name", NAMES)
def test_finite_scalar_loss_and_gradients_reach_logp(name: str) -> None:
    loss, grad, metrics = loss_and_grad(name, *batch())
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert grad is not None and torch.isfinite(grad).all()
    _, _, _, mask = batch()
    assert grad[mask].abs().sum() > 0
    for key in ("clip_fraction", "ratio_mean", "ratio_max", "ratio_min", "approx_kl"):
        assert key in metrics


@pytest.mark.parametrize("name", NAMES)
def test_zero_advantages_give_zero_gradient(name: str) -> None:
    logp, ref_logp, advantages, mask = batch()
    loss, grad, _ = loss_and_grad(name, logp, ref_logp, torch.zeros_like(advantages), mask)
    assert loss.item() == 0.0
    assert torch.count_nonzero(grad) == 0


@pytest.mark.parametrize("name", NAMES)
def test_on_policy_ratios_are_exactly_one(name: str) -> None:
    logp, _, advantages, mask = batch()
    _, _, metrics = loss_and_grad(name, logp, logp.clone(), advantages, mask)
    assert metrics["ratio_mean"] == 1.0
    assert metrics["ratio_max"] == 1.0
    assert metrics["ratio_min"] == 1.0
    assert metrics["clip_fraction"] == 0.0
    assert metrics["approx_kl"] == 0.0


def _relayout(tensor: torch.Tensor, mask: torch.Tensor, layout: str, fill: float) -> torch.Tensor:
    """Move each row's valid tokens to the left / right / into T+5 columns; pad with `fill`."""
    rows = []
    width = T + 5 if layout == "extra" else T
    for row, valid in zip(tensor, mask, strict=True):
        values = row[valid]
        pad = torch.full((width - values.numel(),), fill, dtype=tensor.dtype)
        rows.append(torch.cat([pad, values]) if layout == "left" else torch.cat([values, pad]))
    return torch.stack(rows)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", ["left", "extra"])
def test_padding_does_not_change_loss_or_gradient(name: str, layout: str) -> None:
    logp, ref_logp, advantages, mask = batch()
    loss, grad, _ = loss_and_grad(name, logp, ref_logp, advantages, mask)
    moved_mask = _relayout(torch.ones_like(logp), mask, layout, 0.0).bool()
    # Garbage in the padding (NaN, -inf) proves it is never read, in values or gradients.
    moved_logp = _relayout(logp, mask, layout, float("nan"))
    moved_ref = _relayout(ref_logp, mask, layout, float("-inf"))
    moved_loss, moved_grad, _ = loss_and_grad(name, moved_logp, moved_ref, advantages, moved_mask)
    torch.testing.assert_close(moved_loss, loss, rtol=0, atol=1e-12)
    assert torch.isfinite(moved_grad).all()
    torch.testing.assert_close(moved_grad[moved_mask], grad[mask], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which", ["logp", "ref_logp"])
def test_nonfinite_valid_input_raises(name: str, bad: float, which: str) -> None:
    logp, ref_logp, advantages, mask = batch()
    target = logp if which == "logp" else ref_logp
    target[0, 3] = bad
    with pytest.raises(NonFiniteInputError, match=which):
        policy_loss(name, logp, ref_logp, advantages, mask)


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_advantage_raises_and_mask_policy_reports(name: str) -> None:
    logp, ref_logp, advantages, mask = batch()
    advantages[1] = float("nan")
    with pytest.raises(NonFiniteInputError, match="advantages"):
        policy_loss(name, logp, ref_logp, advantages, mask)
    loss, grad, metrics = loss_and_grad(name, logp, ref_logp, advantages, mask, nonfinite="mask")
    # Row 1 has 5 valid tokens, all carrying the NaN advantage: they are dropped and counted.
    assert metrics["nonfinite_tokens"] == 5.0
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.count_nonzero(grad[1]) == 0


@pytest.mark.parametrize("name", NAMES)
def test_token_level_advantages_accepted(name: str) -> None:
    logp, ref_logp, advantages, mask = batch()
    per_token = advantages[:, None].expand(B, T).clone()
    loss_b, _, _ = loss_and_grad(name, logp, ref_logp, advantages, mask)
    loss_bt, _, _ = loss_and_grad(name, logp, ref_logp, per_token, mask)
    torch.testing.assert_close(loss_bt, loss_b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_behaviour_logp_equal_to_reference_changes_nothing(name: str) -> None:
    logp, ref_logp, advantages, mask = batch()
    plain, _, _ = loss_and_grad(name, logp, ref_logp, advantages, mask)
    decoupled, _, metrics = loss_and_grad(
        name, logp, ref_logp, advantages, mask, behaviour_logp=ref_logp.clone()
    )
    torch.testing.assert_close(decoupled, plain, rtol=0, atol=1e-12)
    assert metrics["behaviour_weight_mean"] == 1.0


def test_unknown_estimator_lists_valid_names() -> None:
    logp, ref_logp, advantages, mask = batch()
    with pytest.raises(ValueError, match="valid estimators: cumulative, geometric, kalman"):
        policy_loss("ppo2", logp, ref_logp, advantages, mask)


def test_unknown_option_names_it_and_lists_valid_options() -> None:
    logp, ref_logp, advantages, mask = batch()
    with pytest.raises(ValueError, match=r"clip_ratio[\s\S]*valid options for 'token'"):
        policy_loss("token", logp, ref_logp, advantages, mask, clip_ratio=0.2)


def test_shape_mismatch_is_named() -> None:
    logp, ref_logp, advantages, mask = batch()
    with pytest.raises(ValueError, match="ref_logp shape"):
        policy_loss("token", logp, ref_logp[:, :-1], advantages, mask)
    with pytest.raises(ValueError, match="advantages must have shape"):
        policy_loss("token", logp, ref_logp, advantages[:-1], mask)
