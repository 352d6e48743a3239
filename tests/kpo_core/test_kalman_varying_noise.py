"""The filter with a per-response R and a per-token Q: exact, and still parallel."""

from __future__ import annotations

import math

import pytest
import torch

from kpo_core.kalman import filter_gains, kalman_filter, kalman_gains
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
