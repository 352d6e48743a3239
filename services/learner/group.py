"""The learner group as the driver sees it: W rank actors that answer as one learner.

The ranks are placed through a Ray placement group (one bundle per rank: its CPUs, GPUs and
custom resources such as `learner_gpu`, packed onto as few nodes as fit), rank 0 serves the
rendezvous, and every call goes to every rank with the same arguments. The driver gets rank 0's
result refs, plus the other ranks' refs to watch: a rank that dies fails its ref at once, while
the ranks still alive would wait in a collective for it, so the driver treats any failed ref as
the learner's death and stops the whole group.

A `single` learner is a group of one rank without a placement group.

Weights (`spec.pipeline.weight_transport`, see services.learner.actor): a publish is every
rank's `publish(version)` and rank 0's `offer(version)`, whose ref is the `WeightsOffer`; with
`overlaps_publish` the offer comes while the next step trains. With `collective`, the driver
also forms the weight group through rank 0 (`open_weight_group`, `connect_weight_group`) and
has every rank `send_weights` while the generation workers receive; with `overlaps_publish`, a
publish arms its send instead, which the driver starts with `send(version)` while the workers
receive, or drops with `cancel_send(version)`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from services.learner.actor import Learner
from services.messages import ScoredGroup
from services.spec import RunSpec
from services.weights.auth import new_key

log = logging.getLogger(__name__)


class LearnerRanksSilent(RuntimeError):
    """Learner ranks that did not answer a call within its deadline."""

    def __init__(self, what: str, ranks: list[int], timeout_s: float) -> None:
        self.ranks = ranks
        names = ", ".join(str(rank) for rank in ranks)
        super().__init__(
            f"learner rank{'s' if len(ranks) > 1 else ''} {names} did not answer {what} "
            f"within {timeout_s:g} s (hung, or waiting in a collective for a rank that is)"
        )


def wait_all(refs: list[Any], timeout_s: float | None = None, what: str = "") -> list[Any]:
    """The results of `refs` (one per rank, in rank order); the first failure is raised as soon
    as it happens (`ray.get(refs)` would first wait on a rank stuck in a collective with a dead
    one). With `timeout_s`, ranks still silent at the deadline raise LearnerRanksSilent."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            assert deadline is not None and timeout_s is not None  # only a timeout is empty
            if time.monotonic() < deadline:
                continue  # ray's timer woke a little early: the ranks get their whole deadline
            silent = [rank for rank, ref in enumerate(refs) if ref in pending]
            raise LearnerRanksSilent(what or "the call", silent, timeout_s)
        ray.get(ready)
    return list(ray.get(refs))


@dataclass(frozen=True)
class StepRefs:
    """Refs of one learner step: rank 0's record, and the other ranks' results (an empty
    record each)."""

    metrics: Any
    peers: list[Any]


@dataclass(frozen=True)
class PublishRefs:
    """Refs of one publish: rank 0's WeightsOffer (an object_store offer carries its bucket
    refs; a collective one the manifest alone), and every rank's `publish` (None each)."""

    offer: Any
    peers: list[Any]


