"""Estimators on a multi-turn response: an observation (tool output) between two model turns.

One row of 8 columns: 3 model tokens, a 2-token observation, 2 model tokens, 1 pad:

    column   0    1    2    3    4    5    6    7
    kind     M    M    M    O    O    M    M    pad
    z        0.3 -0.1  0.2  .    .    0.4 -0.2  .

Observation tokens are masked positions (SPEC.md, "Multi-turn responses"). Their log-probs here
are deliberately far from anything (z = -4 if it were read), so that an estimator that read
them, or counted them in a length or a position, would be off by far more than the tolerance.
Expected values are derived by hand from each estimator's formulas on the 5 model tokens, and
each estimator must also give, on the model tokens, exactly what it gives for the same response
with the observation cut out.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kpo_core.config import (
    CumulativeEstimator,
    KalmanEstimator,
    OffPolicyCorrection,
    SequenceEstimator,
)
from kpo_core.kalman import kalman_filter
from kpo_core.losses import policy_loss
from kpo_core.ratios import (
    behaviour_weight_tensors,
    cumulative_ratio,
    kalman_ratio,
    sequence_ratio,
)

MODEL = [0, 1, 2, 5, 6]  # columns of the model tokens
GAPLESS = [0, 1, 2, 5, 6, 7]  # the row with the observation's columns cut out
Z = [0.3, -0.1, 0.2, 0.4, -0.2]  # the model tokens' log-ratios
OBSERVED_LOGP = -4.0  # an observation token's "log-prob": never to be read


def gap_row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, ref_logp, mask), each [1, 8] (float64, float64, bool)."""
    mask = torch.tensor([[True, True, True, False, False, True, True, False]])
    ref = torch.zeros(1, 8, dtype=torch.float64)
    ref[0, MODEL] = torch.tensor([-1.0, -0.5, -2.0, -0.7, -1.2], dtype=torch.float64)
    logp = ref.clone()
    logp[0, MODEL] += torch.tensor(Z, dtype=torch.float64)
    logp[0, [3, 4]] = OBSERVED_LOGP
    return logp, ref, mask


def cut(tensor: torch.Tensor) -> torch.Tensor:
    """The same row without the observation's columns."""
    return tensor[:, GAPLESS]


ADVANTAGES = torch.ones(1, 8, dtype=torch.float64)


# --- KPO ----------------------------------------------------------------------------------------
#
# Q = R = P0 = 1, x0 = 0. Per model token n: P- = P + 1, K = P- / (P- + 1), P = (1 - K) P-.
#   n = 1: P- = 2,      K = 2/3,   P = 2/3
#   n = 2: P- = 5/3,    K = 5/8,   P = 5/8
#   n = 3: P- = 13/8,   K = 13/21, P = 13/21
#   n = 4: P- = 34/21,  K = 34/55, P = 34/55   (the observation did not add Q twice)
#   n = 5: P- = 89/55,  K = 89/144
# x_n = x_{n-1} + K_n (z_n - x_{n-1}):
#   x1 = 2/3 * 3/10 = 1/5
#   x2 = 1/5 + 5/8 (-1/10 - 1/5) = 1/5 - 3/16 = 1/80
#   x3 = 1/80 + 13/21 (1/5 - 1/80) = 1/80 + 13/21 * 15/80 = 9/70
#   x4 = 9/70 + 34/55 (2/5 - 9/70) = 9/70 + 34/55 * 19/70 = 163/550
#   x5 = 163/550 + 89/144 (-1/5 - 163/550) = 163/550 - 89/144 * 273/550 = -1/96
KPO_GAINS = [2 / 3, 5 / 8, 13 / 21, 34 / 55, 89 / 144]
KPO_X = [1 / 5, 1 / 80, 9 / 70, 163 / 550, -1 / 96]


def kpo_config() -> KalmanEstimator:
    return KalmanEstimator(
        q=1.0, r=1.0, p0=1.0, reference_length=None, clip_mode="posterior",
        clip_low=0.1, clip_high=0.2,
    )  # fmt: skip


