"""The generation worker as a stream, with in-flight weight updates, on real Ray.

The worker starts from weights that never sample EOS (never_stopping.py), so a long group is
certainly still decoding when the test acts, whatever the timing: it ends only once weights that
can stop are loaded. Each test brings the worker to the weights it needs through offers, so the
tests share one worker (starting one costs most of the time here).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.generation.base import GroupRequest, SamplingSettings
from services.generation.worker import GenerationStats, GenerationWorker, offer_weights_to
from services.messages import Prompt, Response
from tests.services.generation.never_stopping import save_never_stopping_model
from tests.services.generation.offline_logprobs import kept_cache_logprobs, plain_logprobs

pytestmark = pytest.mark.usefixtures("ray_instance")

TOLERANCE = 1e-4  # as in test_hf_logprobs.py
# Rows of the never-stopping weights end only here; far beyond the few steps a test needs
# before it offers stopping weights (the stopping weights then end them within a few hundred).
LONG = 8192


@pytest.fixture(scope="module")
def never_stopping_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_never_stopping_model(tiny_model_dir, tmp_path_factory.mktemp("never-stopping"))


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path, never_stopping_dir: Path) -> dict[str, PreTrainedModel]:
    """Reference models: "endless" (never samples EOS) and "stopping" (the tiny model)."""
    return {
        # from_pretrained returns a model in eval mode
        "endless": AutoModelForCausalLM.from_pretrained(never_stopping_dir),
        "stopping": AutoModelForCausalLM.from_pretrained(tiny_model_dir),
    }


@pytest.fixture(scope="module")
def worker(never_stopping_dir: Path, ray_instance: None) -> Iterator[Any]:
    handle: Any = GenerationWorker.options(num_cpus=1).remote(
        "hf", str(never_stopping_dir), in_flight_updates=True
    )
    yield handle
    ray.kill(handle)


def offer(worker: Any, model: PreTrainedModel) -> int:
    """Offer `model`'s weights as the next version; return that version."""
    stats: GenerationStats = ray.get(worker.stats.remote())
    version = max(stats.pending_version or 0, stats.policy_version) + 1
    _, acks = offer_weights_to([worker], version, dict(model.state_dict()))
    assert ray.get(acks) == [True]
    return version


def collect(worker: Any, groups: int) -> list[list[Response]]:
    out: list[list[Response]] = []
    while len(out) < groups:
        out.extend(ray.get(worker.next_groups.remote(60.0)).groups)
    return out


def long_and_short(tag: str) -> list[GroupRequest]:
    return [
        GroupRequest(Prompt(f"long-{tag}", "12+34=", ""), 3, SamplingSettings(max_new_tokens=LONG)),
        GroupRequest(Prompt(f"short-{tag}", "7", ""), 2, SamplingSettings(max_new_tokens=1)),
    ]


def test_a_short_group_streams_back_while_a_long_group_of_the_same_submit_decodes(
    worker: Any, models: dict[str, PreTrainedModel]
) -> None:
    offer(worker, models["endless"])
    ray.get(worker.submit.remote(long_and_short("s")))
    first = ray.get(worker.next_groups.remote(60.0)).groups
    # The long group cannot have ended: these weights never stop a row before LONG tokens.
    assert [group[0].prompt_id for group in first] == ["short-s"]
    stats: GenerationStats = ray.get(worker.stats.remote())
    assert stats.groups_in_flight == 1 and stats.groups_returned >= 1
    offer(worker, models["stopping"])  # lets the long group end
    (last,) = collect(worker, 1)
    assert last[0].prompt_id == "long-s" and len(last) == 3


def test_an_update_in_flight_splits_responses_between_versions_with_exact_logprobs(
    worker: Any, models: dict[str, PreTrainedModel]
) -> None:
    """The long group is admitted with the short one, so it has sampled at least one token
    when the short one is back; then new weights arrive and every row's remaining tokens are
    theirs. Each token's behaviour log-prob is recomputed offline under the weights (and the
    kept cache) that sampled it."""
    old = offer(worker, models["endless"])
    ray.get(worker.submit.remote(long_and_short("f")))
    assert [g[0].prompt_id for g in ray.get(worker.next_groups.remote(60.0)).groups] == ["short-f"]
    before: GenerationStats = ray.get(worker.stats.remote())
    new = offer(worker, models["stopping"])
    (group,) = collect(worker, 1)
    stats: GenerationStats = ray.get(worker.stats.remote())
    assert stats.in_flight_swaps == before.in_flight_swaps + 1
    for response in group:
        versions = response.versions()
        k = versions.count(old)
        assert response.policy_version == old and response.version_span == 2
        assert versions == [old] * k + [new] * (len(versions) - k) and k >= 1
        assert response.finish_reason == "stop"  # only the new weights can stop it
        head = torch.tensor(response.behaviour_logprobs[:k])
        assert float((head - plain_logprobs(models["endless"], response)[:k]).abs().max()) < (
            TOLERANCE
        )
        tail = torch.tensor(response.behaviour_logprobs[k:])
        expected = kept_cache_logprobs(models["endless"], models["stopping"], response, k)
        assert float((tail - expected).abs().max()) < TOLERANCE
