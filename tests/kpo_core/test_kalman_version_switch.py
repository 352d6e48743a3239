"""KPO's `version_switch`: the filter at the tokens where the sampling policy changed."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from kpo_core import kalman
from kpo_core.config import DIFFUSE_P0_PER_R, KalmanEstimator
from kpo_core.kalman import (
    filter_gains,
    kalman_filter,
    steady_state_covariance,
    switch_process_noise,
    version_aware_filter,
    version_switches,
)
from kpo_core.ratios import get_estimator, kalman_ratio


def switching_reference(z, valid, versions, q, r, p0, x0, mode, switch_q):
    """The textbook recursion in Python floats, with the switch rule written out: at a valid
    token whose version differs from the previous valid token's, `reset` puts P back to p0
    before the predict step and `inflate` adds switch_q to the predicted covariance."""
    x, p, previous, out = x0, p0, None, []
    for zt, mt, vt in zip(z, valid, versions, strict=True):
        if mt:
            switch = previous is not None and vt != previous
            if switch and mode == "reset":
                p = p0
            p_prior = p + q + (switch_q if switch and mode == "inflate" else 0.0)
            k = p_prior / (p_prior + r)
            x = x + k * (zt - x)
            p = (1.0 - k) * p_prior
            previous = vt
        out.append(x)
    return out


def two_version_row(length: int = 64, switch_at: int = 20) -> torch.Tensor:
    versions = torch.zeros(1, length, dtype=torch.long)
    versions[:, switch_at:] = 1
    return versions


def test_switches_skip_masked_tokens_and_the_first_token() -> None:
    versions = torch.tensor([[3, 3, 9, 4, 4, 5, 5, 5]])
    mask = torch.tensor([[0, 1, 0, 1, 1, 0, 1, 1]], dtype=torch.bool)
    # Token 2 is masked (an observation: its version is no model token's); token 3 differs
    # from token 1, the previous valid one; token 6 differs from token 4 across a masked 5.
    expected = [[False, False, False, True, False, False, True, False]]
    assert version_switches(versions, mask).tolist() == expected


def test_inflate_noise_by_hand() -> None:
    mask = torch.ones(1, 5, dtype=torch.bool)
    switches = torch.tensor([[False, False, True, False, False]])
    noise = switch_process_noise(switches, mask, 1e-4, 1.0, 0.0, "inflate", 0.5)
    assert noise.tolist() == [[1e-4, 1e-4, 1e-4 + 0.5, 1e-4, 1e-4]]


# (mode, q, r, p0, switch_q): reset needs a prior at least the steady state (here diffuse and
# a finite one above it); inflate works from the paper's P0 = 0.
CASES = [
    ("reset", 1e-3, 1.0, DIFFUSE_P0_PER_R, 0.0),
    ("reset", 1e-2, 2.0, 0.5, 0.0),
    ("inflate", 1e-4, 1.0, 0.0, 1.0),
    ("inflate", 3.4e-3, 0.5, 0.0, 0.05),
]


@pytest.mark.parametrize(("mode", "q", "r", "p0", "switch_q"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_switch_at_token_20_equals_the_hand_recursion(mode, q, r, p0, switch_q, dtype) -> None:
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(1, 64, generator=g, dtype=torch.float64) * 0.1).to(dtype)
    z[:, 20:] += 0.3  # the log-ratio jumps where the sampling policy changed
    mask = torch.ones(1, 64, dtype=torch.bool)
    versions = two_version_row()
    switches = version_switches(versions, mask)
    assert switches.nonzero().tolist() == [[0, 20]]
    noise = switch_process_noise(switches, mask, q, r, p0, mode, switch_q)
    expected = torch.tensor(
        switching_reference(
            z[0].double().tolist(), [True] * 64, versions[0].tolist(), q, r, p0, 0.0, mode, switch_q
        ),
        dtype=torch.float64,
    )
    parallel = kalman_filter(z, mask, noise, r, p0)
    sequential = kalman_filter(z, mask, noise, r, p0, method="sequential")
    torch.testing.assert_close(parallel[0].double(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(sequential[0].double(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(parallel, sequential, atol=1e-6, rtol=0)
    # Before the switch the values are the plain filter's; after it they are not.
    plain = kalman_filter(z, mask, q, r, p0)
    torch.testing.assert_close(parallel[:, :20], plain[:, :20], atol=1e-6, rtol=0)
    assert (parallel[:, 20:] - plain[:, 20:]).abs().max() > 1e-4


def test_three_versions_across_observations_equal_the_hand_recursion() -> None:
    g = torch.Generator().manual_seed(4)
    z = torch.randn(1, 120, generator=g, dtype=torch.float64) * 0.2
    mask = torch.ones(1, 120, dtype=torch.bool)
    mask[:, 30:37] = False  # an observation: no version of its own, no measurement
    mask[:, 110:] = False  # right padding
    versions = torch.zeros(1, 120, dtype=torch.long)
    versions[:, 33:] = 1  # the switch lands on the observation: token 37 is the first of v1
    versions[:, 80:] = 2
    switches = version_switches(versions, mask)
    assert switches.nonzero()[:, 1].tolist() == [37, 80]
    for mode, p0, switch_q in [("reset", DIFFUSE_P0_PER_R, 0.0), ("inflate", 0.0, 0.3)]:
        noise = switch_process_noise(switches, mask, 1e-3, 1.0, p0, mode, switch_q)
        expected = switching_reference(
            z[0].tolist(), mask[0].tolist(), versions[0].tolist(), 1e-3, 1.0, p0, 0.0, mode,
            switch_q,
        )  # fmt: skip
        x = kalman_filter(z, mask, noise, 1.0, p0)
        torch.testing.assert_close(
            x[0], torch.tensor(expected, dtype=torch.float64), atol=1e-9, rtol=0
        )


def _estimate(cfg: KalmanEstimator, z: torch.Tensor, mask, versions):
    logp = z.clone()
    ref = torch.zeros_like(z)
    advantages = torch.ones_like(z)
    return kalman_ratio(logp, ref, advantages, mask, cfg, versions)


@pytest.mark.parametrize(
    "cfg",
    [
        KalmanEstimator(version_switch="reset", p0="diffuse", q=1e-3, reference_length=None),
        KalmanEstimator(version_switch="inflate", switch_q=1.0, reference_length=None),
        KalmanEstimator(version_switch="inflate", gradient="through_filter", reference_length=64),
    ],
)
def test_rows_of_one_version_are_unchanged_bit_for_bit(cfg: KalmanEstimator) -> None:
    g = torch.Generator().manual_seed(5)
    z = torch.randn(4, 64, generator=g) * 0.1
    mask = torch.ones(4, 64, dtype=torch.bool)
    mask[1, 50:] = False
    mask[2, 10:15] = False
    versions = torch.zeros(4, 64, dtype=torch.long)
    versions[0, 20:] = 1  # the only row with a switch
    versions[2, 10:15] = 7  # an observation's "version" is no switch
    versions[3] = 5  # one version throughout, not the others'
    today = _estimate(cfg.model_copy(update={"version_switch": "off"}), z, mask, None)
    aware = _estimate(cfg, z, mask, versions)
    assert torch.equal(aware.ratio[1:], today.ratio[1:])
    if isinstance(aware.clip_low, torch.Tensor):
        assert torch.equal(aware.clip_low[1:], today.clip_low[1:])
    assert not torch.equal(aware.ratio[0, 20:], today.ratio[0, 20:])
    torch.testing.assert_close(aware.ratio[0, :20], today.ratio[0, :20], atol=1e-6, rtol=0)
    # `off` ignores the versions entirely.
    off = _estimate(cfg.model_copy(update={"version_switch": "off"}), z, mask, versions)
    assert torch.equal(off.ratio, today.ratio)


def test_the_estimators_filtered_ratio_is_the_hand_recursions() -> None:
    cfg = KalmanEstimator(version_switch="reset", p0="diffuse", q=1e-3, reference_length=None)
    g = torch.Generator().manual_seed(6)
    z = torch.randn(1, 64, generator=g, dtype=torch.float64) * 0.1
    z[:, 20:] -= 0.5
    mask = torch.ones(1, 64, dtype=torch.bool)
    versions = two_version_row()
    estimate = _estimate(cfg, z, mask, versions)
    expected = switching_reference(
        z[0].tolist(), [True] * 64, versions[0].tolist(), 1e-3, 1.0, cfg.effective_p0, 0.0,
        "reset", 0.0,
    )  # fmt: skip
    torch.testing.assert_close(
        estimate.ratio[0].log(), torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0
    )
    # Just after the reset the filter follows the new level (gain ~ 1); without it, it lags.
    today = _estimate(cfg.model_copy(update={"version_switch": "off"}), z, mask, versions)
    level = z[0, 20:36].mean()
    lag_reset = (estimate.ratio[0, 20:36].log() - level).abs().mean()
    lag_off = (today.ratio[0, 20:36].log() - level).abs().mean()
    assert lag_reset < 0.5 * lag_off


def test_reset_below_the_steady_state_covariance_is_refused_pointing_to_inflate() -> None:
    with pytest.raises(ValidationError, match="p0: diffuse, or use version_switch 'inflate'"):
        KalmanEstimator(version_switch="reset")  # the paper's P0 = 0
    floor = steady_state_covariance(1e-2, 1.0)
    KalmanEstimator(version_switch="reset", q=1e-2, p0=floor * 1.01, reference_length=None)
    # The floor follows the length-matched q: resolving `auto` checks again.
    cfg = KalmanEstimator(version_switch="reset", q=1e-6, p0=2e-3)
    with pytest.raises(ValidationError, match="steady-state covariance"):
        cfg.with_response_length(64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="version_switch 'inflate'"):
        switch_process_noise(mask, mask, 1e-2, 1.0, 0.0, "reset")


def test_the_registry_hands_token_versions_to_the_estimators_that_read_them() -> None:
    """KPO goes through the estimator registry like every estimator: its entry passes the
    per-token versions on (a switch changes its ratio), the others' entries do not take them."""
    cfg = KalmanEstimator(version_switch="reset", p0="diffuse", clipped=False)
    torch.manual_seed(0)
    logp, ref_logp = torch.randn(1, 64) * 0.3, torch.zeros(1, 64)
    advantages, mask = torch.ones(1), torch.ones(1, 64, dtype=torch.bool)
    kalman = get_estimator("kalman")
    assert kalman.reads_versions and not get_estimator("token").reads_versions
    one = kalman.estimate(logp, ref_logp, advantages, mask, cfg, None).ratio
    switched = kalman.estimate(logp, ref_logp, advantages, mask, cfg, two_version_row()).ratio
    direct = kalman_ratio(logp, ref_logp, advantages, mask, cfg, two_version_row()).ratio
    assert torch.equal(switched, direct) and not torch.equal(switched, one)
    token = get_estimator("token").make_config()
    ratio = get_estimator("token").estimate(logp, ref_logp, advantages, mask, token, None).ratio
    torch.testing.assert_close(ratio, logp.exp())


