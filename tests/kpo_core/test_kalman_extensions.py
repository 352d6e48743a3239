"""Beyond the paper: per-response R (staleness-aware), per-token Q (adaptive), still parallel."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from kpo_core.config import AdaptiveNoise, KalmanEstimator
from kpo_core.kalman import adaptive_process_noise, filter_gains, kalman_filter, kalman_gains
from kpo_core.losses import policy_loss
from kpo_core.ratios import kalman_noise, kalman_ratio
from tests.kpo_core.test_kalman import make_mask, scalar_reference


def varying_reference(z, valid, q, r, p0, x0):
    """The textbook recursion in Python floats with a per-token q list and a scalar r."""
    x, p, out = x0, p0, []
    for zt, mt, qt in zip(z, valid, q, strict=True):
        if mt:
            p_prior = p + qt
            k = p_prior / (p_prior + r)
            x = x + k * (zt - x)
            p = (1.0 - k) * p_prior
        out.append(x)
    return out


@pytest.mark.parametrize("kind", ["right", "left", "interior"])
def test_per_response_r_equals_each_rows_own_filter(kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    z = torch.randn(5, 200, generator=g, dtype=torch.float64)
    mask = make_mask(kind, 5, 200, g)
    r = torch.tensor([1.0, 3.0, 1.0, 0.25, 9.0], dtype=torch.float64)
    x = kalman_filter(z, mask, 1e-3, r, p0=0.5, x0=0.1)
    for row in range(5):
        expected = scalar_reference(
            z[row].tolist(), mask[row].tolist(), 1e-3, float(r[row]), 0.5, 0.1
        )
        torch.testing.assert_close(x[row], torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["right", "interior"])
@pytest.mark.parametrize("p0", [0.0, 2.0])
def test_per_token_q_matches_the_textbook_recursion(kind: str, p0: float) -> None:
    g = torch.Generator().manual_seed(2)
    z = torch.randn(4, 300, generator=g, dtype=torch.float64)
    mask = make_mask(kind, 4, 300, g)
    # Q spanning seven orders of magnitude along the sequence, and a step change.
    q = 10.0 ** (-7 + 6 * torch.rand(4, 300, generator=g, dtype=torch.float64))
    q[:, 150:] = 1e-2
    r = torch.tensor([1.0, 0.5, 2.0, 1.0], dtype=torch.float64)
    x = kalman_filter(z, mask, q, r, p0=p0, x0=-0.2)
    for row in range(4):
        expected = varying_reference(
            z[row].tolist(), mask[row].tolist(), q[row].tolist(), float(r[row]), p0, -0.2
        )
        torch.testing.assert_close(
            x[row], torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0
        )


def test_constant_tensor_noise_equals_scalar_noise() -> None:
    g = torch.Generator().manual_seed(3)
    z = 0.3 * torch.randn(3, 500, generator=g)
    mask = make_mask("right", 3, 500, g)
    scalar = kalman_filter(z, mask, 1e-4, 1.0)
    as_tensors = kalman_filter(
        z, mask, torch.full(z.shape, 1e-4, dtype=torch.float64), torch.ones(3)
    )
    torch.testing.assert_close(as_tensors, scalar, atol=2e-7, rtol=0)


def test_per_token_gains_at_131072_tokens_match_the_table_and_stay_finite() -> None:
    # The 2x2 prefix products run over 2^17 steps: rescaling must keep them in range.
    mask = torch.ones(1, 131072, dtype=torch.bool)
    q = torch.full((1, 131072), 1e-6, dtype=torch.float64)
    gains = filter_gains(mask, q, 1.0)
    assert bool(torch.isfinite(gains).all())
    torch.testing.assert_close(gains[0], kalman_gains(131072, 1e-6, 1.0), atol=1e-12, rtol=1e-9)


def test_gradient_through_per_token_filter_equals_autograd_of_the_loop() -> None:
    g = torch.Generator().manual_seed(4)
    z = torch.randn(2, 64, generator=g, dtype=torch.float64, requires_grad=True)
    mask = make_mask("interior", 2, 64, g)
    q = 10.0 ** (-4 + 3 * torch.rand(2, 64, generator=g, dtype=torch.float64))
    r = torch.tensor([0.5, 2.0], dtype=torch.float64)
    weights = torch.randn(2, 64, generator=g, dtype=torch.float64)
    (grad_parallel,) = torch.autograd.grad((kalman_filter(z, mask, q, r) * weights).sum(), z)
    reference = kalman_filter(z, mask, q, r, method="sequential")
    (grad_loop,) = torch.autograd.grad((reference * weights).sum(), z)
    torch.testing.assert_close(grad_parallel, grad_loop)


def test_closed_form_and_bad_tensor_noise_are_refused_by_name() -> None:
    z, mask = torch.zeros(2, 8), torch.ones(2, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="closed_form"):
        kalman_filter(z, mask, torch.full((2, 8), 1e-3), 1.0, method="closed_form")
    with pytest.raises(ValueError, match="tensor r must have one value per response"):
        kalman_filter(z, mask, 1e-3, torch.ones(2, 8))
    with pytest.raises(ValueError, match="tensor q must have z's shape"):
        kalman_filter(z, mask, torch.full((2,), 1e-3), 1.0)
    with pytest.raises(ValueError, match=r"r \(measurement noise variance\) must be finite and >"):
        kalman_filter(z, mask, 1e-3, torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"q \(process noise variance\) must be finite"):
        kalman_filter(z, mask, torch.full((2, 8), math.nan), 1.0)


# --- staleness-aware R -------------------------------------------------------------------


def test_staleness_scales_r_per_response_and_smooths_older_rows_harder() -> None:
    cfg = KalmanEstimator(q=1e-3, staleness_alpha=0.5)
    z = torch.zeros(3, 10)
    mask = torch.ones(3, 10, dtype=torch.bool)
    q, r = kalman_noise(z, mask, cfg, torch.tensor([0, 2, 8]))
    assert q == 1e-3
    torch.testing.assert_close(r, torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64))
    gains = filter_gains(mask, q, r)
    assert bool((gains[0] > gains[1]).all()) and bool((gains[1] > gains[2]).all())
    # Without staleness information, or with alpha 0, R stays the configured scalar.
    assert kalman_noise(z, mask, cfg, None)[1] == 1.0
    assert kalman_noise(z, mask, KalmanEstimator(), torch.tensor([0, 2, 8]))[1] == 1.0


def test_staleness_aware_kalman_ratio_pulls_stale_rows_towards_one() -> None:
    # The same drifted log-ratios on a fresh and on a stale response: the stale one's filtered
    # ratio stays closer to 1.
    z = torch.full((2, 200), 0.5)
    mask = torch.ones(2, 200, dtype=torch.bool)
    logp = torch.zeros(2, 200, requires_grad=True)
    cfg = KalmanEstimator(q=1e-3, staleness_alpha=1.0, clipped=False)
    estimate = kalman_ratio(logp, -z, torch.ones(2, 200), mask, cfg, staleness=torch.tensor([0, 8]))
    fresh, stale = estimate.ratio[0, -1].item(), estimate.ratio[1, -1].item()
    assert 1.0 < stale < fresh < math.exp(0.5)


def test_policy_loss_rejects_staleness_of_the_wrong_shape() -> None:
    logp = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="staleness must have one value per response"):
        policy_loss(
            "kalman",
            logp,
            logp,
            torch.ones(2),
            torch.ones(2, 4, dtype=torch.bool),
            staleness=torch.zeros(2, 4),
        )


# --- adaptive Q ----------------------------------------------------------------------------


def test_adaptive_q_recovers_the_noise_ratio_of_a_local_level_series() -> None:
    # x: random walk with Q = 1/16, z = x + noise with R = 1/4, so Q/R = 0.25. Over a long
    # window the estimate is near it; the 2-standard-error margin biases it low, never high.
    g = torch.Generator().manual_seed(5)
    rows, length = 64, 2048
    walk = (0.25 * torch.randn(rows, length, generator=g, dtype=torch.float64)).cumsum(-1)
    z = walk + 0.5 * torch.randn(rows, length, generator=g, dtype=torch.float64)
    mask = torch.ones(rows, length, dtype=torch.bool)
    q = adaptive_process_noise(z, mask, r=1.0, q_min=1e-8, q_max=10.0, window=1024)
    median = q[:, -1].median().item()
    assert 0.15 < median < 0.3
    # r scales the estimated ratio: the filter gets Q_t = r * (Q/R)_hat.
    q_half = adaptive_process_noise(z, mask, r=0.5, q_min=1e-8, q_max=10.0, window=1024)
    torch.testing.assert_close(q_half[:, -1], 0.5 * q[:, -1])


def test_adaptive_q_stays_at_the_floor_on_white_noise_and_at_the_cap_on_a_trend() -> None:
    g = torch.Generator().manual_seed(6)
    noise = torch.randn(32, 1024, generator=g, dtype=torch.float64)
    mask = torch.ones(32, 1024, dtype=torch.bool)
    on_noise = adaptive_process_noise(noise, mask, r=1.0, q_min=1e-6, q_max=1e-2, window=128)
    assert (on_noise[:, 144:] > 1e-6).double().mean().item() < 0.03
    # A smooth trend: differences are constant, no white noise is visible (gamma1 >= 0).
    trend = torch.linspace(0, 5, 1024, dtype=torch.float64).expand(32, 1024)
    on_trend = adaptive_process_noise(trend, mask, r=1.0, q_min=1e-6, q_max=1e-2, window=64)
    assert bool((on_trend[:, 100:] == 1e-2).all())


def test_adaptive_q_is_causal_and_ignores_padding() -> None:
    g = torch.Generator().manual_seed(7)
    z = torch.randn(2, 300, generator=g, dtype=torch.float64)
    mask = make_mask("interior", 2, 300, g)
    q = adaptive_process_noise(z, mask, 1.0, 1e-6, 1e-1, window=32)
    changed = z.clone()
    changed[:, 200:] += (torch.randn(2, 100, generator=g, dtype=torch.float64)).cumsum(-1)
    changed[~mask] = math.nan  # padding may hold anything
    q_changed = adaptive_process_noise(changed, mask, 1.0, 1e-6, 1e-1, window=32)
    # Q at token t reads z before t only: up to and including position 200 nothing moves.
    torch.testing.assert_close(q[:, :201], q_changed[:, :201])
    assert not torch.equal(q[:, 202:], q_changed[:, 202:])
    assert bool(torch.isfinite(q_changed).all())
    # Too few samples at the start: the floor.
    assert bool((q[:, :16] == 1e-6).all())


def test_adaptive_kalman_estimator_filters_with_the_estimated_q() -> None:
    g = torch.Generator().manual_seed(8)
    walk = (0.05 * torch.randn(4, 512, generator=g)).cumsum(-1)
    z = walk + 0.1 * torch.randn(4, 512, generator=g)
    mask = torch.ones(4, 512, dtype=torch.bool)
    cfg = KalmanEstimator(q=1e-6, adaptive_q=AdaptiveNoise(q_max=1e-1), clipped=False)
    logp = torch.zeros(4, 512)
    estimate = kalman_ratio(logp, -z, torch.ones(4, 512), mask, cfg)
    q = adaptive_process_noise(z, mask, 1.0, 1e-6, 1e-1)
    expected = kalman_filter(z, mask, q, 1.0).clamp(max=10.0).exp()
    torch.testing.assert_close(estimate.ratio, expected)
    assert estimate.metrics["kalman_q_mean"] == pytest.approx(float(q.mean()))
    # The walk is real signal (Q/R = 0.25): the adaptive filter tracks it far better than the
    # paper's fixed Q, which barely moves from 0.
    fixed = kalman_filter(z, mask, 1e-6, 1.0)
    adaptive = kalman_filter(z, mask, q, 1.0)
    assert (adaptive - walk).abs().mean() < 0.5 * (fixed - walk).abs().mean()


def test_adaptive_config_is_validated_by_field() -> None:
    with pytest.raises(ValidationError, match="q_max"):
        KalmanEstimator(q=1e-2, adaptive_q=AdaptiveNoise(q_max=1e-3))
    with pytest.raises(ValidationError, match="window"):
        AdaptiveNoise(window=8)
    with pytest.raises(ValidationError, match="lag"):
        AdaptiveNoise(lag=1)
    with pytest.raises(ValidationError, match="staleness_alpha"):
        KalmanEstimator(staleness_alpha=-1.0)
    with pytest.raises(ValueError, match="window must be >= 16"):
        adaptive_process_noise(torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool), 1.0, 0, 1, 8)
