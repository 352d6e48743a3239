"""Every estimator on bad numbers: extreme log-ratios, overflowing inputs, empty responses.

The policy is docs/numerics.md: finite inputs, however extreme, give a finite loss, gradient and
metrics; the clip window still holds; tokens past MAX_ABS_LOG_RATIO are counted.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kpo_core.losses import policy_loss
from kpo_core.ratios import ESTIMATORS, LOG_RATIO_LIMIT, MAX_ABS_LOG_RATIO

B, T = 4, 9
LENGTHS = torch.tensor([9, 5, 7, 1])
MASK = torch.arange(T)[None] < LENGTHS[:, None]
# (estimator, options): every registered estimator, plus KPO's other two modes.
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    *((name, {}) for name in sorted(ESTIMATORS)),
    ("kalman", {"gradient": "through_filter"}),
    ("kalman", {"clipped": False}),
]
VARIANT_IDS = [name + "".join(f"-{v}" for v in opts.values()) for name, opts in VARIANTS]
EXTREME = [50.0, -50.0, 1e4, -1e4, 1e30, -1e30]


def base_logp(dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return (-1.0 + 0.3 * torch.randn(B, T, generator=generator, dtype=torch.float64)).to(dtype)


def loss_and_grad(
    name: str, logp: torch.Tensor, ref_logp: torch.Tensor, advantages: torch.Tensor, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    logp = logp.clone().requires_grad_()
    loss, metrics = policy_loss(name, logp, ref_logp, advantages, MASK, **kwargs)
    torch.autograd.backward(loss)
    assert logp.grad is not None
    return loss.detach(), logp.grad, metrics


def assert_finite(loss: torch.Tensor, grad: torch.Tensor, metrics: dict[str, float]) -> None:
    assert torch.isfinite(loss), loss
    assert torch.isfinite(grad).all(), grad
    bad = {key: value for key, value in metrics.items() if not math.isfinite(value)}
    assert not bad, bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("log_ratio", EXTREME)
@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=VARIANT_IDS)
def test_extreme_log_ratios_give_finite_loss_gradient_and_metrics(
    name: str, options: dict[str, Any], log_ratio: float, dtype: torch.dtype
) -> None:
    logp = base_logp(dtype)
    ref_logp = logp.clone()
    # Three extreme tokens in a row of each advantage sign, one in the 1-token row.
    ref_logp[0, 2:5] -= log_ratio
    ref_logp[1, 0:3] -= log_ratio
    ref_logp[3, 0] -= log_ratio
    ref_logp[2, 8] -= log_ratio  # padding: neither trained on nor counted
    advantages = torch.tensor([1.0, -0.5, 0.8, -1.2], dtype=dtype)
    loss, grad, metrics = loss_and_grad(name, logp, ref_logp, advantages, **options)
    assert_finite(loss, grad, metrics)
    assert metrics["extreme_ratio_tokens"] == 7.0
    # Bounded by |A| times the largest ratio any estimator lets through (e^20, the caps).
    assert abs(loss.item()) <= 1.2 * math.exp(MAX_ABS_LOG_RATIO)


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=VARIANT_IDS)
def test_log_ratios_that_overflow_float32_stay_finite(name: str, options: dict[str, Any]) -> None:
    # logp - ref_logp = +-6e38 is inf in float32, and a response mixing both signs would sum
    # to inf - inf = NaN: z is held to +-LOG_RATIO_LIMIT first.
    logp = torch.full((B, T), 3e38).where(torch.arange(T) % 2 == 0, -3e38)
    ref_logp = -logp
    assert torch.isinf(logp - ref_logp).all()
    advantages = torch.tensor([1.0, -0.5, 0.8, -1.2])
    loss, grad, metrics = loss_and_grad(name, logp, ref_logp, advantages, **options)
    assert_finite(loss, grad, metrics)
    assert metrics["extreme_ratio_tokens"] == float(MASK.sum())


def test_the_extreme_threshold_is_strict() -> None:
    logp = base_logp(torch.float64)
    ref_logp = logp.clone()
    ref_logp[0, 0] -= MAX_ABS_LOG_RATIO  # exactly at the threshold: not extreme
    ref_logp[0, 1] -= MAX_ABS_LOG_RATIO * 1.01
    ref_logp[1, 0] += MAX_ABS_LOG_RATIO * 1.01
    _, _, metrics = loss_and_grad("token", logp, ref_logp, torch.ones(B, dtype=torch.float64))
    assert metrics["extreme_ratio_tokens"] == 2.0
    assert LOG_RATIO_LIMIT > 1e4  # the bound on z never touches a log-ratio of +-1e4


def clip_bounds(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token [lo, hi] ratio window [B, T] of each estimator at its defaults."""
    ones = torch.ones(B, T, dtype=torch.float64)
    if name == "geometric":  # log-space clip of each z at +-0.4
        return ones * math.exp(-0.4), ones * math.exp(0.4)
    if name == "cumulative":  # [e^(-0.025 sqrt n_t), e^(0.05 sqrt n_t)]
        root_n = MASK.cumsum(-1).clamp_min(1).double().sqrt()
        return torch.exp(-0.025 * root_n), torch.exp(0.05 * root_n)
    if name == "token":
        return ones * 0.8, ones * 1.2
    return ones * (1 - 3e-4), ones * (1 + 4e-4)  # sequence, kalman


