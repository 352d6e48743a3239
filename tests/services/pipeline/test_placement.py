"""Placement by role: what a run reserves, and where its learner ranks are allowed to land."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray.util.placement_group import placement_group_table

from services.learner.group import LearnerGroup
from services.pipeline.actors import resource_needs
from tests.services.pipeline.conftest import tiny_spec


def test_a_run_reserves_every_rank_and_its_custom_resources() -> None:
    spec = tiny_spec(
        "learner.strategy=fsdp2",
        "learner.world_size=4",
        "learner.num_cpus=2",
        "learner.num_gpus=1",
        "learner.resources={learner_gpu: 1}",
        "generation.num_workers=3",
        "generation.num_gpus=1",
        "generation.resources={generation_gpu: 1, l4: 0.5}",
    )
    needs = resource_needs(spec)
    # 3 generation workers x 1 CPU + 1 verifier x 0 + 4 ranks x 2 CPUs.
    assert needs.cpus == 3 + 0 + 8 and needs.gpus == 3 + 4
    assert needs.custom == {"learner_gpu": 4.0, "generation_gpu": 3.0, "l4": 1.5}


def test_standby_workers_reserve_what_serving_workers_do() -> None:
    workers = ("generation.num_workers=2", "generation.num_gpus=1", "generation.resources={l4: 1}")
    without = resource_needs(tiny_spec(*workers))
    with_two = resource_needs(tiny_spec(*workers, "generation.standby=2"))
    # Two more models: each standby's CPU, GPU and custom resources, as a serving worker's.
    assert with_two.cpus == without.cpus + 2 and with_two.gpus == without.gpus + 2
    assert with_two.custom == {"l4": 4.0} and without.custom == {"l4": 2.0}


@pytest.mark.usefixtures("ray_instance")
def test_each_rank_gets_a_bundle_of_its_resources(tiny_model_dir: Path) -> None:
    """The ranks' placement group asks, per rank, for its CPUs and custom resources. The local
    instance has no `learner_gpu`, so the group stays pending: exactly what keeps learner ranks
    off nodes not meant for them."""
    spec = tiny_spec(
        "learner.strategy=fsdp2",
        "learner.world_size=2",
        "learner.num_cpus=0.5",
        "learner.resources={learner_gpu: 1}",
    )
    group = LearnerGroup(spec, str(tiny_model_dir))
    try:
        assert group.placement is not None
        table = placement_group_table(group.placement)
        bundles = list(table["bundles"].values())
        assert bundles == [{"CPU": 0.5, "learner_gpu": 1.0}] * 2
        assert table["strategy"] == "PACK" and table["state"] == "PENDING"
    finally:
        group.kill()
