"""Each estimator against values worked out by hand, and the KPO and CTPO special cases."""

from __future__ import annotations

import math

import pytest
import torch

from kpo_core.config import CumulativeEstimator, OffPolicyCorrection
from kpo_core.losses import policy_loss
from kpo_core.ratios import behaviour_weights, cumulative_ratio


def tensors(z: list[list[float]], adv: list[float], mask: list[list[bool]] | None = None):
    """logp = -1 + z, ref_logp = -1: the token log-ratios are exactly z."""
    z_t = torch.tensor(z, dtype=torch.float64)
    logp = (-1.0 + z_t).requires_grad_()
    ref = torch.full_like(z_t, -1.0)
    m = torch.ones_like(z_t, dtype=torch.bool) if mask is None else torch.tensor(mask)
    return logp, ref, torch.tensor(adv, dtype=torch.float64), m


def test_token_by_hand() -> None:
    logp, ref, adv, mask = tensors([[math.log(1.5)], [math.log(1.5)], [math.log(4.0)]], [1, -1, -1])
    per_row = []
    for i in range(3):
        loss, metrics = policy_loss(
            "token", logp[i : i + 1], ref[i : i + 1], adv[i : i + 1], mask[i : i + 1]
        )
        per_row.append((loss.item(), metrics["clip_fraction"]))
    # A = 1, rho = 1.5: max(-1.5, -clip(1.5, 0.8, 1.2)) = max(-1.5, -1.2) = -1.2, clipped.
    assert per_row[0] == pytest.approx((-1.2, 1.0))
    # A = -1, rho = 1.5: max(1.5, 1.2) = 1.5 (the unclipped term wins), below the dual cap 3.
    assert per_row[1] == pytest.approx((1.5, 0.0))
    # A = -1, rho = 4: max(4, 1.2) = 4, then the dual clip caps it at c |A| = 3.
    assert per_row[2] == pytest.approx((3.0, 1.0))


def test_sequence_by_hand() -> None:
    logp, ref, adv, mask = tensors([[0.1, 0.3]], [1.0])
    loss, metrics = policy_loss("sequence", logp, ref, adv, mask)
    # s = exp((0.1 + 0.3)/2) = e^0.2 = 1.221403 > 1 + 4e-4: both tokens clipped at 1.0004.
    assert loss.item() == pytest.approx(-1.0004, abs=1e-12)
    assert metrics["clip_fraction"] == 1.0
    loss, _ = policy_loss("sequence", logp, ref, adv, mask, clip_high=1.0)
    loss.backward()
    # Unclipped: loss = mean over tokens of -s = -1.221403; d/dlogp_t = -s / 2 = -0.610701.
    assert loss.item() == pytest.approx(-math.exp(0.2), abs=1e-12)
    torch.testing.assert_close(
        logp.grad, torch.full((1, 2), -math.exp(0.2) / 2, dtype=torch.float64)
    )


def test_geometric_by_hand() -> None:
    logp, ref, adv, mask = tensors([[0.1, 0.5], [0.1, 0.5]], [1.0, -1.0])
    loss_pos, m_pos = policy_loss("geometric", logp[:1], ref[:1], adv[:1], mask[:1])
    loss_neg, m_neg = policy_loss("geometric", logp[1:], ref[1:], adv[1:], mask[1:])
    # A > 0: z~ = min(z, clamp(z, -0.4, 0.4)) = [0.1, 0.4]; rho = e^0.25 = 1.284025; loss -rho.
    assert loss_pos.item() == pytest.approx(-math.exp(0.25), abs=1e-12)
    assert m_pos["clip_fraction"] == 0.5
    # A < 0: z~ = max(z, clamp(z)) = [0.1, 0.5]; rho = e^0.3 = 1.349859; loss +rho.
    assert loss_neg.item() == pytest.approx(math.exp(0.3), abs=1e-12)
    assert m_neg["clip_fraction"] == 0.0


