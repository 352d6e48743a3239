"""Publishing from a learner group on a real local Ray instance, through both transports.

The receivers are plain Ray actors holding the tiny model (what a generation worker does with
the weights is its own test's business): after each publish their weights must equal the
learner's, bitwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError
from torch import Tensor
from transformers import AutoModelForCausalLM

from services.learner.group import LearnerGroup, wait_all
from services.messages import ScoredGroup
from services.spec import LearnerConfig, PipelineConfig, RunSpec
from services.weights.base import (
    Channel,
    WeightGroup,
    WeightsManifest,
    WeightsOffer,
    WeightTransportName,
)
from services.weights.collective import connect
from services.weights.loading import load_buckets_into
from services.weights.object_store import fetch_buckets

pytestmark = pytest.mark.usefixtures("ray_instance")


class ReceiverImpl:
    """A model that takes published weights, as a generation worker's backend does."""

    def __init__(self, model_dir: str) -> None:
        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.channel: Channel | None = None

    def fetch(self, wrapped: list[WeightsOffer]) -> int:
        offer = wrapped[0]
        load_buckets_into(self.model, fetch_buckets(offer), offer.manifest)
        return offer.manifest.version

    def join(self, group: WeightGroup, rank: int) -> None:
        self.channel = connect(group, rank, timeout_s=60)

    def receive(self, manifest: WeightsManifest) -> int:
        assert self.channel is not None
        load_buckets_into(self.model, self.channel.receive(manifest), manifest)
        return manifest.version

    def weights(self) -> dict[str, Tensor]:
        return {name: tensor.clone() for name, tensor in self.model.state_dict().items()}


Receiver = ray.remote(num_cpus=0.25)(ReceiverImpl)


def start_learner(
    model_dir: Path, transport: WeightTransportName, world_size: int = 1
) -> LearnerGroup:
    strategy = "single" if world_size == 1 else "fsdp2"
    spec = RunSpec(
        learner=LearnerConfig(lr=1e-2, num_cpus=0.5, strategy=strategy, world_size=world_size),
        # Whole buckets: delta publishes have their own tests (test_delta_publish.py).
        pipeline=PipelineConfig(weight_transport=transport, weight_bucket_mb=1, weight_delta="off"),
    )
    group = LearnerGroup(spec, str(model_dir))
    wait_all(group.setup())
    return group


@pytest.fixture(scope="module")
def receivers(tiny_model_dir: Path, ray_instance: None) -> Iterator[list[Any]]:
    actors: list[Any] = [Receiver.remote(str(tiny_model_dir)) for _ in range(2)]
    yield actors
    for actor in actors:
        ray.kill(actor)