@pytest.mark.parametrize("method", ["parallel", "sequential"])
def test_kpo_filter_holds_its_state_across_the_observation(method: str) -> None:
    logp, ref, mask = gap_row()
    x = kalman_filter(logp - ref, mask, 1.0, 1.0, p0=1.0, method=method)  # type: ignore[arg-type]
    # Model tokens: the recursion above. Observation tokens and the pad: x3 and x5 held.
    expected = [*KPO_X[:3], KPO_X[2], KPO_X[2], *KPO_X[3:], KPO_X[4]]
    torch.testing.assert_close(x[0], torch.tensor(expected, dtype=torch.float64))


def test_kpo_ratio_and_clip_window_count_model_tokens_only() -> None:
    logp, ref, mask = gap_row()
    estimate = kalman_ratio(logp, ref, ADVANTAGES, mask, kpo_config())
    torch.testing.assert_close(estimate.ratio[0, MODEL].log(), torch.tensor(KPO_X).double())
    # Posterior window: log rho in [-k_low sqrt(K_n), k_high sqrt(K_n)], k = clip / (q/r)^(1/4)
    # = clip: the 4th model token (column 5) has gain 34/55, not the 6th token's 233/377.
    root_k = torch.tensor(KPO_GAINS, dtype=torch.float64).sqrt()
    assert isinstance(estimate.clip_low, torch.Tensor)
    assert isinstance(estimate.clip_high, torch.Tensor)
    torch.testing.assert_close(estimate.clip_low[0, MODEL], torch.exp(-0.1 * root_k))
    torch.testing.assert_close(estimate.clip_high[0, MODEL], torch.exp(0.2 * root_k))
    gain_mean = estimate.metrics["kalman_gain_mean"]
    assert float(gain_mean) == pytest.approx(sum(KPO_GAINS) / 5, abs=1e-12)


# --- CTPO ---------------------------------------------------------------------------------------
#
# c_n = z_1 + ... + z_n over model tokens: 0.3, 0.2, 0.4, 0.8, 0.6 (the observation adds 0).
# Window: log rho in [-0.1 sqrt(n), 0.2 sqrt(n)], dual cap exp(0.3 sqrt(n)), n = 1..5: the
# first token after the observation is the 4th model token (n = 4), not column 6.
CTPO_C = [0.3, 0.2, 0.4, 0.8, 0.6]
CTPO_N = [1.0, 2.0, 3.0, 4.0, 5.0]


def test_ctpo_sums_and_counts_model_tokens_only() -> None:
    logp, ref, mask = gap_row()
    config = CumulativeEstimator(clip_low=0.1, clip_high=0.2, dual_clip_c=0.3)
    estimate = cumulative_ratio(logp, ref, ADVANTAGES, mask, config)
    torch.testing.assert_close(estimate.ratio[0, MODEL].log(), torch.tensor(CTPO_C).double())
    root_n = torch.tensor(CTPO_N, dtype=torch.float64).sqrt()
    for bound, scale in ((estimate.clip_low, -0.1), (estimate.clip_high, 0.2)):
        assert isinstance(bound, torch.Tensor)
        torch.testing.assert_close(bound[0, MODEL], torch.exp(scale * root_n))
    assert isinstance(estimate.dual_clip, torch.Tensor)
    torch.testing.assert_close(estimate.dual_clip[0, MODEL], torch.exp(0.3 * root_n))


# --- GSPO ---------------------------------------------------------------------------------------
#
# s = exp(mean z over the 5 model tokens) = exp((0.3 - 0.1 + 0.2 + 0.4 - 0.2) / 5) = exp(0.12),
# on every model token (dividing by the 7 response positions would give exp(0.6 / 7)).
GSPO_LOG_S = 0.12


def test_gspo_length_and_mean_are_over_model_tokens_only() -> None:
    logp, ref, mask = gap_row()
    estimate = sequence_ratio(logp, ref, ADVANTAGES, mask, SequenceEstimator())
    expected = torch.full((5,), math.exp(GSPO_LOG_S), dtype=torch.float64)
    torch.testing.assert_close(estimate.ratio[0, MODEL], expected)


