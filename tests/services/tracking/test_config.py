"""The `tracking:` section of a run spec."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kpo_core.config import describe_validation_error
from services.spec import RunSpec


def test_no_tracker_by_default() -> None:
    tracking = RunSpec().tracking
    assert (tracking.wandb, tracking.mlflow, tracking.tensorboard) == (None, None, None)


def test_an_empty_section_turns_a_tracker_on_with_its_defaults() -> None:
    tracking = RunSpec.model_validate({"tracking": {"mlflow": {}, "tensorboard": {}}}).tracking
    assert tracking.mlflow is not None and tracking.mlflow.experiment == "kpo-rl"
    assert tracking.tensorboard is not None and tracking.tensorboard.log_dir is None
    assert tracking.wandb is None


def test_wandb_needs_a_project() -> None:
    with pytest.raises(ValidationError) as caught:
        RunSpec.model_validate({"tracking": {"wandb": {"entity": "team"}}})
    message = describe_validation_error(caught.value, "run.yaml")
    assert "tracking.wandb.project" in message
    assert "Field required" in message


@pytest.mark.parametrize(
    "tracking",
    [
        {"wandb": {"project": "p", "api_key": "secret"}},  # secrets come from the environment
        {"wandb": {"project": "p", "mode": "dryrun"}},
        {"neptune": {}},
    ],
)
def test_unknown_keys_and_values_are_refused(tracking: dict[str, object]) -> None:
    with pytest.raises(ValidationError) as caught:
        RunSpec.model_validate({"tracking": tracking})
    assert "tracking." in describe_validation_error(caught.value)
