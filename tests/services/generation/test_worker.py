"""The generation worker actor with the default swap policy (drain, then swap), on real Ray.

One worker serves the module (starting one costs most of the time here). The last test breaks
its engine on purpose, so it runs last (pytest keeps file order).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from services.generation.base import GroupRequest, Refusal, SamplingSettings, StreamedGroups
from services.generation.hf_backend import HFBackend
from services.generation.worker import (
    GenerationStats,
    GenerationWorker,
    GenerationWorkerImpl,
    offer_weights_to,
)
from services.messages import Prompt, Response
from services.weights.base import TensorSpec, WeightsManifest
from services.weights.buckets import plan_buckets
from services.weights.collective import connect, open_weight_group

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


def collect(worker: Any, groups: int) -> list[list[Response]]:
    """Poll next_groups until `groups` groups came back."""
    out: list[list[Response]] = []
    while len(out) < groups:
        out.extend(ray.get(worker.next_groups.remote(30.0)).groups)
    return out


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
    assert ray.get(worker.policy_version.remote()) == 0  # nothing swapped until work arrives

    second = flat(ray.get(worker.generate.remote(PROMPTS, 3, SAMPLING)))
    assert {r.policy_version for r in second} == {2}
    assert [r.response_token_ids for r in second] != [r.response_token_ids for r in first]
    assert ray.get(worker.policy_version.remote()) == 2
    assert ray.get(worker.stats.remote()).weight_swaps == 1

    # A stale offer is refused; an offer in any other form than a WeightsOffer in a list too.
    _, acks = offer_weights_to([worker], 2, perturbed(weights, 0.1))
    assert ray.get(acks) == [False]
    bare = ray.put(perturbed(weights, 0.3))
    with pytest.raises(
        ray.exceptions.RayTaskError, match="one-element list holding a WeightsOffer"
    ):
        ray.get(worker.offer_weights.remote(5, [bare]))
    assert ray.get(worker.policy_version.remote()) == 2


def test_stats_report_throughput(worker: Any) -> None:
    before: GenerationStats = ray.get(worker.stats.remote())
    groups = ray.get(worker.generate.remote(PROMPTS, 4, SAMPLING))
    tokens = sum(len(r.response_token_ids) for r in flat(groups))
    stats: GenerationStats = ray.get(worker.stats.remote())
    assert stats.backend == "hf" and not stats.in_flight_updates
    assert stats.batches == before.batches + 1
    assert stats.last_batch_tokens == tokens
    assert stats.tokens_generated == before.tokens_generated + tokens
    assert stats.groups_returned == before.groups_returned + len(PROMPTS)
    assert stats.steps > before.steps and stats.busy_seconds > before.busy_seconds
    assert stats.last_batch_tokens_per_s > 0 and stats.tokens_per_s > 0
    assert stats.groups_in_flight == 0 and stats.pending_version is None
    assert stats.policy_version == ray.get(worker.policy_version.remote())


def test_a_bad_offer_is_loaded_twice_then_fails_batches_until_a_newer_one_replaces_it(
    worker: Any, weights: dict[str, torch.Tensor]
) -> None:
    version = ray.get(worker.policy_version.remote())
    failed_before = ray.get(worker.stats.remote()).failed_loads
    broken = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    # Acknowledged before the next call: a threaded actor runs one caller's calls concurrently.
    assert ray.get(offer_weights_to([worker], version + 1, broken)[1]) == [True]
    for _ in range(2):  # the offer is kept: never silently generate with older weights
        with pytest.raises(ray.exceptions.RayTaskError, match=r"missing \['lm_head\.weight'\]"):
            ray.get(worker.generate.remote(PROMPTS, 1, SAMPLING))
    with pytest.raises(ray.exceptions.RayTaskError, match=r"WeightSwapError.*lm_head\.weight"):
        ray.get(worker.next_groups.remote(0.0))
    assert ray.get(worker.policy_version.remote()) == version
    # Loaded once more from the same offer after the first failure, then given up: calls made
    # after that raise without loading it again.
    assert ray.get(worker.stats.remote()).failed_loads == failed_before + 2

    assert ray.get(offer_weights_to([worker], version + 2, weights)[1]) == [True]
    groups = ray.get(worker.generate.remote(PROMPTS, 1, SAMPLING))
    assert {r.policy_version for r in flat(groups)} == {version + 2}
    assert ray.get(worker.next_groups.remote(0.0)).groups == []


def test_generate_and_the_stream_share_the_engine_without_mixing_groups(worker: Any) -> None:
    """The same prompt id in the stream and in a blocking call: each gets its own groups."""
    sampling = SamplingSettings(max_new_tokens=8, seed=9)
    streamed = [GroupRequest(prompt, 2, sampling) for prompt in PROMPTS]
    ray.get(worker.submit.remote(streamed))
    generated = ray.get(worker.generate.remote(PROMPTS[:1], 3, sampling))
    stream = collect(worker, 2)
    assert [len(group) for group in generated] == [3]
    assert generated[0][0].prompt_id == "a"
    assert sorted((g[0].prompt_id, len(g)) for g in stream) == [("a", 2), ("b", 2)]
    with pytest.raises(ray.exceptions.RayTaskError, match=r"prompt 'a'.*group_size"):
        ray.get(worker.submit.remote([GroupRequest(PROMPTS[0], 0, sampling)]))


def test_drain_policy_keeps_every_response_single_version(
    worker: Any, weights: dict[str, torch.Tensor]
) -> None:
    """Without in-flight updates, groups in flight end under the weights they started with and
    groups submitted after an offer start under it. Holds whenever the offer lands."""
    version = ray.get(worker.policy_version.remote())
    before: GenerationStats = ray.get(worker.stats.remote())
    long = GroupRequest(Prompt("long", "99-3=;# 5", ""), 3, SamplingSettings(max_new_tokens=48))
    short = GroupRequest(Prompt("short", "7", ""), 2, SamplingSettings(max_new_tokens=1))
    ray.get(worker.submit.remote([long, short]))
    first = collect(worker, 1)
    assert first[0][0].prompt_id == "short"  # it ended at the first step, whatever came with it
    _, acks = offer_weights_to([worker], version + 1, perturbed(weights, 0.2))
    assert ray.get(acks) == [True]
    after = GroupRequest(Prompt("after", "1+2=", ""), 2, SamplingSettings(max_new_tokens=8))
    ray.get(worker.submit.remote([after]))
    groups = {g[0].prompt_id: g for g in first + collect(worker, 3 - len(first))}
    assert {r.version_span for g in groups.values() for r in g} == {1}
    assert {r.policy_version for r in groups["long"] + groups["short"]} == {version}
    assert {r.policy_version for r in groups["after"]} == {version + 1}
    stats: GenerationStats = ray.get(worker.stats.remote())
    assert stats.weight_swaps == before.weight_swaps + 1
    assert stats.in_flight_swaps == before.in_flight_swaps  # never swapped with rows in flight


def test_collective_weights_reach_the_worker_exactly(
    worker: Any, tiny_model_dir: Path, weights: dict[str, torch.Tensor]
) -> None:
    """This process plays learner rank 0 of a gloo weight group; the worker receives between
    two steps, staging while groups are in flight (drain policy), and then generates exactly
    what a local backend holding the same weights generates."""
    assert ray.get(worker.weight_receivers.remote()) == 1
    group = open_weight_group(2, "gloo", generation=1)
    joined = worker.join_weight_group.remote(group, 1)
    channel = connect(group, 0)
    ray.get(joined)

    version = ray.get(worker.policy_version.remote()) + 1
    new = perturbed(weights, 0.25)
    specs = [TensorSpec(name, tuple(t.shape), "float32") for name, t in new.items()]
    manifest = WeightsManifest(version, plan_buckets(specs, 64 * 1024))
    long = GroupRequest(Prompt("long", "5-5=", ""), 2, SamplingSettings(max_new_tokens=40))
    short = GroupRequest(Prompt("short", "7", ""), 1, SamplingSettings(max_new_tokens=1))
    ray.get(worker.submit.remote([long, short]))
    # Back after the first step, which admitted both: the long group started on the old weights.
    first = collect(worker, 1)
    assert first[0][0].prompt_id == "short"
    received = worker.receive_weights.remote(manifest)
    channel.send(manifest, ({s.name: new[s.name] for s in b} for b in manifest.buckets))
    ray.get(received)
    channel.close()

    sampling = SamplingSettings(temperature=0.8, top_k=6, max_new_tokens=12, seed=17)
    after = ray.get(worker.generate.remote(PROMPTS, 3, sampling))
    (long_group,) = [g for g in first + collect(worker, 2 - len(first)) if g[0].prompt_id == "long"]
    assert {r.policy_version for r in long_group} == {version - 1}
    assert {r.version_span for r in long_group} == {1}
    local = HFBackend(tiny_model_dir)
    local.load_weights(new, version)
    expected = local.generate(PROMPTS, 3, sampling)
    assert [(r.response_token_ids, r.policy_version) for r in flat(after)] == [
        (r.response_token_ids, r.policy_version) for r in flat(expected)
    ]
    for got, want in zip(flat(after), flat(expected), strict=True):
        assert got.behaviour_logprobs == pytest.approx(want.behaviour_logprobs, abs=1e-6)


@pytest.fixture
def no_bos_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with a tokenizer that adds no BOS, so an empty prompt encodes to nothing
    (which the backend refuses)."""
    directory = Path(shutil.copytree(tiny_model_dir, tmp_path / "no-bos"))
    config = json.loads((directory / "tokenizer.json").read_text())
    config["post_processor"] = None
    (directory / "tokenizer.json").write_text(json.dumps(config))
    return directory


