"""The learner group (one rank, and two FSDP2 ranks) on a real local Ray instance."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from services.generation.base import SamplingSettings
from services.generation.hf_backend import HFBackend
from services.learner.group import LearnerGroup, wait_all
from services.messages import ScoredGroup
from services.spec import LearnerConfig, PipelineConfig, RunSpec
from services.weights.object_store import fetch_buckets
from tests.services.learner.conftest import PROMPTS

pytestmark = pytest.mark.usefixtures("ray_instance")


@pytest.fixture(scope="module", params=[1, 2], ids=["single", "fsdp2-2-ranks"])
def learner(request: Any, tiny_model_dir: Path, ray_instance: None) -> Iterator[LearnerGroup]:
    world_size = request.param
    strategy = "single" if world_size == 1 else "fsdp2"
    config = LearnerConfig(lr=1e-2, num_cpus=0.5, strategy=strategy, world_size=world_size)
    # Whole buckets: delta publishes have their own tests (test_delta_publish.py).
    pipeline = PipelineConfig(weight_delta="off")
    group = LearnerGroup(RunSpec(learner=config, pipeline=pipeline), str(tiny_model_dir))
    wait_all(group.setup())
    yield group
    group.kill()


def test_a_step_returns_metrics_and_weights_a_generation_backend_loads(
    learner: LearnerGroup, tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    pids = learner.pids()
    assert len(set(pids)) == len(learner.ranks) and os.getpid() not in pids
    assert learner.call("version") == 0
    initial = learner.call("published_state_dict")

    refs = learner.train_step(groups)
    metrics = ray.get(refs.metrics)
    assert metrics["policy_version"] == 1.0 and metrics["grad_norm"] > 0
    assert metrics["learner_world_size"] == len(learner.ranks)
    assert wait_all(refs.peers) == [{}] * (len(learner.ranks) - 1)
    assert learner.call("version") == 1

    backend = HFBackend(tiny_model_dir)
    for name, tensor in backend.model.state_dict().items():
        assert torch.equal(tensor, initial[name]), name
    published = learner.publish(1)
    offer = ray.get(published.offer)  # names and bucket refs; the buckets are fetched one by one
    assert wait_all(published.peers) == [None] * len(learner.ranks)
    assert offer.manifest.version == 1
    backend.load_weight_buckets(fetch_buckets(offer), offer.manifest)
    weights = learner.call("published_state_dict")
    changed = [n for n, t in backend.model.state_dict().items() if not torch.equal(t, initial[n])]
    assert changed and all(
        torch.equal(t, weights[n]) for n, t in backend.model.state_dict().items()
    )
    responses = backend.generate(PROMPTS[:1], 2, SamplingSettings(max_new_tokens=4, seed=0))
    assert {r.policy_version for r in responses[0]} == {1}

    learner.save_checkpoint(str(tmp_path / "ckpt"))()  # start, then wait for every rank
    assert learner.load_checkpoint(str(tmp_path / "ckpt")) == 1


def test_an_overlapped_publish_hands_out_the_version_it_began_with(
    learner: LearnerGroup, tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    """The next step is sent before the offer is asked for: a single rank reads the weights
    beside it, FSDP2 ranks gather before it and put beside it. Either way the offer holds the
    version published, bit for bit, and the step trained on."""
    assert learner.overlaps_publish
    version = learner.call("version")
    ray.get(learner.train_step(groups).metrics)
    published = learner.publish(version + 1)
    weights = learner.call("published_state_dict")  # before the next step, in order
    next_step = learner.train_step(groups)
    offer = ray.get(published.offer)
    assert wait_all(published.peers) == [None] * len(learner.ranks)
    assert ray.get(next_step.metrics)["policy_version"] == version + 2
    backend = HFBackend(tiny_model_dir)
    backend.load_weight_buckets(fetch_buckets(offer), offer.manifest)
    assert backend.policy_version == version + 1
    loaded = backend.model.state_dict()
    assert all(torch.equal(tensor, weights[name]) for name, tensor in loaded.items())
    after = learner.call("published_state_dict")
    assert any(not torch.equal(after[name], weights[name]) for name in weights)