class LearnerGroup:
    """Start the ranks of `spec.learner` and fan every call out to them."""

    def __init__(self, spec: RunSpec, model_path: str, ratio_dir: str | None = None) -> None:
        learner = spec.learner
        self.sharded = learner.strategy == "fsdp2"
        bundle = {"CPU": learner.num_cpus, **learner.resources}
        if learner.num_gpus:
            bundle["GPU"] = learner.num_gpus
        self.placement: PlacementGroup | None = None
        if learner.world_size > 1:
            self.placement = placement_group([dict(bundle)] * learner.world_size, "PACK")
        self.ranks: list[Any] = []
        self.resume_timeout_s = learner.resume_timeout_s
        self.overlaps_publish = spec.overlaps_publish
        # KPO's `reference_length: auto` is the run's response limit (`LearnerCore` checks).
        algorithm = spec.algorithm.with_response_length(spec.generation.max_new_tokens)
        for rank in range(learner.world_size):
            options: dict[str, Any] = {
                "num_cpus": learner.num_cpus,
                "num_gpus": learner.num_gpus,
                "resources": dict(learner.resources),
            }
            if self.placement is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=rank
                )
            args = (model_path, learner, algorithm, spec.generation.temperature, spec.seed)
            self.ranks.append(
                Learner.options(**options).remote(
                    *args,
                    rank,
                    ratio_dir,
                    weight_transport=spec.pipeline.weight_transport,
                    weight_bucket_mb=spec.pipeline.weight_bucket_mb,
                    overlap_publish=self.overlaps_publish,
                    publish_in_flight=spec.pipeline.publish_in_flight,
                    weight_delta=spec.pipeline.weight_delta == "auto",
                )
            )

    def setup(self) -> list[Any]:
        """Refs of every rank joining the group and loading the model (wait for them)."""
        address, key = "", b""
        if self.sharded:
            address = ray.get(self.ranks[0].rendezvous_address.remote())
            key = new_key()  # the group's secret: to every rank through Ray, never the store
        return [rank.setup.remote(address, key) for rank in self.ranks]

    def _all(self, method: str, *args: Any) -> list[Any]:
        return [getattr(rank, method).remote(*args) for rank in self.ranks]

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Call `method` on every rank, wait for all (at most `timeout_s`: then
        LearnerRanksSilent names the ranks that did not answer), return rank 0's result."""
        return wait_all(self._all(method, *args), timeout_s, method)[0]

    def train_step(self, batch: list[ScoredGroup]) -> StepRefs:
        """One step on every rank (the batch is put into the object store once); it trains
        and does not publish (`publish`)."""
        refs = self._all("step", ray.put(batch))
        return StepRefs(refs[0], refs[1:])

    def publish(self, version: int, send: bool = False) -> PublishRefs:
        """Publish `version`, the one the ranks hold (every rank takes part in gathering).
        `send` (collective, `overlaps_publish`): also arm its send to the weight group, which
        the caller must then start (`send`) or drop (`cancel_send`)."""
        refs = self._all("publish", version, send)
        return PublishRefs(self.ranks[0].offer.remote(version), refs)

    def send(self, version: int) -> Any:
        """Ref that resolves once the armed `version` is broadcast (call the receivers with
        it); it fails if a receiver died (the group is closed then: form another)."""
        return self.ranks[0].send.remote(version)

    def cancel_send(self, version: int) -> Any:
        """Ref that resolves once the armed send of `version` is dropped, nothing sent."""
        return self.ranks[0].cancel_send.remote(version)

    def open_weight_group(self, world_size: int, generation: int) -> Any:
        """Ref of the WeightGroup rank 0 serves for `world_size` ranks (itself and every
        receiving process); returns at once, any earlier group is closed."""
        return self.ranks[0].open_weight_group.remote(world_size, generation)

    def connect_weight_group(self, group: Any) -> Any:
        """Ref that resolves once rank 0 and every receiver have joined `group` (the receivers
        join at the same time, or this waits until the group's timeout and fails)."""
        return self.ranks[0].connect_weight_group.remote(group)

    def send_weights(self) -> list[Any]:
        """Refs (rank order) of every rank sending the current version to the weight group;
        wait for them all (`wait_all`) while the workers receive. If a receiver died, rank 0's
        fails (WeightGroupError) once every rank is done: the learner stays usable, and the
        group is closed (open a new one)."""
        return self._all("send_weights")

    def save_checkpoint(self, path: str) -> Callable[[], None]:
        """Start every rank writing its part of a checkpoint into `path`; returns what waits
        for them (the calls are made now, in order with the caller's other calls to the ranks,
        whatever thread then waits)."""
        refs = self._all("save_checkpoint", path)

        def wait() -> None:
            wait_all(refs, None, "save_checkpoint")

        return wait

    def load_checkpoint(self, path: str) -> int:
        version: int = self.call("load_checkpoint", path, timeout_s=self.resume_timeout_s)
        return version

    def export(self, learner_dir: str, out_dir: str) -> str:
        path: str = ray.get(self.ranks[0].export.remote(learner_dir, out_dir))
        return path

    def pids(self) -> list[int]:
        return list(ray.get([rank.pid.remote() for rank in self.ranks]))

    def kill(self) -> None:
        """Stop every rank now (no restart) and free the placement group."""
        for rank in self.ranks:
            try:
                ray.kill(rank, no_restart=True)
            except Exception as error:  # a rank that is already gone is what we want
                log.debug("kill %s: %s", rank, error)
        if self.placement is not None:
            try:
                remove_placement_group(self.placement)
            except Exception as error:  # the cluster may be going away with it
                log.debug("remove placement group: %s", error)
            self.placement = None
