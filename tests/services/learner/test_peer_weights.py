"""A new generation worker takes a delta publish's version whole from a surviving worker on its
node rather than from the learner on another (services/weights/sources.py), on a real Ray
cluster of two nodes: the learner's and the workers'. The weights it loads are the learner's
published ones bit for bit whichever copy it took; a peer that does not hold the version, or
died, is passed over for the learner.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from services.generation.base import SamplingSettings
from services.generation.worker import GenerationWorker
from services.learner.group import LearnerGroup, wait_all
from services.messages import ScoredGroup
from services.pipeline.actors import ACTOR_ENV
from services.spec import LearnerConfig, PipelineConfig, RunSpec
from services.weights.base import WeightsOffer
from tests.services.conftest import REPO_ROOT
from tests.services.learner.conftest import PROMPTS

pytestmark = pytest.mark.timeout(300)

SAMPLING = SamplingSettings(max_new_tokens=2, seed=0)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[None]:
    """A Ray cluster of two nodes on this machine: the head, where only the learner fits
    (`learner_node`), and one where only generation workers do (`generation_node`)."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"learner_node": 1}},
    )
    cluster.add_node(num_cpus=1, resources={"generation_node": 4})
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address=cluster.address,
        runtime_env={"env_vars": {**ACTOR_ENV, "PYTHONPATH": python_path}},
    )
    cluster.wait_for_nodes()
    try:
        yield
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def learner(two_nodes: None, tiny_model_dir: Path) -> Iterator[LearnerGroup]:
    config = LearnerConfig(
        lr=1e-4, num_cpus=0.5, compute_dtype="bfloat16", resources={"learner_node": 1}
    )
    spec = RunSpec(learner=config, pipeline=PipelineConfig(weight_bucket_mb=1))
    group = LearnerGroup(spec, str(tiny_model_dir))
    wait_all(group.setup())
    yield group
    group.kill()


def _worker(model_dir: Path) -> Any:
    options = {"num_cpus": 0.2, "resources": {"generation_node": 1}}
    return GenerationWorker.options(**options).remote("hf", str(model_dir), dtype="bfloat16")


def _publish(learner: LearnerGroup, groups: list[ScoredGroup]) -> WeightsOffer:
    ray.get(learner.train_step(groups).metrics)
    published = learner.publish(learner.call("version"))
    offer: WeightsOffer = ray.get(published.offer)
    wait_all(published.peers)
    return offer


def _load(worker: Any, offer: WeightsOffer) -> tuple[int, int]:
    """Have `worker` load `offer`; its weights must then be the learner's published ones.
    Returns its (dense_loads, peer_loads)."""
    ray.get(worker.offer_weights.remote(offer.version, [offer]))
    ray.get(worker.generate.remote(PROMPTS[:1], 1, SAMPLING))
    stats = ray.get(worker.stats.remote())
    assert stats.policy_version == offer.version
    return stats.dense_loads, stats.peer_loads


def _assert_published(worker: Any, learner: LearnerGroup) -> None:
    got = ray.get(
        worker.__ray_call__.remote(
            lambda self: {n: t.clone() for n, t in self._backend.model.state_dict().items()}
        )
    )
    for name, tensor in learner.call("published_state_dict").items():
        assert torch.equal(got[name], tensor), name


def _node_of(actor: Any) -> str:
    return ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))


def test_a_new_worker_copies_a_peer_on_its_node_and_falls_back_to_the_learner(
    learner: LearnerGroup, tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    survivor, newcomer, late, orphan = (_worker(tiny_model_dir) for _ in range(4))
    assert _node_of(survivor) == _node_of(newcomer) != _node_of(learner.ranks[0])
    try:
        offer = _publish(learner, groups)
        assert _load(survivor, offer) == (0, 0)  # the learner's first publish is whole
        offer = _publish(learner, groups)
        assert _load(survivor, offer) == (0, 0)  # the patch applied to its copy

        assert _load(newcomer, dataclasses.replace(offer, peers=(survivor,))) == (1, 1)
        _assert_published(newcomer, learner)

        # The survivor has not loaded the next version: it refuses, the learner gives it.
        offer = _publish(learner, groups)
        assert _load(late, dataclasses.replace(offer, peers=(survivor,))) == (1, 0)
        _assert_published(late, learner)

        assert _load(newcomer, offer) == (1, 1)  # a peer's copy is a base for patches
        ray.kill(survivor)
        assert _load(orphan, dataclasses.replace(offer, peers=(survivor, newcomer))) == (1, 1)
        _assert_published(orphan, learner)
    finally:
        for worker in (survivor, newcomer, late, orphan):
            ray.kill(worker)
