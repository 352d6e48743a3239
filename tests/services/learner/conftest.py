"""Fixtures of the learner tests: the random tiny model on disk, sampled groups, configs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kpo_core.config import AlgorithmConfig
from services.generation.base import SamplingSettings
from services.generation.hf_backend import HFBackend
from services.learner.distributed import RankGroup
from services.learner.step import LearnerCore
from services.messages import Prompt, ScoredGroup, ScoredResponse
from services.spec import LearnerConfig

PROMPTS = [Prompt("a", "1+2=", "3"), Prompt("b", "40-13=", "27"), Prompt("c", "7", "7")]
GROUP_SIZE = 4
# The response limit the groups are sampled with, and so the learner's `response_length`: the
# shipped `reference_length: auto` resolves to it, as in a run.
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread (the tiny model gains nothing from more), restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def sample_groups(
    model_dir: Path, temperature: float = 1.0, seed: int = 3, max_new_tokens: int = MAX_NEW_TOKENS
) -> list[ScoredGroup]:
    """Groups sampled by an HF backend with the weights on disk (version 0), scored by hand.

    In every group the first response is rewarded 1 (correct), the others 0, so every group
    carries a learning signal whatever the random model wrote.
    """
    backend = HFBackend(model_dir)
    sampling = SamplingSettings(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    groups = backend.generate(PROMPTS, GROUP_SIZE, sampling)
    return [
        ScoredGroup(
            prompt,
            [
                ScoredResponse(response, 1.0 if index == 0 else 0.0, verified=True)
                for index, response in enumerate(responses)
            ],
        )
        for prompt, responses in zip(PROMPTS, groups, strict=True)
    ]


def make_core(
    model_dir: Path,
    estimator: str = "kalman",
    reference: str = "behaviour",
    seed: int = 0,
    group: RankGroup | None = None,
    algorithm: dict[str, Any] | None = None,
    **learner: Any,
) -> LearnerCore:
    """A learner on `model_dir` (lr 1e-3 unless given), sampling temperature 1; with `group`,
    one rank of an FSDP2 learner group of that size (its process group joined already)."""
    settings = {"estimator": {"name": estimator}, "reference": reference, **(algorithm or {})}
    if group is not None:
        learner = {"strategy": "fsdp2", "world_size": group.world_size, **learner}
    config = LearnerConfig(**{"lr": 1e-3, **learner})
    algorithm_config = AlgorithmConfig.model_validate(settings)
    return LearnerCore(
        model_dir,
        config,
        algorithm_config,
        temperature=1.0,
        seed=seed,
        group=group,
        response_length=MAX_NEW_TOKENS,
    )


@pytest.fixture(scope="session")
def groups(tiny_model_dir: Path) -> list[ScoredGroup]:
    """Three groups of four responses sampled at temperature 1 from the weights on disk."""
    return sample_groups(tiny_model_dir)
