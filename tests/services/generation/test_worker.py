"""The generation worker actor, on a real local Ray instance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from services.generation.base import SamplingSettings
from services.generation.worker import GenerationStats, GenerationWorker, offer_weights_to
from services.messages import Prompt, Response

pytestmark = pytest.mark.usefixtures("ray_instance")

PROMPTS = [Prompt("a", "1+2=", ""), Prompt("b", "40-13=", "")]
SAMPLING = SamplingSettings(max_new_tokens=10, seed=5)


@pytest.fixture(scope="module")
def weights(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    """The tiny model's weights as saved, loaded in the driver as a learner would hold them."""
    return dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict())


def perturbed(weights: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """`weights` plus noise: a stand-in for a learner's next version."""
    generator = torch.Generator().manual_seed(1)
    return {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in weights.items()}


def flat(groups: list[list[Response]]) -> list[Response]:
    return [response for group in groups for response in group]


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path, ray_instance: None) -> Iterator[Any]:
    handle: Any = GenerationWorker.options(num_cpus=1).remote("hf", str(tiny_model_dir))
    yield handle
    ray.kill(handle)


def test_batches_pick_up_the_newest_offered_weights(
    worker: Any, weights: dict[str, torch.Tensor]
) -> None:
    first = flat(ray.get(worker.generate.remote(PROMPTS, 3, SAMPLING)))
    assert len(first) == 6 and {r.policy_version for r in first} == {0}

    # Two versions offered before the next batch: only the newest is fetched and loaded.
    _, acks = offer_weights_to([worker], 1, perturbed(weights, 0.2))
    assert ray.get(acks) == [True]
    _, acks = offer_weights_to([worker], 2, perturbed(weights, 0.4))
    assert ray.get(acks) == [True]
    assert ray.get(worker.policy_version.remote()) == 0  # nothing swapped until a batch starts

    second = flat(ray.get(worker.generate.remote(PROMPTS, 3, SAMPLING)))
    assert {r.policy_version for r in second} == {2}
    assert [r.response_token_ids for r in second] != [r.response_token_ids for r in first]
    assert ray.get(worker.policy_version.remote()) == 2

    # A stale offer is refused; a bare (top-level) ref, resolved by Ray on arrival, also works.
    _, acks = offer_weights_to([worker], 2, perturbed(weights, 0.1))
    assert ray.get(acks) == [False]
    bare = ray.put(perturbed(weights, 0.3))
    assert ray.get(worker.offer_weights.remote(5, bare)) is True
    third = flat(ray.get(worker.generate.remote(PROMPTS, 3, SAMPLING)))
    assert {r.policy_version for r in third} == {5}


def test_stats_report_throughput(worker: Any) -> None:
    before: GenerationStats = ray.get(worker.stats.remote())
    groups = ray.get(worker.generate.remote(PROMPTS, 4, SAMPLING))
    tokens = sum(len(r.response_token_ids) for r in flat(groups))
    stats: GenerationStats = ray.get(worker.stats.remote())
    assert stats.backend == "hf"
    assert stats.batches == before.batches + 1
    assert stats.last_batch_tokens == tokens
    assert stats.tokens_generated == before.tokens_generated + tokens
    assert stats.last_batch_tokens_per_s > 0 and stats.tokens_per_s > 0
    assert stats.weight_swaps >= before.weight_swaps
    assert stats.policy_version == ray.get(worker.policy_version.remote())


def test_a_bad_offer_fails_batches_until_a_newer_one_replaces_it(
    worker: Any, weights: dict[str, torch.Tensor]
) -> None:
    version = ray.get(worker.policy_version.remote())
    broken = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    offer_weights_to([worker], version + 1, broken)
    for _ in range(2):  # the offer is kept: never silently generate with older weights
        with pytest.raises(
            ray.exceptions.RayTaskError, match=r"missing keys \['lm_head\.weight'\]"
        ):
            ray.get(worker.generate.remote(PROMPTS, 1, SAMPLING))
    assert ray.get(worker.policy_version.remote()) == version

    offer_weights_to([worker], version + 2, weights)
    groups = ray.get(worker.generate.remote(PROMPTS, 1, SAMPLING))
    assert {r.policy_version for r in flat(groups)} == {version + 2}
