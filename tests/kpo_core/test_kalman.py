"""The Kalman filter: gains, parallel == sequential recursion, masking, gradients, long inputs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kpo_core import kalman
from kpo_core.kalman import kalman_filter, kalman_gains, steady_state_gain

Q_OVER_R = (1e-8, 1e-6, 1e-4, 1e-2, 1.0)
P0S = (0.0, 1.0, 1e6)


def scalar_reference(z: list[float], valid: list[bool], q: float, r: float, p0: float, x0: float):
    """The textbook recursion in Python floats (float64), independent of torch."""
    x, p, out = x0, p0, []
    for zt, mt in zip(z, valid, strict=True):
        if mt:
            p_prior = p + q
            k = p_prior / (p_prior + r)
            x = x + k * (zt - x)
            p = (1.0 - k) * p_prior
        out.append(x)
    return out


def make_mask(kind: str, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    pos = torch.arange(length)
    if kind == "right":
        return pos < lengths[:, None]
    if kind == "left":
        return pos >= (length - lengths)[:, None]
    if kind == "interior":
        return torch.rand(batch, length, generator=generator) > 0.35
    raise AssertionError(kind)


def test_gains_by_hand() -> None:
    # q = r = 1, p0 = 0: P- = 1, K1 = 1/2, P = 1/2; P- = 3/2, K2 = 3/5, P = 3/5;
    # P- = 8/5, K3 = 8/13.
    gains = kalman_gains(3, q=1.0, r=1.0)
    assert gains.dtype == torch.float64
    torch.testing.assert_close(gains, torch.tensor([0.5, 0.6, 8 / 13], dtype=torch.float64))


def test_gains_converge_to_steady_state_and_start_small() -> None:
    # With P0 = 0 the first gain is Q / (Q + R) ~ 1e-6 and the steady state is ~1e-3 (SPEC).
    gains = kalman_gains(100_000, q=1e-6, r=1.0)
    assert gains[0].item() == pytest.approx(1e-6 / (1e-6 + 1.0), rel=1e-12)
    k_inf = steady_state_gain(1e-6, 1.0)
    assert k_inf == pytest.approx(9.995e-4, rel=1e-3)
    assert gains[-1].item() == pytest.approx(k_inf, rel=1e-9)
    # Below ~1000 tokens K_t ~ t Q / R.
    assert gains[99].item() == pytest.approx(100e-6, rel=0.01)


def test_gains_p0_huge_first_gain_near_one() -> None:
    assert kalman_gains(1, q=1e-6, r=1.0, p0=1e6)[0].item() == pytest.approx(1.0, abs=2e-6)


@pytest.mark.parametrize("kind", ["right", "left", "interior"])
@pytest.mark.parametrize("length", [1, 2, 63, 64, 65, 1000, 4097])
def test_parallel_equals_sequential_float64(kind: str, length: int) -> None:
    generator = torch.Generator().manual_seed(length)
    z = torch.randn(3, length, generator=generator, dtype=torch.float64)
    mask = make_mask(kind, 3, length, generator)
    for q in Q_OVER_R:
        for p0 in P0S:
            expected = kalman_filter(z, mask, q, 1.0, p0, x0=0.25, method="sequential")
            actual = kalman_filter(z, mask, q, 1.0, p0, x0=0.25)
            error = (actual - expected)[mask].abs().max().item()
            assert error < 1e-6, (q, p0, error)


@pytest.mark.parametrize("q", Q_OVER_R)
@pytest.mark.parametrize("p0", [0.0, 1e6])
def test_parallel_matches_recursion_at_131072_tokens(q: float, p0: float) -> None:
    length = 131_072
    generator = torch.Generator().manual_seed(7)
    z32 = (0.5 * torch.randn(1, length, generator=generator)).float()
    mask = torch.ones(1, length, dtype=torch.bool)
    mask[0, 1000:1100] = False  # an interior hole must hold the state
    expected = torch.tensor(
        scalar_reference(z32[0].double().tolist(), mask[0].tolist(), q, 1.0, p0, 0.0),
        dtype=torch.float64,
    )
    for z in (z32.double(), z32):
        actual = kalman_filter(z, mask, q, 1.0, p0)[0].double()
        assert (actual - expected).abs().max().item() < 1e-6, z.dtype


def test_official_closed_form_drifts_where_ours_does_not() -> None:
    length = 131_072
    z = 0.5 * torch.randn(1, length, generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(z, dtype=torch.bool)
    expected = torch.tensor(
        scalar_reference(z[0].double().tolist(), [True] * length, 1e-6, 1.0, 0.0, 0.0)
    )
    closed = kalman_filter(z, mask, 1e-6, 1.0, method="closed_form")[0].double()
    ours = kalman_filter(z, mask, 1e-6, 1.0)[0].double()
    # The closed form divides by prod(1 - K), which hits its 1e-30 clamp after ~70k tokens
    # (prod ~ exp(-K_inf t) with K_inf ~ 1e-3): past that point its error is macroscopic.
    assert (closed - expected)[100_000:].abs().max().item() > 1e-3
    assert (ours - expected).abs().max().item() < 1e-6


def test_masked_tokens_hold_state_and_stay_finite() -> None:
    z = torch.tensor([[float("nan"), 0.4, float("-inf"), 0.8, float("inf")]], dtype=torch.float64)
    mask = torch.tensor([[False, True, False, True, False]])
    x = kalman_filter(z, mask, q=1.0, r=1.0, x0=0.1)
    # Before any valid token the state is x0; K1 = 1/2: x = 0.1 + (0.4 - 0.1)/2 = 0.25, held;
    # K2 = 3/5: x = 0.25 + 0.6 (0.8 - 0.25) = 0.58, held.
    torch.testing.assert_close(
        x, torch.tensor([[0.1, 0.25, 0.25, 0.58, 0.58]], dtype=torch.float64)
    )


def test_padding_layout_does_not_change_valid_values() -> None:
    values = torch.randn(10, dtype=torch.float64)
    right = torch.cat([values, torch.full((4,), 1e9, dtype=torch.float64)])[None]
    left = torch.cat([torch.full((4,), -1e9, dtype=torch.float64), values])[None]
    right_mask = torch.arange(14)[None] < 10
    left_mask = torch.arange(14)[None] >= 4
    x_right = kalman_filter(right, right_mask, 1e-2, 1.0)[right_mask]
    x_left = kalman_filter(left, left_mask, 1e-2, 1.0)[left_mask]
    torch.testing.assert_close(x_right, x_left, rtol=0, atol=1e-12)


@pytest.mark.parametrize("q", [1e-6, 1e-2, 1.0])
def test_gradient_equals_autograd_through_recursion(q: float) -> None:
    generator = torch.Generator().manual_seed(11)
    z = torch.randn(4, 300, generator=generator, dtype=torch.float64, requires_grad=True)
    mask = make_mask("interior", 4, 300, generator)
    upstream = torch.randn(4, 300, generator=generator, dtype=torch.float64)
    (kalman_filter(z, mask, q, 1.0, p0=1.0, x0=0.2) * upstream).sum().backward()
    assert z.grad is not None
    ours = z.grad.clone()
    z.grad = None
    (kalman_filter(z, mask, q, 1.0, 1.0, 0.2, method="sequential") * upstream).sum().backward()
    torch.testing.assert_close(ours, z.grad, rtol=0, atol=1e-12)
    assert torch.all(ours[~mask] == 0)  # a masked observation never influences anything


def test_half_precision_input_is_filtered_in_float32() -> None:
    z = torch.randn(2, 500, generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(z, dtype=torch.bool)
    x = kalman_filter(z.bfloat16(), mask, 1e-2, 1.0)
    assert x.dtype == torch.bfloat16
    reference = kalman_filter(z.bfloat16().float(), mask, 1e-2, 1.0)
    torch.testing.assert_close(x, reference.bfloat16(), rtol=0, atol=0)


def test_leading_dimensions_are_batched() -> None:
    z = torch.randn(2, 3, 70, dtype=torch.float64)
    mask = torch.rand(2, 3, 70) > 0.2
    x = kalman_filter(z, mask, 1e-3, 1.0)
    torch.testing.assert_close(x[1, 2], kalman_filter(z[1, 2], mask[1, 2], 1e-3, 1.0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"q": -1.0, "r": 1.0}, "q"),
        ({"q": 1e-6, "r": 0.0}, "r"),
        ({"q": 1e-6, "r": 1.0, "p0": float("nan")}, "p0"),
        ({"q": 1e-6, "r": 1.0, "method": "fft"}, "valid methods"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    z = torch.zeros(1, 4)
    with pytest.raises(ValueError, match=message):
        kalman_filter(z, torch.ones_like(z, dtype=torch.bool), **kwargs)


def test_mask_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="mask shape"):
        kalman_filter(torch.zeros(2, 4), torch.ones(2, 5, dtype=torch.bool), 1e-6, 1.0)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 300),
    q=st.sampled_from(Q_OVER_R),
    r=st.sampled_from([1e-2, 1.0, 10.0]),
    p0=st.sampled_from(P0S),
    x0=st.floats(-2.0, 2.0),
    seed=st.integers(0, 2**16),
    density=st.floats(0.05, 1.0),
)
def test_property_parallel_equals_sequential(
    batch: int, length: int, q: float, r: float, p0: float, x0: float, seed: int, density: float
) -> None:
    generator = torch.Generator().manual_seed(seed)
    z = 3 * torch.randn(batch, length, generator=generator, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=generator) < density
    expected = kalman_filter(z, mask, q, r, p0, x0, method="sequential")
    actual = kalman_filter(z, mask, q, r, p0, x0)
    assert torch.isfinite(actual).all()
    assert (actual - expected).abs().max().item() < 1e-6
    if not mask.any():
        assert torch.all(actual == x0)


def test_steady_state_formula() -> None:
    # s = 1: K_inf = (-1 + sqrt 5) / 2, the golden-ratio conjugate.
    assert steady_state_gain(1.0, 1.0) == pytest.approx((math.sqrt(5) - 1) / 2, rel=1e-12)


# --- Right padding: the prefix path ----------------------------------------------------------


def right_padded(lengths: list[int], length: int) -> torch.Tensor:
    return torch.arange(length) < torch.tensor(lengths)[:, None]


def with_interior_row(z: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append a row with a hole: the batch is then no longer right-padded (the general path)."""
    hole = torch.ones(1, mask.shape[1], dtype=torch.bool)
    hole[0, 0] = False
    return torch.cat([z, z[:1]]), torch.cat([mask, hole])


