"""The run spec's service settings: strictness and messages that name the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kpo_core.config import describe_validation_error
from services.spec import PipelineConfig, RunSpec


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