def test_kalman_by_hand() -> None:
    logp, ref, adv, mask = tensors([[0.2, 0.4]], [1.0])
    loss, metrics = policy_loss("kalman", logp, ref, adv, mask, q=1.0, r=1.0, clipped=False)
    # q = r = 1, p0 = 0: K1 = 1/2, x1 = 0.1; K2 = 3/5, x2 = 0.1 + 0.6 (0.4 - 0.1) = 0.28.
    # Unclipped loss = mean(-e^x) = -(e^0.1 + e^0.28)/2 = -(1.105171 + 1.323130)/2 = -1.214150.
    assert loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(0.28)) / 2, abs=1e-12)
    assert metrics["kalman_gain_mean"] == pytest.approx((0.5 + 0.6) / 2)
    assert metrics["filtered_ratio_mean"] == pytest.approx((math.exp(0.1) + math.exp(0.28)) / 2)
    loss.backward()
    # Straight-through: d/dlogp_t = -e^{x_t} / 2.
    expected = torch.tensor([[-math.exp(0.1) / 2, -math.exp(0.28) / 2]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)


def test_cumulative_by_hand() -> None:
    logp, ref, adv, mask = tensors([[0.1, 0.1, 0.1, 0.1]], [1.0])
    loss, metrics = policy_loss("cumulative", logp, ref, adv, mask)
    # c_t = 0.1 t; upper bound exp(0.05 sqrt t) = e^0.05, e^0.0707, e^0.0866, e^0.1: every c_t is
    # above it, so each token's loss is -exp(0.05 sqrt t); token-mean = -1.080044.
    expected = -sum(math.exp(0.05 * math.sqrt(t)) for t in range(1, 5)) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(-1.080044, abs=1e-6)
    assert metrics["clip_fraction"] == 1.0


def test_cumulative_clip_window_grows_with_sqrt_of_valid_count() -> None:
    logp = torch.zeros(1, 6, dtype=torch.float64)
    mask = torch.tensor([[True, False, True, True, False, True]])
    estimate = cumulative_ratio(logp, logp, torch.ones(1, 6), mask, CumulativeEstimator())
    n = torch.tensor([[1, 1, 2, 3, 3, 4]], dtype=torch.float64)  # valid tokens so far
    torch.testing.assert_close(estimate.clip_low, torch.exp(-0.025 * n.sqrt()))
    torch.testing.assert_close(estimate.clip_high, torch.exp(0.05 * n.sqrt()))
    torch.testing.assert_close(estimate.dual_clip, torch.exp(0.05 * n.sqrt()))


def test_kalman_with_huge_q_equals_token_without_dual_clip() -> None:
    generator = torch.Generator().manual_seed(1)
    logp = (
        -1 + 0.2 * torch.randn(3, 20, generator=generator, dtype=torch.float64)
    ).requires_grad_()
    ref = logp.detach() + 0.1 * torch.randn(3, 20, generator=generator, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.7, 0.4], dtype=torch.float64)
    mask = torch.rand(3, 20, generator=generator) > 0.2
    options = {"clip_low": 0.2, "clip_high": 0.2, "loss_agg_mode": "token-mean"}
    kpo, _ = policy_loss("kalman", logp, ref, adv, mask, q=1e12, **options)
    (kpo_grad,) = torch.autograd.grad(kpo, logp)
    grpo, _ = policy_loss("token", logp, ref, adv, mask, dual_clip_c=None, **options)
    (grpo_grad,) = torch.autograd.grad(grpo, logp)
    # Gains of 1 - 1e-12: the filtered log-ratio is the raw one to ~1e-12.
    torch.testing.assert_close(kpo, grpo, rtol=0, atol=1e-9)
    torch.testing.assert_close(kpo_grad, grpo_grad, rtol=0, atol=1e-9)


def test_kalman_with_zero_noise_keeps_ratio_exactly_one() -> None:
    logp, ref, adv, mask = tensors([[0.5, -0.3, 0.9]], [1.0])
    _, metrics = policy_loss("kalman", logp, ref, adv, mask, q=0.0, p0=0.0)
    assert metrics["ratio_mean"] == metrics["ratio_max"] == metrics["ratio_min"] == 1.0
    assert metrics["kalman_gain_mean"] == 0.0


def test_kalman_gradient_modes_differ_as_designed() -> None:
    logp, ref, adv, mask = tensors([[0.2, 0.4, -0.1]], [1.0])
    through, _ = policy_loss(
        "kalman", logp, ref, adv, mask, q=1.0, clipped=False, gradient="through_filter"
    )
    (g_through,) = torch.autograd.grad(through, logp)
    straight, _ = policy_loss("kalman", logp, ref, adv, mask, q=1.0, clipped=False)
    (g_straight,) = torch.autograd.grad(straight, logp)
    # Same value; straight-through sends each token only its own weight e^{x_t}/3, while the
    # filter path spreads token 1's gradient over later states: the last token gets only its
    # own gain K3 = 8/13 times its weight.
    torch.testing.assert_close(through, straight)
    assert g_through[0, 2].item() == pytest.approx(g_straight[0, 2].item() * 8 / 13, rel=1e-9)
    assert g_through[0, 0].item() != pytest.approx(g_straight[0, 0].item(), rel=1e-3)


def test_kpo_defaults_are_the_papers() -> None:
    logp, ref, adv, mask = tensors([[0.01] * 50], [1.0])
    _, metrics = policy_loss("kalman", logp, ref, adv, mask)
    # Q = 1e-6, R = 1, P0 = 0: K_t ~ t * 1e-6, mean over t = 1..50 ~ 25.5e-6.
    assert metrics["kalman_gain_mean"] == pytest.approx(25.5e-6, rel=1e-3)


def test_decoupled_weights_truncate_and_mask() -> None:
    ref = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]], dtype=torch.float64))
    behaviour = torch.log(torch.tensor([[0.5, 0.25, 0.1, 0.9]], dtype=torch.float64))
    mask = torch.ones(1, 4, dtype=torch.bool)
    # w = pi_ref / pi_behaviour = [1, 2, 5, 0.5556].
    w, metrics = behaviour_weights(ref, behaviour, mask, OffPolicyCorrection(tis_cap=3.0))
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 3.0, 5 / 9]], dtype=torch.float64))
    assert metrics["tis_truncated_fraction"] == 0.25
    w, metrics = behaviour_weights(
        ref, behaviour, mask, OffPolicyCorrection(mis_low=0.6, mis_high=4.0)
    )
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.0, 0.0]], dtype=torch.float64))
    assert metrics["mis_masked_fraction"] == 0.5
    w, _ = behaviour_weights(ref, behaviour, mask, OffPolicyCorrection(level="sequence"))
    # Sequence level: the product 1 * 2 * 5 * 5/9 = 50/9 on every token.
    torch.testing.assert_close(w, torch.full((1, 4), 50 / 9, dtype=torch.float64))


def test_decoupled_loss_multiplies_by_weight() -> None:
    logp, ref, adv, mask = tensors([[0.0, 0.0]], [1.0])
    behaviour = ref - torch.tensor([[math.log(2.0), 0.0]], dtype=torch.float64)
    loss, _ = policy_loss("token", logp, ref, adv, mask, behaviour_logp=behaviour, tis_cap=1.5)
    # rho = 1 on both tokens; weights min(2, 1.5) = 1.5 and 1: token-mean of -[1.5, 1] = -1.25.
    assert loss.item() == pytest.approx(-1.25)
