"""KPO's options against hand-derived values and the sequential filter: length-matched
constants, the diffuse prior with its posterior-sd clip, the token backstop, the q = 0 control,
and the geometric-mean sequence weight of decoupled PPO."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from kpo_core.config import AlgorithmConfig, KalmanEstimator, OffPolicyCorrection
from kpo_core.kalman import filter_gains, kalman_filter
from kpo_core.losses import clipped_surrogate, policy_loss
from kpo_core.ratios import behaviour_weights, kalman_ratio, token_backstop

PAPER_Q = 1e-6


def log_ratios(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, ref_logp) whose token log-ratios are exactly z; logp requires grad."""
    return (-1.0 + z).requires_grad_(), torch.full_like(z, -1.0)


def shrinkage(gains: torch.Tensor) -> torch.Tensor:
    """W_t = 1 - prod_{s<=t} (1 - K_s), computed by a plain loop (the reference)."""
    out, keep = [], torch.ones(gains.shape[:-1], dtype=torch.float64)
    for t in range(gains.shape[-1]):
        keep = keep * (1.0 - gains[..., t])
        out.append(1.0 - keep)
    return torch.stack(out, -1)


def test_length_matching_scales_q_and_the_window_by_hand() -> None:
    cfg = KalmanEstimator(reference_length=64)
    # q_L = q (4096 / 64)^2 = 1e-6 * 4096 = 4.096e-3; the window widens by sqrt(64) = 8.
    assert cfg.effective_q == pytest.approx(4.096e-3, rel=1e-12)
    assert cfg.effective_clip == pytest.approx((2.4e-3, 3.2e-3), rel=1e-12)
    z = 0.05 * torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(z, dtype=torch.bool)
    logp, ref = log_ratios(z)
    estimate = kalman_ratio(logp, ref, torch.ones(3, 64, dtype=torch.float64), mask, cfg)
    expected = kalman_filter(z, mask, 4.096e-3, 1.0, method="sequential")
    torch.testing.assert_close(estimate.ratio.detach(), expected.exp(), rtol=1e-12, atol=1e-12)
    assert estimate.clip_low == pytest.approx(1 - 2.4e-3)
    assert estimate.clip_high == pytest.approx(1 + 3.2e-3)


def test_a_matched_response_ends_as_shrunk_as_the_papers_4096_tokens() -> None:
    # The continuous limit: W(t) = 1 - sech(t sqrt(q)), the same at t sqrt(q) = 4.096 whether
    # t = 4096 at the paper's q or t = L at q_L. 1 - sech(4.096) = 0.96664.
    limit = 1.0 - 1.0 / math.cosh(4.096)
    paper = filter_gains(torch.ones(1, 4096, dtype=torch.bool), PAPER_Q, 1.0)
    assert float(shrinkage(paper)[0, -1]) == pytest.approx(limit, abs=1e-3)
    for length in (64, 256, 1024):
        q = KalmanEstimator(reference_length=length).effective_q
        gains = filter_gains(torch.ones(1, length, dtype=torch.bool), q, 1.0)
        assert float(shrinkage(gains)[0, -1]) == pytest.approx(limit, abs=0.02), length
    # Unmatched, a 64-token response barely moves: W_64 ~ q 64^2 / 2 = 0.002.
    short = filter_gains(torch.ones(1, 64, dtype=torch.bool), PAPER_Q, 1.0)
    assert float(shrinkage(short)[0, -1]) == pytest.approx(PAPER_Q * 64 * 65 / 2, rel=0.01)