# --- Sequence-level TIS -------------------------------------------------------------------------
#
# Behaviour log-probs: the model tokens' own, minus log w = 0.1, -0.3, 0.2, 0.1, -0.4; the
# observation's behaviour log-prob is 0.0 (meaningless). Sequence level: w = exp(sum) = exp(-0.3);
# sequence-mean: exp(mean) = exp(-0.06).
LOG_W = [0.1, -0.3, 0.2, 0.1, -0.4]


@pytest.mark.parametrize(("level", "log_w"), [("sequence", -0.3), ("sequence-mean", -0.06)])
def test_sequence_level_tis_multiplies_and_averages_model_tokens_only(
    level: str, log_w: float
) -> None:
    _, ref, mask = gap_row()
    ref[0, [3, 4]] = OBSERVED_LOGP  # a proximal "log-prob" at the observation: not to be read
    behaviour = torch.zeros_like(ref)
    behaviour[0, MODEL] = ref[0, MODEL] - torch.tensor(LOG_W, dtype=torch.float64)
    correction = OffPolicyCorrection(level=level)
    w, _ = behaviour_weight_tensors(ref, behaviour, mask, correction)
    expected = torch.full((5,), math.exp(log_w), dtype=torch.float64)
    torch.testing.assert_close(w[0, MODEL], expected)
    assert bool((w[0, [3, 4, 7]] == 0).all())
    w_cut, _ = behaviour_weight_tensors(cut(ref), cut(behaviour), cut(mask), correction)
    # Equal up to the order of a float sum (zeros at other columns).
    torch.testing.assert_close(w[0, MODEL], w_cut[0, :5], rtol=1e-15, atol=0)


# --- Every estimator: the gap changes nothing on the model tokens --------------------------------

CASES: dict[str, dict[str, Any]] = {
    "token": {},
    "sequence": {},
    "geometric": {},
    "kalman": {"q": 1.0, "r": 1.0, "p0": 1.0, "reference_length": None},
    "kalman-posterior": {
        "q": 1.0, "r": 1.0, "p0": 1.0, "reference_length": None, "clip_mode": "posterior",
        "clip_low": 0.1, "clip_high": 0.2,
    },
    "cumulative": {"clip_low": 0.1, "clip_high": 0.2},
    "token-with-sequence-tis": {"tis_level": "sequence", "tis_cap": 2.0},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_loss_and_its_gradient_ignore_the_observation(case: str) -> None:
    """Loss and gradient on the model tokens equal those of the response without the
    observation, and the observation tokens get an exactly zero gradient."""
    estimator = case.split("-")[0]
    options = dict(CASES[case])
    logp, ref, mask = gap_row()
    # Advantages differ in sign per model token so that every clip direction is exercised; the
    # observation's advantage is large, and must not matter either.
    advantages = torch.tensor([[0.5, -1.0, 2.0, 9.0, 9.0, -0.5, 1.5, 0.0]], dtype=torch.float64)
    behaviour = None
    if "tis_level" in options:
        behaviour = ref.clone()
        behaviour[0, MODEL] -= torch.tensor(LOG_W, dtype=torch.float64)
        behaviour[0, [3, 4]] = 0.0

    def loss_and_grad(columns: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        def take(t: torch.Tensor) -> torch.Tensor:
            return t if columns is None else t[:, columns]

        leaf = take(logp).clone().requires_grad_(True)
        loss, _ = policy_loss(
            estimator, leaf, take(ref), take(advantages), take(mask),
            behaviour_logp=None if behaviour is None else take(behaviour), **options,
        )  # fmt: skip
        loss.backward()
        assert leaf.grad is not None
        return loss.detach(), leaf.grad

    loss, grad = loss_and_grad(None)
    loss_cut, grad_cut = loss_and_grad(GAPLESS)
    assert float(loss) != 0.0  # a real loss, not an empty one
    torch.testing.assert_close(loss, loss_cut, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad[0, MODEL], grad_cut[0, :5], rtol=1e-12, atol=1e-15)
    assert bool((grad[0, [3, 4]] == 0).all()), grad
