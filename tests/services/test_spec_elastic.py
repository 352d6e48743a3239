"""The run spec's elastic generation pool, `generation.actors: {min, max}`: its bounds, the
starting size within them, what the run reserves, and errors (a 422 at the API) that name the
field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from kpo_core.config import describe_validation_error
from services.pipeline.actors import resource_needs
from services.spec import RunSpec
from services.spec.generation import ElasticActors


def generation_error(generation: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        RunSpec.model_validate({"generation": generation})
    return describe_validation_error(caught.value, "run.yaml")


def test_a_fixed_pool_is_the_default() -> None:
    gen = RunSpec.model_validate({}).generation
    assert gen.actors is None and gen.max_workers == gen.num_workers == 1


def test_the_pool_takes_its_bounds_and_tuning_with_sensible_defaults() -> None:
    gen = RunSpec.model_validate(
        {"generation": {"num_workers": 2, "actors": {"min": 1, "max": 4, "window_s": 30}}}
    ).generation
    assert gen.actors == ElasticActors(min=1, max=4, window_s=30.0)
    assert gen.actors.cooldown_s == 120.0
    assert gen.actors.grow_idle_fraction < 1.0 and gen.actors.shrink_full_fraction < 1.0
    assert gen.max_workers == 4


@pytest.mark.parametrize(
    ("generation", "message"),
    [
        ({"actors": {"min": 3, "max": 2}}, "run.yaml: generation.actors.max: must be at least min"),
        ({"actors": {"min": 0, "max": 2}}, "run.yaml: generation.actors.min: Input should be"),
        ({"actors": {"max": 2}}, "run.yaml: generation.actors.min: Field required"),
        (
            {"num_workers": 5, "actors": {"min": 1, "max": 4}},
            "run.yaml: generation.num_workers: the starting size of the elastic pool must lie "
            "within actors.min and actors.max ([1, 4]), got 5",
        ),
        (
            {"num_workers": 1, "actors": {"min": 2, "max": 4}},
            "run.yaml: generation.num_workers: the starting size",
        ),
        ({"actors": {"min": 1, "max": 2, "cooldown_s": -1}}, "generation.actors.cooldown_s"),
        ({"actors": {"min": 1, "max": 2, "grow_idle_fraction": 0}}, "actors.grow_idle_fraction"),
        ({"actors": {"min": 1, "max": 2, "surge": 3}}, "generation.actors.surge"),
        (
            {"standby": 1, "actors": {"min": 1, "max": 2}},
            "run.yaml: generation.standby: generation.standby cannot be combined with an elastic "
            "pool",
        ),
    ],
)
def test_a_bad_pool_names_its_field(generation: dict[str, Any], message: str) -> None:
    assert message in generation_error(generation)


def test_the_dumped_spec_validates_again_to_the_same_spec() -> None:
    spec = RunSpec.model_validate(
        {"generation": {"num_workers": 2, "actors": {"min": 2, "max": 3}}}
    )
    stored = json.loads(json.dumps(spec.model_dump(mode="json")))
    assert RunSpec.model_validate(stored) == spec


def test_an_elastic_run_reserves_its_max_workers() -> None:
    gen = {"num_workers": 1, "num_cpus": 2, "num_gpus": 1, "resources": {"gen_gpu": 1}}
    fixed = resource_needs(RunSpec.model_validate({"generation": gen}))
    elastic = resource_needs(
        RunSpec.model_validate({"generation": {**gen, "actors": {"min": 1, "max": 3}}})
    )
    assert elastic.cpus - fixed.cpus == 2 * 2
    assert elastic.gpus - fixed.gpus == 2
    assert elastic.custom["gen_gpu"] == 3
