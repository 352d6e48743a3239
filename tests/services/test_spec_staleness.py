"""The run spec's adaptive staleness bound, `pipeline.max_staleness: {auto: {min, max}}`: the
forms it takes, what it reads as, its round trip through JSON, and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kpo_core.config import describe_validation_error
from services.pipeline.specs import SpecError, apply_overrides, load_run_spec
from services.spec import PipelineConfig, RunSpec
from services.spec.pipeline import StalenessAuto


def pipeline_error(pipeline: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        RunSpec.model_validate({"pipeline": pipeline})
    return describe_validation_error(caught.value, "run.yaml")


def auto(low: Any, high: Any) -> dict[str, Any]:
    return {"auto": {"min": low, "max": high}}


def test_the_auto_form_reads_as_its_ceiling_and_keeps_its_range() -> None:
    pipe = RunSpec.model_validate({"pipeline": {"max_staleness": auto(1, 4)}}).pipeline
    assert pipe.max_staleness == 4  # what every reader of the bound reads: the ceiling
    assert pipe.staleness_auto == StalenessAuto(min=1, max=4)
    assert pipe.staleness_auto.start == 2


@pytest.mark.parametrize(("low", "high", "start"), [(0, 1, 1), (3, 6, 3), (0, 0, 0), (0, 9, 2)])
def test_the_start_is_two_clamped_into_the_range(low: int, high: int, start: int) -> None:
    pipe = PipelineConfig.model_validate({"max_staleness": auto(low, high)})
    assert pipe.staleness_auto is not None and pipe.staleness_auto.start == start


@pytest.mark.parametrize("pipeline", [{}, {"max_staleness": 3}, {"mode": "sync"}])
def test_a_static_bound_stays_the_default_and_unchanged(pipeline: dict[str, Any]) -> None:
    pipe = RunSpec.model_validate({"pipeline": pipeline}).pipeline
    assert pipe.staleness_auto is None
    assert pipe.max_staleness == pipeline.get("max_staleness", 0 if pipeline else 2)


@pytest.mark.parametrize("pipeline", [{"max_staleness": auto(0, 3)}, {"max_staleness": 5}])
def test_the_dumped_spec_validates_again_to_the_same_spec(pipeline: dict[str, Any]) -> None:
    """The API stores `model_dump(mode="json")` and validates it again."""
    spec = RunSpec.model_validate({"pipeline": pipeline})
    stored = json.loads(json.dumps(spec.model_dump(mode="json")))
    again = RunSpec.model_validate(stored)
    assert again == spec
    assert again.model_dump(mode="json") == stored


def test_a_yaml_run_file_and_overrides_set_it(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("pipeline:\n  max_staleness: {auto: {min: 1, max: 4}}\n")
    assert load_run_spec(path).pipeline.staleness_auto == StalenessAuto(min=1, max=4)
    # --set creates the nested keys; a later one changes one of them.
    path.write_text("pipeline:\n  steps: 3\n")
    sets = ["pipeline.max_staleness.auto.min=1", "pipeline.max_staleness.auto.max=3"]
    spec = load_run_spec(path, sets)
    assert (spec.pipeline.max_staleness, spec.pipeline.staleness_auto) == (
        3,
        StalenessAuto(min=1, max=3),
    )
    changed = load_run_spec(path, [*sets, "pipeline.max_staleness.auto.min=0"])
    assert changed.pipeline.staleness_auto == StalenessAuto(min=0, max=3)


def test_an_integer_in_the_file_is_replaced_by_the_whole_form_not_by_one_key() -> None:
    data = {"pipeline": {"max_staleness": 2}}
    with pytest.raises(SpecError, match=r"pipeline\.max_staleness is a value, not a section"):
        apply_overrides(data, ["pipeline.max_staleness.auto.min=1"])
    replaced = apply_overrides(data, ["pipeline.max_staleness={auto: {min: 1, max: 4}}"])
    assert RunSpec.model_validate(replaced).pipeline.staleness_auto == StalenessAuto(min=1, max=4)


@pytest.mark.parametrize(
    ("max_staleness", "where", "message"),
    [
        (auto(-1, 3), "pipeline.max_staleness.auto.min", "greater than or equal to 0"),
        (auto(3, 2), "pipeline.max_staleness.auto.max", "must be at least min (3), got 2"),
        (auto(0, 257), "pipeline.max_staleness.auto.max", "less than or equal to 256"),
        (auto(257, 256), "pipeline.max_staleness.auto.min", "less than or equal to 256"),
        (auto("one", 3), "pipeline.max_staleness.auto.min", "valid integer"),
        ({"auto": {"min": 1}}, "pipeline.max_staleness.auto.max", "Field required"),
        ({"auto": {"min": 1, "max": 2, "step": 1}}, "pipeline.max_staleness.auto.step", "Extra"),
        ({"auto": 3}, "pipeline.max_staleness.auto", "valid dictionary"),
        ({"automatic": {"min": 1, "max": 2}}, "pipeline.max_staleness.automatic", "Extra"),
        ({}, "pipeline.max_staleness.auto", "Field required"),
    ],
)
def test_a_bad_auto_form_is_an_error_naming_the_field(
    max_staleness: dict[str, Any], where: str, message: str
) -> None:
    described = pipeline_error({"max_staleness": max_staleness})
    named = [line for line in described.splitlines() if line.startswith(f"run.yaml: {where}: ")]
    assert len(named) == 1, described
    assert message in named[0]


def test_sync_mode_refuses_an_adaptive_bound() -> None:
    described = pipeline_error({"mode": "sync", "max_staleness": auto(0, 2)})
    assert described.startswith("run.yaml: pipeline.max_staleness.auto: ")
    assert "needs mode 'async'" in described and "on-policy" in described


def test_lead_batches_may_not_exceed_the_floor() -> None:
    """The learner waits for lead_batches + 1 batches, which a bound below lead_batches never
    lets generation admit: checked against min, not only the ceiling."""
    described = pipeline_error({"max_staleness": auto(1, 4), "lead_batches": 2})
    assert described.startswith("run.yaml: pipeline.lead_batches: ")
    assert "lead_batches (2) must not exceed the adaptive bound's min (1)" in described
    pipe = PipelineConfig.model_validate({"max_staleness": auto(2, 4), "lead_batches": 2})
    assert pipe.lead_batches == 2


def test_the_stored_range_must_agree_with_the_ceiling() -> None:
    described = pipeline_error({"max_staleness": 3, "staleness_auto": {"min": 0, "max": 2}})
    assert described.startswith("run.yaml: pipeline.staleness_auto.max: must equal")
    both = pipeline_error({"max_staleness": auto(0, 2), "staleness_auto": {"min": 0, "max": 2}})
    assert both.startswith("run.yaml: pipeline.staleness_auto: ")
    # The range alone (as a dumped spec of an older client might hold it) sets the ceiling.
    alone = PipelineConfig.model_validate({"staleness_auto": {"min": 0, "max": 2}})
    assert alone.max_staleness == 2
