"""The algorithm config: paper defaults, strictness and messages that name the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kpo_core.config import (
    AlgorithmConfig,
    CumulativeEstimator,
    GeometricEstimator,
    KalmanEstimator,
    OffPolicyCorrection,
    PipelineConfig,
    RunSpec,
    SequenceEstimator,
    TokenEstimator,
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


def pipeline_error(pipeline: dict[str, object]) -> str:
    """The described error of a run spec with this pipeline section."""
    with pytest.raises(ValidationError) as info:
        RunSpec.model_validate({"pipeline": pipeline})
    return describe_validation_error(info.value, "run.yaml")


def test_lead_batches_needs_async_mode() -> None:
    message = pipeline_error({"mode": "sync", "lead_batches": 1})
    assert message.startswith("run.yaml: pipeline: ")
    assert "lead_batches needs mode 'async'" in message
    assert PipelineConfig(mode="sync").lead_batches == 0  # the default stays valid in sync


def test_lead_batches_may_not_exceed_max_staleness() -> None:
    message = pipeline_error({"max_staleness": 2, "lead_batches": 3})
    assert "lead_batches (3) must not exceed max_staleness (2)" in message
    # The default bound (2 in async) is the one compared against.
    assert "lead_batches (3) must not exceed max_staleness (2)" in pipeline_error(
        {"lead_batches": 3}
    )
    assert PipelineConfig(max_staleness=3, lead_batches=3).lead_batches == 3


def test_lead_batches_cannot_be_negative() -> None:
    message = pipeline_error({"lead_batches": -1})
    assert "run.yaml: pipeline.lead_batches: Input should be greater than or equal to 0" in (
        message
    )


def test_an_explicit_buffer_must_hold_lead_batches_plus_one_batches() -> None:
    base = {"max_staleness": 3, "lead_batches": 3, "batch_groups": 4}
    message = pipeline_error({**base, "buffer_groups": 15})
    assert message.startswith("run.yaml: pipeline: ")
    assert "buffer_groups (15) must hold lead_batches + 1 batches (16 groups)" in message
    assert PipelineConfig(**base, buffer_groups=16).buffer_groups == 16


@pytest.mark.parametrize(("lead", "batches"), [(0, 4), (1, 4), (3, 4), (4, 5), (6, 7)])
def test_the_default_buffer_holds_four_or_lead_batches_plus_one_batches(
    lead: int, batches: int
) -> None:
    config = PipelineConfig(max_staleness=6, lead_batches=lead, batch_groups=3)
    assert config.buffer_groups == batches * 3


def run_spec_error(data: dict[str, object]) -> str:
    with pytest.raises(ValidationError) as caught:
        RunSpec.model_validate(data)
    return describe_validation_error(caught.value, "run.yaml")


def test_a_float16_learner_is_refused_with_the_reason() -> None:
    message = run_spec_error({"learner": {"compute_dtype": "float16"}})
    assert "learner.compute_dtype" in message and "AdamW" in message and "bfloat16" in message
    spec = RunSpec.model_validate({"learner": {"compute_dtype": "bfloat16"}})
    assert spec.learner.compute_dtype == "bfloat16"


def test_the_old_dtype_key_names_its_replacement() -> None:
    message = run_spec_error({"learner": {"dtype": "bfloat16"}})
    assert "learner.compute_dtype" in message and "compute_dtype: bfloat16" in message


def test_learner_group_settings_are_validated() -> None:
    assert "strategy 'fsdp2'" in run_spec_error({"learner": {"world_size": 2}})
    spec = RunSpec.model_validate({"learner": {"strategy": "fsdp2", "world_size": 2}})
    assert spec.learner.world_size == 2
    assert "num_gpus" in run_spec_error({"learner": {"resources": {"GPU": 1}}})
    assert "accelerator_type" in run_spec_error(
        {"generation": {"resources": {"accelerator_type:H100": 1}}}
    )
    assert "learner.resources" in run_spec_error({"learner": {"resources": {"x": -1}}})


def test_fault_settings_are_validated() -> None:
    assert "call_timeout_s" in run_spec_error({"reward": {"timeout_s": 5, "call_timeout_s": 5}})
    assert "learner_restarts" in run_spec_error({"pipeline": {"learner_restarts": -1}})
    spec = RunSpec.model_validate({})
    assert (spec.pipeline.learner_restarts, spec.pipeline.actor_replacements) == (2, 10)
    assert spec.reward.call_timeout_s == 300.0