def test_auto_reference_length_is_the_runs_response_limit() -> None:
    algorithm = AlgorithmConfig(estimator=KalmanEstimator())  # `auto` is the default
    resolved = algorithm.with_response_length(96)
    assert isinstance(resolved.estimator, KalmanEstimator)
    assert resolved.estimator.reference_length == 96
    assert resolved.estimator.effective_q == pytest.approx(PAPER_Q * (4096 / 96) ** 2)
    # Unresolved (a loop of its own), no length is known: q and the window as given, never a
    # guess from the batch's padded width, which would make the loss depend on padding.
    z = torch.full((1, 64), 0.05, dtype=torch.float64)
    logp, ref = log_ratios(z)
    mask = torch.ones_like(z, dtype=torch.bool)
    advantages = torch.ones(1, dtype=torch.float64)
    unresolved = kalman_ratio(logp, ref, advantages, mask, KalmanEstimator())
    paper = kalman_ratio(logp, ref, advantages, mask, KalmanEstimator(reference_length=None))
    torch.testing.assert_close(unresolved.ratio, paper.ratio)
    assert (unresolved.clip_low, unresolved.clip_high) == (paper.clip_low, paper.clip_high)
    # Other estimators and explicit lengths pass through unchanged.
    token = AlgorithmConfig.model_validate({"estimator": {"name": "token"}})
    assert token.with_response_length(96) == token
    explicit = AlgorithmConfig(estimator=KalmanEstimator(reference_length=512))
    assert explicit.with_response_length(96) == explicit


def test_diffuse_gains_are_one_over_t_early_and_sqrt_q_late() -> None:
    cfg = KalmanEstimator(p0="diffuse")
    assert cfg.effective_p0 == 1e6
    gains = filter_gains(torch.ones(1, 20000, dtype=torch.bool), cfg.q, cfg.r, cfg.effective_p0)[0]
    t = torch.arange(1, 21, dtype=torch.float64)
    # Exactly 1/(t + r/P0) for q = 0; q = 1e-6 adds about q t^2 / 3 relative (1.3e-4 at 20).
    torch.testing.assert_close(
        gains[:20] * t, torch.ones(20, dtype=torch.float64), rtol=1.5e-4, atol=0
    )
    # Steady state K = (-s + sqrt(s^2 + 4 s)) / 2, s = q/r = 1e-6: 9.995e-4 ~ sqrt(q).
    assert float(gains[-1]) == pytest.approx((-1e-6 + math.sqrt(1e-12 + 4e-6)) / 2, rel=1e-6)
    assert float(shrinkage(gains[None, :50])[0].min()) == pytest.approx(1.0, abs=1e-5)


def test_diffuse_prior_with_q_zero_is_the_running_mean() -> None:
    z = torch.tensor([[0.3, -0.1, 0.4, 0.0, 0.2]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False, True, True]])
    cfg = KalmanEstimator(q=0.0, p0="diffuse", clipped=False)
    logp, ref = log_ratios(z)
    estimate = kalman_ratio(logp, ref, torch.ones_like(z), mask, cfg)
    # Causal means of the valid log-ratios; the masked token holds the state.
    means = [0.3, 0.1, 0.1, 0.2 / 3, 0.4 / 4]
    torch.testing.assert_close(
        estimate.ratio.detach().log(), torch.tensor([means], dtype=torch.float64), atol=1e-6, rtol=0
    )
    assert estimate.metrics["kalman_shrinkage_mean"] == pytest.approx(1.0, abs=1e-6)


def test_posterior_clip_window_by_hand() -> None:
    cfg = KalmanEstimator(p0="diffuse", clip_mode="posterior")
    n = 20000
    z = torch.zeros(1, n, dtype=torch.float64)
    mask = torch.ones_like(z, dtype=torch.bool)
    logp, ref = log_ratios(z)
    estimate = kalman_ratio(logp, ref, torch.ones_like(z), mask, cfg)
    assert isinstance(estimate.clip_low, torch.Tensor) and isinstance(
        estimate.clip_high, torch.Tensor
    )
    k_low, k_high = 3e-4 / PAPER_Q**0.25, 4e-4 / PAPER_Q**0.25  # 9.487e-3, 1.265e-2
    # First token: K ~ 1, so log rho within [-k_low, k_high].
    assert float(estimate.clip_low[0, 0].log()) == pytest.approx(-k_low, rel=1e-5)
    assert float(estimate.clip_high[0, 0].log()) == pytest.approx(k_high, rel=1e-5)
    # Tenth token: K ~ 1/10.
    assert float(estimate.clip_high[0, 9].log()) == pytest.approx(k_high / math.sqrt(10), rel=1e-4)
    # Steady state: sqrt(K_inf) / q^(1/4) = 0.99975, the paper's window to 3e-4 relative.
    assert float(estimate.clip_low[0, -1].log()) == pytest.approx(-3e-4, rel=3e-4)
    assert float(estimate.clip_high[0, -1].log()) == pytest.approx(4e-4, rel=3e-4)


