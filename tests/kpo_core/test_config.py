"""The algorithm config: paper defaults, strictness and messages that name the field."""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import ValidationError

from kpo_core.config import (
    ESTIMATOR_NAMES,
    AlgorithmConfig,
    CumulativeEstimator,
    EstimatorConfig,
    GeometricEstimator,
    KalmanEstimator,
    OffPolicyCorrection,
    SequenceEstimator,
    TokenEstimator,
    default_estimator,
    describe_validation_error,
)
from kpo_core.ratios import ESTIMATORS


def test_defaults_are_the_papers() -> None:
    kpo = KalmanEstimator()
    assert (kpo.q, kpo.r, kpo.p0, kpo.x0) == (1e-6, 1.0, 0.0, 0.0)
    assert (kpo.gradient, kpo.clipped, kpo.clip_low, kpo.clip_high) == (
        "straight_through",
        True,
        3e-4,
        4e-4,
    )
    assert kpo.default_loss_agg_mode == "seq-mean-token-mean"
    ctpo = CumulativeEstimator()
    assert (ctpo.clip_low, ctpo.clip_high, ctpo.dual_clip_c) == (0.025, 0.05, 0.05)
    assert ctpo.default_loss_agg_mode == "token-mean"
    assert (SequenceEstimator().clip_low, SequenceEstimator().clip_high) == (3e-4, 4e-4)
    assert GeometricEstimator().clip_low == GeometricEstimator().clip_high == 0.4
    assert TokenEstimator().dual_clip_c == 3.0
    assert AlgorithmConfig().estimator == KalmanEstimator()


def test_every_registered_estimator_has_a_config_in_the_union() -> None:
    for name in ESTIMATORS:
        config = AlgorithmConfig.model_validate({"estimator": {"name": name}})
        assert config.estimator.name == name


def test_unknown_estimator_names_the_valid_ones() -> None:
    with pytest.raises(ValidationError) as info:
        AlgorithmConfig.model_validate({"estimator": {"name": "ppo"}})
    message = describe_validation_error(info.value, "run.yaml")
    assert message.startswith("run.yaml: estimator: ")
    for name in ("token", "sequence", "geometric", "kalman", "cumulative"):
        assert f"'{name}'" in message


def test_typo_and_bad_values_name_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        AlgorithmConfig.model_validate(
            {"estimator": {"name": "kalman", "qq": 1, "r": 0}, "loss_agg_mode": "mean"}
        )
    message = describe_validation_error(info.value, "run.yaml")
    assert "run.yaml: estimator.kalman.qq: Extra inputs are not permitted" in message
    assert "run.yaml: estimator.kalman.r: Input should be greater than 0" in message
    assert "loss_agg_mode: Input should be 'token-mean'" in message


def test_resolved_aggregation_falls_back_to_estimator_default() -> None:
    assert AlgorithmConfig().resolved_loss_agg_mode == "seq-mean-token-mean"
    config = AlgorithmConfig(estimator=TokenEstimator(), loss_agg_mode="token-sum")
    assert config.resolved_loss_agg_mode == "token-sum"


def test_mis_bounds_must_be_ordered() -> None:
    with pytest.raises(ValidationError, match="mis_low"):
        OffPolicyCorrection(mis_low=2.0, mis_high=0.5)


def test_configs_are_frozen() -> None:
    with pytest.raises(ValidationError):
        KalmanEstimator().q = 1.0  # type: ignore[misc]


def test_the_estimator_names_are_the_unions_and_the_registrys() -> None:
    union = get_args(get_args(EstimatorConfig)[0])
    assert tuple(config.model_fields["name"].default for config in union) == ESTIMATOR_NAMES
    assert set(ESTIMATORS) == set(ESTIMATOR_NAMES)
    for name, config in zip(ESTIMATOR_NAMES, union, strict=True):
        assert default_estimator(name) == config()


def test_shadow_estimators_take_their_defaults_and_resolve_kpos_length() -> None:
    config = AlgorithmConfig.model_validate(
        {"estimator": {"name": "token"}, "shadow": ["kalman", "cumulative"]}
    )
    assert config.shadow == ("kalman", "cumulative")
    assert config.shadow_estimators == (KalmanEstimator(), CumulativeEstimator())
    resolved = config.with_response_length(512)
    kalman, cumulative = resolved.shadow_estimators
    assert isinstance(kalman, KalmanEstimator) and kalman.reference_length == 512
    assert cumulative == CumulativeEstimator()
    assert resolved.shadow == config.shadow  # the names, as the user wrote them
    # Each aggregated as a run training with it would be.
    assert config.shadow_loss_agg_mode(kalman) == "seq-mean-token-mean"
    assert config.shadow_loss_agg_mode(cumulative) == "token-mean"
    summed = config.model_copy(update={"loss_agg_mode": "token-sum"})
    assert summed.shadow_loss_agg_mode(kalman) == "token-sum"
    assert AlgorithmConfig().shadow == () and AlgorithmConfig().shadow_estimators == ()


@pytest.mark.parametrize(
    ("shadow", "problem"),
    [
        (["kalman"], "shadow: Value error, lists the training estimator 'kalman'"),
        (["token", "token"], "shadow: Value error, lists 'token' more than once"),
        (["gspo"], "shadow.0: Input should be 'token', 'sequence'"),
    ],
)
def test_a_bad_shadow_list_names_the_field(shadow: list[str], problem: str) -> None:
    with pytest.raises(ValidationError) as info:
        AlgorithmConfig.model_validate({"shadow": shadow})
    assert f"run.yaml: {problem}" in describe_validation_error(info.value, "run.yaml")
