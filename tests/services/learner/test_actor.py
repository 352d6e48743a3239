"""The learner actor on a real local Ray instance."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from kpo_core.config import LearnerConfig, RunSpec
from services.generation.base import SamplingSettings
from services.generation.hf_backend import HFBackend
from services.learner.actor import start_learner
from services.messages import ScoredGroup
from tests.services.learner.conftest import PROMPTS

pytestmark = pytest.mark.usefixtures("ray_instance")


@pytest.fixture(scope="module")
def learner(tiny_model_dir: Path, ray_instance: None) -> Iterator[Any]:
    spec = RunSpec(learner=LearnerConfig(lr=1e-2, num_cpus=1))
    handle = start_learner(spec, str(tiny_model_dir))
    yield handle
    ray.kill(handle)


def test_a_step_returns_metrics_and_weights_a_generation_backend_loads(
    learner: Any, tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    assert ray.get(learner.pid.remote()) != os.getpid()
    assert ray.get(learner.version.remote()) == 0
    initial = ray.get(learner.initial_weights.remote())

    metrics_ref, weights_ref = learner.step.options(num_returns=2).remote(groups)
    metrics = ray.get(metrics_ref)
    assert metrics["policy_version"] == 1.0 and metrics["grad_norm"] > 0
    assert ray.get(learner.version.remote()) == 1

    backend = HFBackend(tiny_model_dir)
    for name, tensor in backend.model.state_dict().items():
        assert torch.equal(tensor, initial[name]), name
    weights = ray.get(weights_ref)
    backend.load_weights(weights, version=1)
    changed = [n for n, t in backend.model.state_dict().items() if not torch.equal(t, initial[n])]
    assert changed and all(
        torch.equal(t, weights[n]) for n, t in backend.model.state_dict().items()
    )
    responses = backend.generate(PROMPTS[:1], 2, SamplingSettings(max_new_tokens=4, seed=0))
    assert {r.policy_version for r in responses[0]} == {1}

    path = ray.get(learner.save_checkpoint.remote(str(tmp_path / "ckpt")))
    assert ray.get(learner.load_checkpoint.remote(path)) == 1