def test_posterior_clip_binds_where_the_running_mean_leaves_its_window() -> None:
    # Three tokens of z = 0.05 under a diffuse prior: x = 0.05 throughout, above every
    # window k_high sqrt(K_t) <= 1.265e-2, so with A > 0 every token is clipped.
    z = torch.full((1, 3), 0.05, dtype=torch.float64)
    logp, ref = log_ratios(z)
    loss, metrics = policy_loss(
        "kalman", logp, ref, torch.ones(1), torch.ones(1, 3, dtype=torch.bool),
        p0="diffuse", clip_mode="posterior",
    )  # fmt: skip
    assert metrics["clip_fraction"] == 1.0
    loss.backward()
    assert logp.grad is not None and float(logp.grad.abs().max()) == 0.0


def test_token_backstop_masks_by_hand() -> None:
    z = torch.tensor([[0.5, 0.5, -0.5, -0.5, 0.1, 0.2]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, True, False]])
    flags = token_backstop(z, adv, mask, 0.2, 0.28)
    # e^0.5 = 1.65 > 1.28 with A > 0: out; with A < 0 it is not pushed further out. e^-0.5 =
    # 0.61 < 0.8 with A < 0: out; e^0.1 = 1.105 inside; the masked token never counts.
    assert flags.tolist() == [[True, False, False, True, False, False]]


def test_the_backstop_removes_only_those_tokens_gradients() -> None:
    z = torch.tensor([[0.5, 0.01, -0.5, 0.02]], dtype=torch.float64)
    adv = torch.tensor([1.0])
    mask = torch.ones_like(z, dtype=torch.bool)
    grads, losses, fractions = [], [], []
    for token_clip in (None, (0.2, 0.28)):
        logp, ref = log_ratios(z)
        options = {} if token_clip is None else {"token_clip": token_clip}
        loss, metrics = policy_loss(
            "kalman", logp, ref, adv, mask, clipped=False, loss_agg_mode="token-sum", **options
        )
        loss.backward()
        assert logp.grad is not None
        grads.append(logp.grad.clone())
        losses.append(loss.item())
        fractions.append((metrics["clip_fraction"], metrics.get("token_backstop_fraction")))
    assert losses[0] == pytest.approx(losses[1], abs=1e-15)  # the value is unchanged
    assert grads[1][0, 0] == 0.0 and grads[0][0, 0] != 0.0  # e^0.5 > 1.28 with A > 0
    torch.testing.assert_close(grads[1][0, 1:], grads[0][0, 1:])  # 0.61 < 0.8 but A > 0
    assert fractions == [(0.0, None), (0.25, 0.25)]


def test_backstop_in_the_surrogate_counts_as_clipped() -> None:
    from kpo_core.ratios import RatioEstimate

    ratio = torch.tensor([[1.0, 1.0]], dtype=torch.float64, requires_grad=True)
    backstop = torch.tensor([[True, False]])
    estimate = RatioEstimate(ratio, None, None, backstop=backstop)
    loss, clipped = clipped_surrogate(
        estimate, torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)
    )
    loss.sum().backward()
    assert clipped.tolist() == [[True, False]]
    assert ratio.grad is not None and ratio.grad.tolist() == [[0.0, -1.0]]