def test_prefix_masks_are_detected() -> None:
    def lengths_of(mask: torch.Tensor) -> list[int] | None:
        found = kalman._prefix_lengths(mask.view(torch.uint8).to(torch.float32))
        return None if found is None else found.tolist()

    assert lengths_of(right_padded([0, 3, 5], 5)) == [0, 3, 5]
    assert lengths_of(right_padded([1], 1)) == [1]
    assert lengths_of(torch.tensor([[False, True, True]])) is None  # left padding
    assert lengths_of(torch.tensor([[True, False, True]])) is None  # interior hole


@pytest.mark.parametrize("length", [1, 15, 16, 17, 100, 257])
def test_prefix_path_equals_general_path_and_recursion(length: int) -> None:
    generator = torch.Generator().manual_seed(length)
    lengths = [0, length, *torch.randint(1, length + 1, (3,), generator=generator).tolist()]
    mask = right_padded(lengths, length)
    z = torch.randn(len(lengths), length, generator=generator, dtype=torch.float64)
    upstream = torch.randn(z.shape, generator=generator, dtype=torch.float64)
    z_general, mask_general = with_interior_row(z, mask)
    for q, p0, x0 in [(1e-6, 0.0, 0.0), (1e-2, 1.0, 0.3), (1.0, 1e6, -0.5), (0.0, 0.0, 0.2)]:
        zg = z.clone().requires_grad_()
        x = kalman_filter(zg, mask, q, 1.0, p0, x0)
        (x * upstream).sum().backward()
        zs = z.clone().requires_grad_()
        expected = kalman_filter(zs, mask, q, 1.0, p0, x0, method="sequential")
        (expected * upstream).sum().backward()
        general = kalman_filter(z_general, mask_general, q, 1.0, p0, x0)[: len(lengths)]
        torch.testing.assert_close(x, expected, rtol=0, atol=1e-10)
        torch.testing.assert_close(x, general, rtol=0, atol=1e-12)
        assert zg.grad is not None and zs.grad is not None
        torch.testing.assert_close(zg.grad, zs.grad, rtol=0, atol=1e-12)
        assert torch.all(zg.grad[~mask] == 0)
        assert torch.all(x[0] == x0)  # the all-masked row holds x0