def assert_same(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_object_store_offers_reach_a_worker_bitwise(
    tiny_model_dir: Path, groups: list[ScoredGroup], receivers: list[Any]
) -> None:
    learner = start_learner(tiny_model_dir, "object_store")
    try:
        initial: WeightsOffer = ray.get(learner.publish(0).offer)
        assert initial.transport == "object_store" and initial.manifest.version == 0
        assert len(initial.bucket_refs) == len(initial.manifest.buckets)
        before = ray.get(receivers[0].weights.remote())

        refs = learner.train_step(groups)
        assert ray.get(refs.metrics)["policy_version"] == 1.0
        # A publish is a call of its own, of the version the learner holds.
        with pytest.raises(
            RayTaskError, match="publish of version 2, but the learner holds version 1"
        ):
            ray.get(learner.publish(2).offer)
        offer: WeightsOffer = ray.get(learner.publish(1).offer)
        assert offer.manifest.version == 1
        # Wrapped in a list, as the driver does: the worker gets the refs, not the buckets.
        assert ray.get(receivers[0].fetch.remote([offer])) == 1
        got = ray.get(receivers[0].weights.remote())
        assert_same(got, learner.call("published_state_dict"))
        assert any(not torch.equal(got[name], before[name]) for name in got)
    finally:
        learner.kill()


def test_an_overlapped_publish_reaches_a_worker_bitwise_while_the_next_step_trains(
    tiny_model_dir: Path, groups: list[ScoredGroup], receivers: list[Any]
) -> None:
    """The next step is sent before the offer is asked for: the offer is still of the version
    published, bit for bit, and the step trained on (publish and step in one actor)."""
    learner = start_learner(tiny_model_dir, "object_store")
    assert learner.overlaps_publish
    try:
        ray.get(learner.train_step(groups).metrics)
        published = learner.publish(1)
        version_one = learner.call("published_state_dict")  # before the next step, in order
        next_step = learner.train_step(groups)
        offer: WeightsOffer = ray.get(published.offer)
        assert wait_all(published.peers) == [None]
        record = ray.get(next_step.metrics)
        assert record["policy_version"] == 2.0 and record["learner_idle_seconds"] >= 0
        assert offer.manifest.version == 1
        assert ray.get(receivers[1].fetch.remote([offer])) == 1
        assert_same(ray.get(receivers[1].weights.remote()), version_one)
        version_two = learner.call("published_state_dict")
        assert any(not torch.equal(version_two[n], version_one[n]) for n in version_one)
    finally:
        learner.kill()


def test_collective_publishes_reach_workers_and_survive_a_dead_one(
    tiny_model_dir: Path, groups: list[ScoredGroup], receivers: list[Any]
) -> None:
    learner = start_learner(tiny_model_dir, "collective")
    first, second = receivers
    try:
        weights = ray.get(learner.open_weight_group(3, 1))
        assert weights.backend == "gloo" and weights.world_size == 3
        joined = [first.join.remote(weights, 1), second.join.remote(weights, 2)]
        wait_all([learner.connect_weight_group(weights), *joined])

        ray.get(learner.train_step(groups).metrics)
        offer: WeightsOffer = ray.get(learner.publish(1).offer)
        assert offer.transport == "collective" and offer.bucket_refs == ()
        assert offer.manifest.version == 1
        received = [r.receive.remote(offer.manifest) for r in (first, second)]
        wait_all([*learner.send_weights(), *received])
        published = learner.call("published_state_dict")
        for receiver in (first, second):
            assert_same(ray.get(receiver.weights.remote()), published)

        # A worker dies: the next send fails, naming the group; the learner lives on.
        ray.kill(second)
        receiving = first.receive.remote(offer.manifest)
        with pytest.raises(RayTaskError, match=r"weight group .*\(generation 1\), rank 0"):
            wait_all(learner.send_weights())
        with pytest.raises((RayTaskError, RayActorError)):
            ray.get(receiving)
        assert learner.call("version") == 1

        # A re-formed group (a new generation) of the surviving worker works.
        weights = ray.get(learner.open_weight_group(2, 2))
        wait_all([learner.connect_weight_group(weights), first.join.remote(weights, 1)])
        wait_all([*learner.send_weights(), first.receive.remote(offer.manifest)])
        assert_same(ray.get(first.weights.remote()), published)
    finally:
        learner.kill()


@pytest.mark.parametrize("world_size", [1, 2], ids=["single", "fsdp2-2-ranks"])
def test_an_armed_collective_send_broadcasts_its_version_while_the_next_step_trains(
    tiny_model_dir: Path, groups: list[ScoredGroup], world_size: int
) -> None:
    """The next step is sent before the send starts: one rank trains up to its update, which
    waits until the broadcast has read the weights; FSDP2 ranks gathered before the step. The
    receivers get version 1 bit for bit. A cancelled send lets the step after it go on; a send
    to a dead receiver fails, naming the group, and the learner lives on."""
    learner = start_learner(tiny_model_dir, "collective", world_size)
    assert learner.overlaps_publish
    first, second = (Receiver.remote(str(tiny_model_dir)) for _ in range(2))
    try:
        weights = ray.get(learner.open_weight_group(3, 3))
        joined = [first.join.remote(weights, 1), second.join.remote(weights, 2)]
        wait_all([learner.connect_weight_group(weights), *joined])
        ray.get(learner.train_step(groups).metrics)

        published = learner.publish(1, send=True)
        offer: WeightsOffer = ray.get(published.offer)
        assert offer.transport == "collective" and offer.manifest.version == 1
        version_one = learner.call("published_state_dict")  # before the next step, in order
        next_step = learner.train_step(groups)
        received = [r.receive.remote(offer.manifest) for r in (first, second)]
        wait_all([learner.send(1), *received, *published.peers])
        assert ray.get(next_step.metrics)["policy_version"] == 2.0
        for receiver in (first, second):
            assert_same(ray.get(receiver.weights.remote()), version_one)

        # Cancelled (its group broke before it started): nothing is sent, the learner steps on.
        ray.get(learner.publish(2, send=True).offer)
        ray.get(learner.cancel_send(2))
        assert ray.get(learner.train_step(groups).metrics)["policy_version"] == 3.0
        with pytest.raises(RayTaskError, match="no send of version 2 is armed"):
            ray.get(learner.send(2))

        # A receiver dies: the armed send fails, naming the group; the learner steps on.
        ray.kill(second)
        third: WeightsOffer = ray.get(learner.publish(3, send=True).offer)
        receiving = first.receive.remote(third.manifest)
        with pytest.raises(RayTaskError, match=r"weight group .*\(generation 3\), rank 0"):
            ray.get(learner.send(3))
        with pytest.raises((RayTaskError, RayActorError)):
            ray.get(receiving)
        assert ray.get(learner.train_step(groups).metrics)["policy_version"] == 4.0
    finally:
        learner.kill()
        ray.kill(first)