def test_q_zero_control_is_reinforce() -> None:
    z = 0.3 * torch.randn(4, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(z, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    logp, ref = log_ratios(z)
    loss, metrics = policy_loss("kalman", logp, ref, adv, mask, q=0.0, loss_agg_mode="token-sum")
    loss.backward()
    assert metrics["filtered_ratio_mean"] == 1.0 and metrics["clip_fraction"] == 0.0
    assert metrics["kalman_gain_mean"] == 0.0 and metrics["kalman_shrinkage_mean"] == 0.0
    # rho = 1 with the gradient of logp: d(-A rho)/dlogp = -A, the REINFORCE gradient.
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, -adv[:, None].expand_as(z))


def test_shrinkage_metric_by_hand() -> None:
    z = torch.tensor([[0.2, 0.4]], dtype=torch.float64)
    logp, ref = log_ratios(z)
    _, metrics = policy_loss("kalman", logp, ref, torch.ones(1), z.bool(), q=1.0, clipped=False)
    # K = 1/2, 3/5: W1 = 1/2, W2 = 1 - (1/2)(2/5) = 4/5; mean 0.65.
    assert metrics["kalman_shrinkage_mean"] == pytest.approx(0.65, abs=1e-12)


def test_sequence_mean_weights_are_the_geometric_mean() -> None:
    ref = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    behaviour = ref - torch.tensor([[0.2, -0.4, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    cfg = OffPolicyCorrection(level="sequence-mean")
    w, metrics = behaviour_weights(ref, behaviour, mask, cfg)
    # exp(mean(0.2, -0.4)) = e^-0.1 on both valid tokens; the product would be e^-0.2.
    assert w[0].tolist() == pytest.approx([math.exp(-0.1), math.exp(-0.1), 0.0], abs=1e-12)
    product, _ = behaviour_weights(ref, behaviour, mask, OffPolicyCorrection(level="sequence"))
    assert float(product[0, 0]) == pytest.approx(math.exp(-0.2), abs=1e-12)
    assert metrics["behaviour_weight_max"] == pytest.approx(math.exp(-0.1))


def test_sequence_mean_weights_stay_finite_on_long_responses() -> None:
    n = 20000
    ref = torch.zeros(1, n, dtype=torch.float64)
    behaviour = ref - 0.01  # log w = 0.01 per token: the product is e^200, capped at e^20
    mask = torch.ones(1, n, dtype=torch.bool)
    mean, _ = behaviour_weights(ref, behaviour, mask, OffPolicyCorrection(level="sequence-mean"))
    product, _ = behaviour_weights(ref, behaviour, mask, OffPolicyCorrection(level="sequence"))
    assert float(mean[0, 0]) == pytest.approx(math.exp(0.01))
    assert float(product[0, 0]) == pytest.approx(math.exp(20.0))


def test_tis_level_option_name_reaches_the_weights() -> None:
    z = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    logp, ref = log_ratios(z)
    behaviour = ref - torch.tensor([[0.2, -0.4]], dtype=torch.float64)
    _, metrics = policy_loss(
        "token", logp, ref, torch.ones(1), z == 0, behaviour_logp=behaviour,
        tis_level="sequence-mean",
    )  # fmt: skip
    assert metrics["behaviour_weight_mean"] == pytest.approx(math.exp(-0.1))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"clip_mode": "posterior", "clipped": False}, "is a clip window"),
        ({"clip_mode": "posterior", "q": 0.0}, "needs q > 0"),
        ({"p0": -1.0}, "p0 must be >= 0 or 'diffuse'"),
        ({"p0": "flat"}, "p0"),
        ({"reference_length": 0}, "reference_length must be >= 1"),
        ({"reference_length": "longest"}, "reference_length"),
        ({"token_clip": [1.2, 0.28]}, "token_clip"),
        ({"constants_length": 0}, "constants_length"),
    ],
)
def test_bad_options_name_the_field(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        KalmanEstimator.model_validate(options)