def test_prefix_path_ignores_padding_contents() -> None:
    mask = right_padded([5, 40, 0], 40)
    z = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    clean = kalman_filter(z.masked_fill(~mask, 0.0), mask, 1e-2, 1.0)
    for fill in (float("nan"), float("inf"), float("-inf"), 1e30):
        zg = z.masked_fill(~mask, fill).requires_grad_()
        x = kalman_filter(zg, mask, 1e-2, 1.0)
        torch.testing.assert_close(x, clean, rtol=0, atol=0)
        x.sum().backward()
        assert zg.grad is not None and torch.all(zg.grad[~mask] == 0)


def test_prefix_tables_are_reused_across_lengths_dtypes_and_noise() -> None:
    kalman._table_cache.clear()
    generator = torch.Generator().manual_seed(4)
    z = torch.randn(2, 5000, generator=generator, dtype=torch.float64)
    lengths = [5000, 3111]
    results = {}
    # Short, then long (the cached tables grow past their first capacity), then short again,
    # in float64 and float32 and for two noise levels: each against the recursion.
    for q in (1e-3, 1e-5):
        for length in (50, 5000, 50):
            for dtype in (torch.float64, torch.float32):
                used = [min(n, length) for n in lengths]
                mask = right_padded(used, length)
                x = kalman_filter(z[:, :length].to(dtype), mask, q, 1.0)
                for row in range(len(used)):
                    expected = scalar_reference(
                        z[row, :length].to(dtype).double().tolist(),
                        mask[row].tolist(),
                        q,
                        1.0,
                        0.0,
                        0.0,
                    )
                    error = (
                        (x[row].double() - torch.tensor(expected, dtype=torch.float64)).abs().max()
                    )
                    assert error < (1e-12 if dtype == torch.float64 else 1e-6), (q, length, dtype)
                key = (q, length, dtype)
                if key in results:  # a slice of the grown tables gives the very same values
                    assert torch.equal(results[key], x)
                results[key] = x