def aggregate(per_token: torch.Tensor, name: str) -> float:
    """The estimator's default aggregation of a per-token loss [B, T] over MASK."""
    if name in ("token", "cumulative"):  # token-mean
        return float(per_token[MASK].mean())
    rows = [per_token[b, MASK[b]].mean() for b in range(B)]  # seq-mean-token-mean
    return float(torch.stack(rows).mean())


# KPO's filter moves slowly (first gain ~1e-6): only log-ratios of 1e4 and more push its first
# filtered tokens out of the +-4e-4 window; the other estimators leave it from +-50 on.
CLIPPED = [
    (name, size)
    for name in ("token", "sequence", "geometric", "cumulative", "kalman")
    for size in ((1e4, 1e30) if name == "kalman" else (50.0, 1e4, 1e30))
]


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize(("name", "size"), CLIPPED)
def test_clipping_holds_at_extreme_ratios(name: str, size: float, sign: float) -> None:
    """A > 0 with z = +size, or A < 0 with z = -size: every token sits on its clip bound."""
    logp = base_logp(torch.float64)
    ref_logp = logp - sign * size
    advantages = torch.full((B,), sign, dtype=torch.float64)
    loss, grad, metrics = loss_and_grad(name, logp, ref_logp, advantages)
    lo, hi = clip_bounds(name)
    # l = -A clip(rho): -hi for A = +1, +lo for A = -1.
    expected = aggregate(-hi if sign > 0 else lo, name)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert metrics["clip_fraction"] == 1.0
    assert torch.count_nonzero(grad) == 0  # the surrogate is flat past the clip


@pytest.mark.parametrize("size", [50.0, 1e4, 1e30])
def test_the_dual_clip_caps_a_negative_advantage_at_extreme_ratios(size: float) -> None:
    logp = base_logp(torch.float64)
    advantages = torch.full((B,), -1.0, dtype=torch.float64)
    loss, grad, _ = loss_and_grad("token", logp, logp - size, advantages)
    assert loss.item() == pytest.approx(3.0, rel=1e-12)  # c |A| with c = 3
    assert torch.count_nonzero(grad) == 0
    # CTPO's dual clip: rho capped at e^(0.05 sqrt n_t) per token.
    loss, _, _ = loss_and_grad("cumulative", logp, logp - size, advantages)
    root_n = MASK.cumsum(-1).clamp_min(1).double().sqrt()
    assert loss.item() == pytest.approx(aggregate(torch.exp(0.05 * root_n), "cumulative"))


def test_gmpo_caps_its_ratio_where_the_sign_trick_leaves_it_open() -> None:
    # A < 0 keeps z~ = max(z, clamp(z)) = z for z > 0: GMPO's own code would give exp(1e4/n).
    logp = base_logp(torch.float64)
    advantages = torch.full((B,), -1.0, dtype=torch.float64)
    loss, grad, metrics = loss_and_grad("geometric", logp, logp - 1e4, advantages)
    assert metrics["ratio_max"] == pytest.approx(math.exp(MAX_ABS_LOG_RATIO))
    assert loss.item() == pytest.approx(math.exp(MAX_ABS_LOG_RATIO))
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("log_weight", [50.0, -50.0, 1e4, -1e4, 1e30, -1e30])
@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=VARIANT_IDS)
def test_extreme_behaviour_weights_are_finite_and_counted(
    name: str, options: dict[str, Any], log_weight: float, level: str
) -> None:
    logp = base_logp(torch.float64)
    behaviour = logp.clone()
    behaviour[0, :3] -= log_weight  # log w = ref - behaviour = +log_weight on 3 tokens
    advantages = torch.tensor([1.0, -0.5, 0.8, -1.2], dtype=torch.float64)
    loss, grad, metrics = loss_and_grad(
        name, logp, logp.clone(), advantages, behaviour_logp=behaviour, tis_level=level, **options
    )
    assert_finite(loss, grad, metrics)
    assert metrics["extreme_ratio_tokens"] == 3.0
    capped = loss_and_grad(
        name, logp, logp.clone(), advantages, behaviour_logp=behaviour, tis_cap=2.0, **options
    )
    assert_finite(*capped)
    assert capped[2]["behaviour_weight_max"] <= 2.0  # truncation still holds


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("shape", [(B, 0), (0, T), (B, T)], ids=["no-tokens", "no-rows", "empty"])
def test_responses_without_valid_tokens_give_zero_loss_and_gradient(
    name: str, options: dict[str, Any], shape: tuple[int, int]
) -> None:
    logp = torch.full(shape, -1.0, dtype=torch.float64, requires_grad=True)
    ref_logp = torch.full(shape, float("nan"), dtype=torch.float64)  # never read
    mask = torch.zeros(shape, dtype=torch.bool)
    advantages = torch.ones(shape[0], dtype=torch.float64)
    loss, metrics = policy_loss(name, logp, ref_logp, advantages, mask, **options)
    torch.autograd.backward(loss)
    assert loss.item() == 0.0
    assert logp.grad is None or torch.count_nonzero(logp.grad) == 0
    assert all(math.isfinite(value) for value in metrics.values()), metrics
    assert metrics["nonfinite_tokens"] == metrics["extreme_ratio_tokens"] == 0.0