def mixed_batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(z, mask, versions) [5, 96]: rows 0, 2 and 4 have switches, rows 1 and 3 have none."""
    g = torch.Generator().manual_seed(7)
    z = (torch.randn(5, 96, generator=g, dtype=torch.float64) * 0.2).to(dtype)
    mask = torch.ones(5, 96, dtype=torch.bool)
    mask[1, 70:] = False  # right padding
    mask[2, 30:37] = False  # an observation, with the switch landing on it
    mask[3, :5] = False  # left padding
    versions = torch.zeros(5, 96, dtype=torch.long)
    versions[0, 40:] = 1
    versions[2, 33:] = 1
    versions[3] = 4  # one version throughout
    versions[4, 20:] = 1
    versions[4, 61:] = 2
    return z, mask, versions


def two_pass_reference(z, mask, versions, q, r, p0, x0, mode, switch_q):
    """What the estimator computed before the filter ran once per batch: the plain filter and
    the per-token noise filter both over every row, then a where on "this row has a switch"."""
    switches = version_switches(versions, mask)
    noise = switch_process_noise(switches, mask, q, r, p0, mode, switch_q)
    switched = switches.any(-1, keepdim=True)
    x = torch.where(
        switched, kalman_filter(z, mask, noise, r, p0, x0), kalman_filter(z, mask, q, r, p0, x0)
    )
    gains = torch.where(switched, filter_gains(mask, noise, r, p0), filter_gains(mask, q, r, p0))
    return x, gains


# (mode, q, r, p0, x0, switch_q)
FILTER_CASES = [
    ("reset", 1e-3, 1.0, DIFFUSE_P0_PER_R, 0.0, 0.0),
    ("inflate", 1e-4, 1.0, 0.0, 0.0, 1.0),
    ("inflate", 3.4e-3, 0.5, 0.0, 0.2, 0.05),
]


class PassCounter:
    """The rows each pass of the filter ran over, counted through the module's attributes:
    the plain (scalar noise) filter, the per-token noise filter and the Riccati scan of its
    gains. Every call goes through these, whichever public function made it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: dict[str, list[int]] = {"plain": [], "per_token": [], "riccati": []}
        self._wrap(monkeypatch, "_filter_compacted", "plain", lambda z, *rest: z)
        self._wrap(monkeypatch, "_filter_by_gains", "per_token", lambda z, *rest: z)
        self._wrap(monkeypatch, "_riccati_scan", "riccati", lambda q, *rest: q)

    def _wrap(self, monkeypatch, name, key, rows_of) -> None:
        original = getattr(kalman, name)

        def counted(*args):
            self.rows[key].append(rows_of(*args).reshape(-1, args[0].shape[-1]).shape[0])
            return original(*args)

        monkeypatch.setattr(kalman, name, counted)


