"""The spec patch a paused run resumes with: only the remedy's targets, every other key named,
the patched spec validated as any run spec, patches merged in order."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from services.spec import (
    SPEC_PATCH_KEYS,
    RunSpec,
    SpecPatchError,
    flatten_patch,
    merge_patches,
)

PAUSED = {"stability": {"enabled": True, "action": "pause"}}


def paused_spec(**sections: Any) -> RunSpec:
    return RunSpec.model_validate({**PAUSED, **sections})


def refused_keys(patch: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecPatchError) as caught:
        paused_spec().patched(patch)
    return [key for key, _ in caught.value.problems]


def test_the_three_keys_change_and_nothing_else() -> None:
    spec = paused_spec(learner={"lr": 1.0e-5}, pipeline={"max_staleness": 4})
    patched = spec.patched(
        {
            "learner": {"lr": 5.0e-6},
            "pipeline": {"max_staleness": 1},
            "algorithm": {"estimator": {"name": "token", "clip_low": 0.1, "clip_high": 0.3}},
        }
    )
    assert patched.learner.lr == 5.0e-6
    assert patched.pipeline.max_staleness == 1
    estimator = patched.algorithm.estimator
    assert estimator.name == "token"
    assert (estimator.clip_low, estimator.clip_high) == (0.1, 0.3)
    # Everything else is the spec's.
    sections = {"learner", "pipeline", "algorithm"}
    assert patched.model_dump(exclude=sections) == spec.model_dump(exclude=sections)
    assert patched.learner.model_dump(exclude={"lr"}) == spec.learner.model_dump(exclude={"lr"})
    assert patched.pipeline.model_dump(exclude={"max_staleness"}) == spec.pipeline.model_dump(
        exclude={"max_staleness"}
    )
    assert SPEC_PATCH_KEYS == ("learner.lr", "pipeline.max_staleness", "algorithm.estimator")


def test_an_empty_patch_is_the_spec_itself() -> None:
    spec = paused_spec()
    assert spec.patched({}) is spec
    assert spec.patched({"learner": {}}) is spec


def test_an_estimator_is_replaced_whole_with_its_defaults() -> None:
    spec = paused_spec(algorithm={"estimator": {"name": "token", "clip_low": 0.1}})
    again = spec.patched({"algorithm": {"estimator": {"name": "token"}}})
    assert again.algorithm.estimator.clip_low == 0.2  # the default, not the spec's 0.1


def test_every_key_a_resume_may_not_change_is_named() -> None:
    keys = refused_keys(
        {
            "learner": {"lr": 1.0e-6, "batch_size": 8, "warmup_steps": 0},
            "generation": {"temperature": 0.7, "options": {"dtype": "float16"}},
            "pipeline": {"steps": 10},
            "algorithm": {"estimator": {"name": "token"}, "loss_agg_mode": "token-mean"},
            "name": "other",
        }
    )
    assert keys == [
        "learner.batch_size",
        "learner.warmup_steps",
        "generation.temperature",
        "generation.options.dtype",
        "pipeline.steps",
        "algorithm.loss_agg_mode",
        "name",
    ]


def test_a_section_given_as_a_value_is_refused_by_its_name() -> None:
    assert refused_keys({"learner": 1.0e-6}) == ["learner"]
    with pytest.raises(SpecPatchError) as caught:
        flatten_patch({"pipeline": [1]})
    assert "must be a mapping" in str(caught.value)


@pytest.mark.parametrize(
    ("patch", "loc", "message"),
    [
        ({"learner": {"lr": 0}}, ("learner", "lr"), "greater than 0"),
        ({"learner": {"lr": "fast"}}, ("learner", "lr"), "valid number"),
        ({"pipeline": {"max_staleness": 257}}, ("pipeline", "max_staleness"), "256"),
        (
            {"algorithm": {"estimator": {"name": "ppo"}}},
            ("algorithm", "estimator"),
            "'token', 'sequence', 'geometric', 'kalman', 'cumulative'",
        ),
        (
            {"algorithm": {"estimator": {"name": "kalman", "q": -1}}},
            ("algorithm", "estimator", "kalman", "q"),
            "greater than",
        ),
    ],
)
def test_a_patch_that_makes_an_invalid_spec_names_the_field(
    patch: dict[str, Any], loc: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        paused_spec().patched(patch)
    errors = caught.value.errors()
    assert [error["loc"] for error in errors] == [loc]
    assert message in errors[0]["msg"]


def test_the_checks_across_sections_hold_for_a_patched_spec() -> None:
    spec = paused_spec(pipeline={"lead_batches": 1, "max_staleness": 2})
    with pytest.raises(ValidationError) as caught:
        spec.patched({"pipeline": {"max_staleness": 0}})
    assert "lead_batches (1) must not exceed max_staleness (0)" in str(caught.value)


def test_patches_merge_in_order_and_an_estimator_whole() -> None:
    first = {"learner": {"lr": 1.0e-5}, "algorithm": {"estimator": {"name": "token"}}}
    second = {"learner": {"lr": 5.0e-6}, "pipeline": {"max_staleness": 1}}
    assert merge_patches(first, second) == {
        "learner": {"lr": 5.0e-6},
        "algorithm": {"estimator": {"name": "token"}},
        "pipeline": {"max_staleness": 1},
    }
    third = {"algorithm": {"estimator": {"name": "kalman", "q": 1.0e-5}}}
    merged = merge_patches(merge_patches(first, second), third)
    assert merged["algorithm"] == {"estimator": {"name": "kalman", "q": 1.0e-5}}
    assert merge_patches({}, {}) == {}


def test_a_patched_bound_replaces_a_fixed_or_adaptive_one() -> None:
    adaptive = RunSpec.model_validate(
        {"pipeline": {"max_staleness": {"auto": {"min": 1, "max": 4}}}}
    )
    fixed = adaptive.patched({"pipeline": {"max_staleness": 3}}).pipeline
    assert fixed.max_staleness == 3 and fixed.staleness_auto is None
    auto = {"auto": {"min": 0, "max": 2}}
    for spec in (adaptive, RunSpec()):
        patched = spec.patched({"pipeline": {"max_staleness": auto}}).pipeline
        assert patched.max_staleness == 2
        assert patched.staleness_auto is not None and patched.staleness_auto.min == 0


def test_a_patched_estimator_listed_as_a_shadow_trains_and_stops_being_one() -> None:
    spec = paused_spec(algorithm={"estimator": {"name": "kalman"}, "shadow": ["token", "sequence"]})
    algorithm = spec.patched({"algorithm": {"estimator": {"name": "sequence"}}}).algorithm
    assert algorithm.estimator.name == "sequence" and algorithm.shadow == ("token",)