@pytest.mark.parametrize("q", [1e-6, 1e-4, 1e-2])
def test_prefix_path_matches_recursion_at_131072_tokens(q: float) -> None:
    length = 131_072
    z = 0.5 * torch.randn(2, length, generator=torch.Generator().manual_seed(7))
    lengths = [length, 100_000]
    mask = right_padded(lengths, length)
    x = kalman_filter(z, mask, q, 1.0).double()
    for row in range(2):
        expected = scalar_reference(z[row].double().tolist(), mask[row].tolist(), q, 1.0, 0.0, 0.0)
        assert (x[row] - torch.tensor(expected, dtype=torch.float64)).abs().max() < 1e-6


# --- The official code -----------------------------------------------------------------------


def official_closed_form(z: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """The official form as written: gains by position, masked tokens observed as z = 0, no floor
    on the products, in z's dtype."""
    gains = kalman_gains(z.shape[-1], q, 1.0).to(z.dtype)
    products = torch.cumprod(1.0 - gains, -1)
    return products * torch.cumsum(gains * z * mask / products, -1)


def test_official_form_treats_padding_as_zero_observations() -> None:
    generator = torch.Generator().manual_seed(8)
    z = torch.randn(2, 60, generator=generator, dtype=torch.float64)
    right = right_padded([30, 60], 60)
    left = right.flip(-1)
    for mask, agrees in ((right, True), (left, False)):
        official = official_closed_form(z, mask, 1e-2)
        ours = kalman_filter(z, mask, 1e-2, 1.0)
        error = (official - ours)[mask].abs().max().item()
        assert (error < 1e-12) == agrees, error


@pytest.mark.parametrize("q", [5e-4, 1e-3, 1e-2])
def test_official_float32_form_overflows_near_87_over_sqrt_q(q: float) -> None:
    onset_scale = 87.0 / math.sqrt(q)
    length = int(1.5 * onset_scale)
    z = 0.5 * torch.randn(1, length, generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(z, dtype=torch.bool)
    products = torch.cumprod(1.0 - kalman_gains(length, q, 1.0).float(), -1)
    official = official_closed_form(z, mask, q)
    # 1 / prod(1 - K) overflows float32 (e^88.7) about 3% past 87 / sqrt(Q/R), the output
    # turns inf soon after, and once the product underflows to 0 (e^-103) it is NaN.
    overflow = int(torch.isinf(1.0 / products).nonzero()[0, 0])
    non_finite = int((~torch.isfinite(official[0])).nonzero()[0])
    underflow = int((products == 0).nonzero()[0, 0])
    assert 1.0 < overflow / onset_scale < 1.05
    assert overflow <= non_finite < 1.1 * onset_scale
    assert 1.15 < underflow / onset_scale < 1.25
    assert torch.isnan(official[0, underflow:]).all()
    # Ours stays finite, and so does our closed form (its floor of 1e-30 makes it drift instead).
    assert torch.isfinite(kalman_filter(z, mask, q, 1.0)).all()
    assert torch.isfinite(kalman_filter(z, mask, q, 1.0, method="closed_form")).all()
