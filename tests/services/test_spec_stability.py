"""The run spec's `stability` section: off by default, strict, bounded, null switches off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kpo_core.config import KalmanEstimator, describe_validation_error
from services.pipeline.specs import SpecError, load_run_spec
from services.spec import RunSpec, StabilityConfig, StabilityObjectives

RUN_YAML = """\
name: guarded
stability:
  enabled: true
  action: cancel
  {line}
"""


def stability_error(stability: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        RunSpec.model_validate({"stability": stability})
    return describe_validation_error(caught.value, "run.yaml")


def load(tmp_path: Path, line: str) -> RunSpec:
    path = tmp_path / "run.yaml"
    path.write_text(RUN_YAML.format(line=line))
    return load_run_spec(path)


def test_the_guard_is_off_by_default_with_every_objective_on() -> None:
    stability = RunSpec().stability
    assert stability == StabilityConfig()
    assert stability.enabled is False and stability.action == "warn"
    assert all(value is not None for value in stability.objectives.model_dump().values())


def test_a_yaml_run_file_sets_the_section(tmp_path: Path) -> None:
    spec = load(tmp_path, "objectives: {clip_fraction_max: null, grad_norm_max_ratio: 8}")
    assert spec.stability.enabled and spec.stability.action == "cancel"
    assert spec.stability.objectives.clip_fraction_max is None
    assert spec.stability.objectives.grad_norm_max_ratio == 8.0
    default = StabilityObjectives().entropy_min_fraction
    assert spec.stability.objectives.entropy_min_fraction == default  # the others keep defaults


@pytest.mark.parametrize(
    ("line", "path"),
    [
        ("patiense: 3", "stability.patiense"),
        ("objectives: {entropy_min_fracton: 0.3}", "stability.objectives.entropy_min_fracton"),
        ("remedy: {lr_scal: 0.5}", "stability.remedy.lr_scal"),
    ],
)
def test_a_key_typo_in_the_section_is_an_error_naming_it(
    tmp_path: Path, line: str, path: str
) -> None:
    with pytest.raises(SpecError) as caught:
        load(tmp_path, line)
    assert str(caught.value) == f"{tmp_path / 'run.yaml'}: {path}: Extra inputs are not permitted"


@pytest.mark.parametrize(
    ("stability", "path", "message"),
    [
        ({"action": "retry"}, "stability.action", "'warn', 'rollback', 'pause' or 'cancel'"),
        ({"patience": 0}, "stability.patience", "greater than or equal to 1"),
        ({"baseline_window": 2}, "stability.baseline_window", "greater than or equal to 3"),
        ({"max_rollbacks": -1}, "stability.max_rollbacks", "greater than or equal to 0"),
        ({"remedy": {"lr_scale": 0}}, "stability.remedy.lr_scale", "greater than 0"),
        ({"remedy": {"lr_scale": 1.5}}, "stability.remedy.lr_scale", "less than or equal to 1"),
        (
            {"remedy": {"estimator": "kalmn"}},
            "stability.remedy.estimator",
            "unknown estimator 'kalmn'; valid: token, sequence, geometric, kalman, cumulative",
        ),
        (
            {"objectives": {"entropy_slope_min": 0.01}},
            "stability.objectives.entropy_slope_min",
            "less than 0",
        ),
        (
            {"objectives": {"grad_norm_max_ratio": 1.0}},
            "stability.objectives.grad_norm_max_ratio",
            "greater than 1",
        ),
        (
            {"objectives": {"nonfinite_tokens_max": float("inf")}},
            "stability.objectives.nonfinite_tokens_max",
            "finite number",
        ),
        (
            {"objectives": {"reward_drop_max": float("nan")}},
            "stability.objectives.reward_drop_max",
            "finite number",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_field(
    stability: dict[str, Any], path: str, message: str
) -> None:
    error = stability_error(stability)
    assert error.startswith(f"run.yaml: {path}: "), error
    assert message in error


@pytest.mark.parametrize("action", ["warn", "rollback", "pause", "cancel"])
def test_every_action_is_accepted(action: str) -> None:
    spec = RunSpec.model_validate({"stability": {"enabled": True, "action": action}})
    assert spec.stability.action == action


ROLLBACK = {"enabled": True, "action": "rollback"}


def test_the_remedy_compounds_its_rate_and_sets_staleness_and_estimator() -> None:
    spec = RunSpec.model_validate(
        {
            "learner": {"lr": 1.0e-5},
            "pipeline": {"max_staleness": 4},
            "algorithm": {"estimator": {"name": "token"}},
            "stability": {
                **ROLLBACK,
                "remedy": {"lr_scale": 0.5, "max_staleness": 1, "estimator": "kalman"},
            },
        }
    )
    assert spec.remedied(0) is spec
    once, twice = spec.remedied(1), spec.remedied(2)
    assert once.learner.lr == pytest.approx(5.0e-6) and twice.learner.lr == pytest.approx(2.5e-6)
    assert once.pipeline.max_staleness == twice.pipeline.max_staleness == 1
    assert once.algorithm.estimator.name == twice.algorithm.estimator.name == "kalman"
    # Everything else is the submitted spec's.
    assert once.model_dump(exclude={"learner", "pipeline", "algorithm"}) == spec.model_dump(
        exclude={"learner", "pipeline", "algorithm"}
    )
    assert once.learner.model_dump(exclude={"lr"}) == spec.learner.model_dump(exclude={"lr"})


def test_a_remedys_bound_replaces_an_adaptive_one() -> None:
    spec = RunSpec.model_validate(
        {
            "pipeline": {"max_staleness": {"auto": {"min": 1, "max": 4}}},
            "stability": {**ROLLBACK, "remedy": {"max_staleness": 1}},
        }
    )
    assert spec.pipeline.staleness_auto is not None
    remedied = spec.remedied(1).pipeline
    assert remedied.max_staleness == 1 and remedied.staleness_auto is None
    # Without a staleness remedy the adaptive bound stays.
    kept = RunSpec.model_validate(
        {
            "pipeline": {"max_staleness": {"auto": {"min": 1, "max": 4}}},
            "stability": {**ROLLBACK, "remedy": {"lr_scale": 0.5}},
        }
    )
    assert kept.remedied(1).pipeline.staleness_auto == kept.pipeline.staleness_auto


def test_an_empty_remedy_changes_nothing() -> None:
    spec = RunSpec.model_validate({"stability": ROLLBACK})
    assert spec.remedied(3) == spec


def test_a_remedy_that_makes_an_invalid_spec_is_refused_at_once() -> None:
    with pytest.raises(ValidationError) as caught:
        RunSpec.model_validate(
            {
                "pipeline": {"lead_batches": 1},
                "stability": {**ROLLBACK, "remedy": {"max_staleness": 0}},
            }
        )
    error = describe_validation_error(caught.value, "run.yaml")
    assert error.startswith("run.yaml: stability.remedy: the remedy makes an invalid run spec: ")
    assert "lead_batches (1) must not exceed max_staleness (0)" in error
    # Not checked where the guard cannot roll back.
    spec = RunSpec.model_validate(
        {"stability": {"enabled": True, "action": "warn", "remedy": {"max_staleness": 0}}}
    )
    assert spec.stability.remedy.max_staleness == 0


# (field, the largest value it takes): every count is bounded (services/spec/bounds.py).
COUNT_BOUNDS = [
    ("patience", 10_000_000),
    ("warmup_steps", 10_000_000),
    ("baseline_window", 10_000),
    ("max_rollbacks", 100),
    ("max_healthy_age_steps", 10_000_000),
]


@pytest.mark.parametrize(("field", "limit"), COUNT_BOUNDS)
def test_every_count_has_an_upper_bound_that_names_the_field(field: str, limit: int) -> None:
    assert getattr(RunSpec.model_validate({"stability": {field: limit}}).stability, field) == limit
    error = stability_error({field: limit + 1})
    assert error == f"run.yaml: stability.{field}: Input should be less than or equal to {limit}"


def test_the_remedys_staleness_is_bounded_like_the_pipelines() -> None:
    spec = RunSpec.model_validate({"stability": {"remedy": {"max_staleness": 256}}})
    assert spec.stability.remedy.max_staleness == 256
    error = stability_error({"remedy": {"max_staleness": 257}})
    assert error == (
        "run.yaml: stability.remedy.max_staleness: Input should be less than or equal to 256"
    )


def test_every_objective_may_be_switched_off_with_null() -> None:
    off = dict.fromkeys(StabilityObjectives.model_fields)
    spec = RunSpec.model_validate({"stability": {"enabled": True, "objectives": off}})
    assert set(spec.stability.objectives.model_dump().values()) == {None}


def test_a_remedy_estimator_is_a_whole_estimator_and_replaces_one_of_the_same_name() -> None:
    """The collapsing arms of the study are KPO without a trust region (q = 0, or unclipped):
    a remedy of KPO with the diffuse prior and the posterior clip must change their settings,
    though the name stays `kalman`."""
    diffuse = {"name": "kalman", "p0": "diffuse", "clip_mode": "posterior"}
    spec = RunSpec.model_validate(
        {
            "algorithm": {"estimator": {"name": "kalman", "q": 0.0, "clipped": False}},
            "stability": {**ROLLBACK, "remedy": {"estimator": diffuse}},
        }
    )
    estimator = spec.remedied(1).algorithm.estimator
    assert isinstance(estimator, KalmanEstimator)
    assert (estimator.p0, estimator.clip_mode, estimator.clipped) == ("diffuse", "posterior", True)
    assert estimator.q == KalmanEstimator().q
    # By name: that estimator's defaults, here in place of the run's own settings.
    by_name = spec.model_copy(
        update={
            "stability": StabilityConfig.model_validate(
                {**ROLLBACK, "remedy": {"estimator": "kalman"}}
            )
        }
    )
    assert by_name.remedied(1).algorithm.estimator == KalmanEstimator()
    # An estimator object the union does not know is refused, naming the field.
    error = stability_error({**ROLLBACK, "remedy": {"estimator": {"name": "kalmn"}}})
    assert error.startswith("run.yaml: stability.remedy.estimator"), error


def test_a_remedys_estimator_listed_as_a_shadow_trains_and_stops_being_one() -> None:
    spec = RunSpec.model_validate(
        {
            "algorithm": {"estimator": {"name": "kalman"}, "shadow": ["token", "sequence"]},
            "stability": {**ROLLBACK, "remedy": {"estimator": "token"}},
        }
    )
    algorithm = spec.remedied(1).algorithm
    assert algorithm.estimator.name == "token" and algorithm.shadow == ("sequence",)
