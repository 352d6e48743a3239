"""Delta publishes (`pipeline.weight_delta: auto`) from a real learner to real generation
workers on a local Ray: after every version each worker's weights are the learner's published
weights bit for bit, whether it loaded every version, skipped some (it applies the chain), got
a damaged patch (its digest catches it and the worker loads the weights whole), or joined late.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from torch import Tensor

from services.generation.base import SamplingSettings
from services.generation.worker import GenerationWorker
from services.learner.group import LearnerGroup, wait_all
from services.messages import ScoredGroup
from services.spec import LearnerConfig, PipelineConfig, RunSpec
from services.weights.base import WeightsOffer
from tests.services.learner.conftest import PROMPTS

pytestmark = [pytest.mark.usefixtures("ray_instance"), pytest.mark.timeout(300)]

SAMPLING = SamplingSettings(max_new_tokens=2, seed=0)


@pytest.fixture(scope="module", params=[1, 2], ids=["single", "fsdp2-2-ranks"])
def learner(request: Any, tiny_model_dir: Path, ray_instance: None) -> Iterator[LearnerGroup]:
    world_size = request.param
    strategy = "single" if world_size == 1 else "fsdp2"
    # bf16 weights, as a real run publishes them: a float32 weight moves at every step.
    config = LearnerConfig(
        lr=1e-4,
        num_cpus=0.5,
        strategy=strategy,
        world_size=world_size,
        compute_dtype="bfloat16",
    )
    spec = RunSpec(learner=config, pipeline=PipelineConfig(weight_bucket_mb=1))
    assert spec.pipeline.weight_delta == "auto"  # the default
    group = LearnerGroup(spec, str(tiny_model_dir))
    wait_all(group.setup())
    yield group
    group.kill()


def _worker(model_dir: Path) -> Any:
    return GenerationWorker.options(num_cpus=0.25).remote("hf", str(model_dir), dtype="bfloat16")


def _weights(worker: Any) -> dict[str, Tensor]:
    return ray.get(
        worker.__ray_call__.remote(
            lambda self: {n: t.clone() for n, t in self._backend.model.state_dict().items()}
        )
    )


def _load(worker: Any, offer: WeightsOffer) -> int:
    """Offer `offer` and have the worker load it (its engine swaps before it samples)."""
    ray.get(worker.offer_weights.remote(offer.version, [offer]))
    ray.get(worker.generate.remote(PROMPTS[:1], 1, SAMPLING))
    return int(ray.get(worker.policy_version.remote()))


def _assert_bitwise(worker: Any, learner: LearnerGroup) -> None:
    published = learner.call("published_state_dict")
    got = _weights(worker)
    for name, tensor in published.items():
        assert torch.equal(got[name], tensor), name


def _step_and_publish(
    learner: LearnerGroup, groups: list[ScoredGroup]
) -> tuple[WeightsOffer, dict[str, float]]:
    record = ray.get(learner.train_step(groups).metrics)
    version = learner.call("version")
    published = learner.publish(version)
    offer: WeightsOffer = ray.get(published.offer)
    wait_all(published.peers)
    return offer, record


def _damaged(offer: WeightsOffer) -> WeightsOffer:
    """`offer` with one byte of its first non-empty patch flipped (a fresh object)."""
    index = next(i for i, patch in enumerate(offer.patches) if patch.payload_bytes)
    payload = ray.get(offer.bucket_refs[index]).copy()
    payload[payload.size // 2] ^= 0x20
    refs = list(offer.bucket_refs)
    refs[index] = ray.put(payload)
    return dataclasses.replace(offer, bucket_refs=tuple(refs))


def test_delta_publishes_reach_workers_bitwise(
    learner: LearnerGroup, tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    every, skipping = _worker(tiny_model_dir), _worker(tiny_model_dir)
    try:
        records = []
        for step in range(4):
            offer, record = _step_and_publish(learner, groups)
            records.append(record)
            encodings = {patch.encoding for patch in offer.patches}
            assert len(offer.patches) == len(offer.manifest.buckets)
            if step == 0:
                assert encodings == {"dense"}  # nothing earlier to diff against
            else:
                assert encodings - {"dense"}, encodings  # some bucket sent as a patch
                assert offer.sent_bytes < offer.manifest.nbytes
            assert _load(every, offer) == offer.version
            _assert_bitwise(every, learner)
            if step % 2 == 0:  # the other skips a version, then applies two patches in a row
                ray.get(skipping.offer_weights.remote(offer.version, [offer]))
            else:
                assert _load(skipping, offer) == offer.version
                _assert_bitwise(skipping, learner)
        for worker in (every, skipping):
            assert ray.get(worker.stats.remote()).dense_loads == 0
        # The step after a publish reports what that publish sent.
        last = records[-1]
        assert 0 < last["publish_bytes"] < offer.manifest.nbytes
        assert 0 < last["publish_changed_fraction"] < 1 and last["publish_seconds"] > 0
    finally:
        for worker in (every, skipping):
            ray.kill(worker)


def test_a_damaged_patch_is_caught_and_the_weights_loaded_whole(
    learner: LearnerGroup, tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    worker = _worker(tiny_model_dir)
    try:
        offer, _ = _step_and_publish(learner, groups)
        assert _load(worker, offer) == offer.version  # new: the learner's copy, whole
        assert ray.get(worker.stats.remote()).dense_loads == 1
        offer, _ = _step_and_publish(learner, groups)
        assert _load(worker, _damaged(offer)) == offer.version
        _assert_bitwise(worker, learner)
        stats = ray.get(worker.stats.remote())
        assert stats.dense_loads == 2 and stats.failed_loads == 0
        offer, _ = _step_and_publish(learner, groups)  # and patches apply again after it
        assert _load(worker, offer) == offer.version
        _assert_bitwise(worker, learner)
        assert ray.get(worker.stats.remote()).dense_loads == 2
    finally:
        ray.kill(worker)


def test_collective_delta_publishes_reach_workers_bitwise(
    learner: LearnerGroup, tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    """Over the weight group: the group's first send is whole, later ones patches; every
    worker holds the learner's weights bit for bit after each, and the step after a send
    reports its bytes. The learner of this module publishes over `object_store` too: the
    transport is switched on its ranks for this test."""
    workers = [_worker(tiny_model_dir) for _ in range(2)]
    ray.get([rank.__ray_call__.remote(_use_collective) for rank in learner.ranks])
    try:
        group = ray.get(learner.open_weight_group(3, 1))
        assert group.delta
        joined = [w.join_weight_group.remote(group, 1 + i) for i, w in enumerate(workers)]
        wait_all([learner.connect_weight_group(group), *joined])
        for send in range(4):
            offer, record = _step_and_publish(learner, groups)
            manifest = offer.manifest
            if send > 1:  # the step after a send reports it (the group's first was whole)
                assert 0 < record["publish_bytes"] < manifest.nbytes / 2
                assert 0 < record["publish_changed_fraction"] < 0.5
            received = [w.receive_weights.remote(manifest) for w in workers]
            wait_all([*learner.send_weights(), *received])
            for worker in workers:
                assert ray.get(worker.policy_version.remote()) == manifest.version
                _assert_bitwise(worker, learner)
    finally:
        ray.get([rank.__ray_call__.remote(_use_object_store) for rank in learner.ranks])
        for worker in workers:
            ray.kill(worker)


def _use_collective(rank: Any) -> None:
    rank.publisher.switch(transport="collective", overlap=False)


def _use_object_store(rank: Any) -> None:
    rank.publisher.switch(transport="object_store", overlap=True)