@pytest.mark.parametrize(("mode", "q", "r", "p0", "x0", "switch_q"), FILTER_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_filter_runs_once_per_batch_with_the_two_pass_values(
    monkeypatch, mode, q, r, p0, x0, switch_q, dtype
) -> None:
    """The plain filter runs once over the batch (its values give the rows without a switch,
    bit for bit); the per-token noise filter, and the Riccati scan of its gains, once over the
    rows with a switch only. Before, both ran over every row and the gains were scanned twice:
    plain [5], per-token [5], riccati [5, 5]."""
    z, mask, versions = mixed_batch(dtype)
    expected_x, expected_gains = two_pass_reference(z, mask, versions, q, r, p0, x0, mode, switch_q)
    counter = PassCounter(monkeypatch)
    x, gains = version_aware_filter(z, mask, versions, q, r, p0, x0, mode, switch_q)
    assert counter.rows == {"plain": [5], "per_token": [3], "riccati": [3]}
    one_version = torch.tensor([1, 3])
    assert torch.equal(x[one_version], expected_x[one_version])
    assert torch.equal(gains[one_version], expected_gains[one_version])
    # The switched rows: the per-token noise path over those rows alone, as a direct call.
    switched = torch.tensor([0, 2, 4])
    noise = switch_process_noise(
        version_switches(versions, mask)[switched], mask[switched], q, r, p0, mode, switch_q
    )
    direct = kalman_filter(z[switched], mask[switched], noise, r, p0, x0)
    assert torch.equal(x[switched], direct)
    assert torch.equal(gains[switched], filter_gains(mask[switched], noise, r, p0))
    # ... which is the two-pass value (the scan's block is set by the rows it runs over, so the
    # rounding may differ in principle; on this batch it does not).
    tolerance = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(x, expected_x, atol=tolerance, rtol=0)
    torch.testing.assert_close(gains, expected_gains, atol=1e-12, rtol=0)


def test_a_batch_without_a_switch_runs_the_plain_filter_alone(monkeypatch) -> None:
    z, mask, versions = mixed_batch(torch.float32)
    counter = PassCounter(monkeypatch)
    plain = kalman_filter(z, mask, 1e-3, 1.0, DIFFUSE_P0_PER_R)
    for mode, these in [("reset", torch.zeros_like(versions)), ("off", versions), ("reset", None)]:
        x, gains = version_aware_filter(z, mask, these, 1e-3, 1.0, DIFFUSE_P0_PER_R, mode=mode)
        assert torch.equal(x, plain)
        assert torch.equal(gains, filter_gains(mask, 1e-3, 1.0, DIFFUSE_P0_PER_R))
    assert counter.rows == {"plain": [5] * 4, "per_token": [], "riccati": []}


@pytest.mark.parametrize("gradient", ["straight_through", "through_filter"])
def test_the_estimator_filters_once_with_the_two_pass_ratio_and_gradient(
    monkeypatch, gradient
) -> None:
    """KPO's estimator, as the learner calls it: one pass of each filter for both gradient
    paths, and the ratio, clip window and gradient of the two-pass filter."""
    cfg = KalmanEstimator(
        version_switch="reset",
        p0="diffuse",
        q=1e-3,
        reference_length=None,
        gradient=gradient,
        clip_mode="posterior",  # a window from the gains
    )
    z, mask, versions = mixed_batch(torch.float32)
    advantages = torch.randn(5, 96, generator=torch.Generator().manual_seed(8))

    def estimate(filter_pair):
        monkeypatch.setattr("kpo_core.ratios.version_aware_filter", filter_pair)
        logp = z.clone().requires_grad_(True)
        result = get_estimator("kalman").estimate(
            logp, torch.zeros_like(z), advantages, mask, cfg, versions
        )
        (result.ratio * advantages).sum().backward()
        return result, logp.grad

    def reference(z, mask, versions, q, r, p0, x0, mode, switch_q):
        return two_pass_reference(z, mask, versions, q, r, p0, x0, mode, switch_q)

    expected, expected_grad = estimate(reference)
    counter = PassCounter(monkeypatch)
    result, grad = estimate(version_aware_filter)
    assert counter.rows == {"plain": [5], "per_token": [3], "riccati": [3]}
    assert torch.equal(result.ratio, expected.ratio)
    assert isinstance(result.clip_low, torch.Tensor)
    assert torch.equal(result.clip_low, expected.clip_low)
    assert torch.equal(grad, expected_grad)