def test_a_request_the_backend_refuses_is_answered_alone(no_bos_model_dir: Path) -> None:
    """In process (no actor): the refused requests come out of next_groups once each, with
    their reason, the requests submitted with them are generated, and a blocking call raises."""
    impl = GenerationWorkerImpl("hf", str(no_bos_model_dir))
    try:
        sampling = SamplingSettings(max_new_tokens=3, seed=1)
        empty = Prompt("empty", "", "")
        # 600 characters: 600 tokens, past the tiny model's 512 positions.
        too_long = Prompt("long", "1+" * 300, "")
        # 508 tokens: room for 4 response tokens, whatever max_new_tokens says.
        near_limit = Prompt("near", "1+" * 254, "")
        impl.submit(
            [
                GroupRequest(PROMPTS[0], 2, sampling),
                GroupRequest(empty, 2, sampling),
                GroupRequest(too_long, 2, sampling),
                GroupRequest(near_limit, 2, replace(sampling, max_new_tokens=40)),
            ]
        )
        groups: list[list[Response]] = []
        refused: list[Refusal] = []
        while not (len(groups) == 2 and len(refused) == 2):  # in whichever order they come
            streamed = impl.next_groups(30.0)
            groups.extend(streamed.groups)
            refused.extend(streamed.refused)
        assert sorted((g[0].prompt_id, len(g)) for g in groups) == [("a", 2), ("near", 2)]
        (near,) = [g for g in groups if g[0].prompt_id == "near"]
        for response in near:  # ended where the model's positions end
            assert len(response.prompt_token_ids) + len(response.response_token_ids) <= 512
            assert response.finish_reason in ("length", "stop")
        by_id = {refusal.prompt_id: refusal for refusal in refused}
        assert by_id["empty"].reason == "refused"
        assert re.search(r"prompt 'empty' refused.*encodes to no tokens", by_id["empty"].message)
        assert by_id["long"].reason == "prompt_too_long"
        assert re.search(r"'long\S*' has 600 tokens.*takes 512 tokens", by_id["long"].message)
        assert impl.next_groups(0.0) == StreamedGroups([])  # reported once
        with pytest.raises(ValueError, match=r"prompt 'empty' refused"):
            impl.generate([PROMPTS[1], empty], 2, sampling)
        assert len(impl.generate([PROMPTS[1]], 2, sampling)) == 1
    finally:
        impl.close()


def test_an_engine_exception_surfaces_as_the_call_error(
    worker: Any, weights: dict[str, torch.Tensor]
) -> None:
    """NaN weights make the next step raise inside the engine thread: every later call says so
    (this leaves the module's worker unusable, hence last)."""
    version = ray.get(worker.policy_version.remote())
    nan = {k: torch.full_like(v, float("nan")) for k, v in weights.items()}
    ray.get(offer_weights_to([worker], version + 1, nan)[1])
    ray.get(worker.submit.remote([GroupRequest(PROMPTS[0], 2, SAMPLING)]))
    with pytest.raises(ray.exceptions.RayTaskError, match=r"non-finite logits.*\['a#\d+'\]"):
        while True:  # the error comes instead of the group, at the latest
            ray.get(worker.next_groups.remote(30.0))
    calls: list[Any] = [
        worker.generate.remote(PROMPTS, 1, SAMPLING),
        worker.submit.remote([GroupRequest(PROMPTS[1], 1, SAMPLING)]),
        worker.next_groups.remote(0.0),
    ]
    for call in calls:
        with pytest.raises(ray.exceptions.RayTaskError, match=r"EngineFailedError.*non-finite"):
            ray.get(call)
