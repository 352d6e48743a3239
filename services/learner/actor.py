"""A learner rank: a thin Ray shell around `LearnerCore` and its `Publisher`.

It joins its group's process group, builds its core and publisher, and then receives the same
calls as every other rank of the group (`services.learner.group.LearnerGroup` fans them out).
`step` trains and returns the metrics record; `publish(version)` publishes the version the
ranks hold, in a call of its own, so that a step never waits on a publish it does not need.
Ranks other than 0 return an empty record, and rank 0 alone answers `offer(version)`. What a
publish does, over which transport, and how it runs beside the next step is the publisher's
(services/learner/publisher.py); the methods here forward to it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import ray
import torch

from kpo_core.config import AlgorithmConfig
from services.host_memory import release_free_heap
from services.learner.distributed import RankGroup, rendezvous_address
from services.learner.export import export_model
from services.learner.publish import MiB, WeightsRead
from services.learner.publisher import (
    WEIGHT_GROUP_JOIN_TIMEOUT_S,
    WEIGHT_GROUP_TIMEOUT_S,
    Publisher,
)
from services.learner.step import LearnerCore
from services.messages import ScoredGroup
from services.spec import LearnerConfig
from services.weights.base import WeightGroup, WeightsOffer, WeightTransportName

# A rank that waits this long for the others in a collective gives up (the driver notices a
# dead rank at once and stops the group; this bounds what a lost network would cost).
COLLECTIVE_TIMEOUT_S = 1800.0
# Every this many steps each rank hands its freed heap back to the OS (services/host_memory.py:
# without it, the demo's learner grew ~340 MiB per 1,000 steps, mostly memory no longer used).
HEAP_TRIM_EVERY_STEPS = 10
# The concurrency groups of an actor of `LearnerImpl` (or a subclass): `offer`'s thread, and
# the thread of `send` and `cancel_send` (a send waits for its broadcast; an offer must not wait
# behind it), and `dense_offer`'s (a worker's dense resend must not wait behind a step).
CONCURRENCY_GROUPS = {"publish": 1, "send": 1, "dense": 1}


class LearnerImpl:
    """One rank's actor logic. `Learner` is this class as a Ray actor class."""

    def __init__(
        self,
        model_path: str,
        learner: LearnerConfig,
        algorithm: AlgorithmConfig,
        temperature: float,
        seed: int,
        rank: int = 0,
        ratio_dir: str | None = None,
        *,
        weight_transport: WeightTransportName = "object_store",
        weight_bucket_mb: int = 256,
        overlap_publish: bool = False,
        publish_in_flight: int = 1,
        weight_delta: bool = False,
    ) -> None:
        """Remember the settings; `setup` joins the group and loads the model.

        `weight_transport` and `weight_bucket_mb` are the run's `pipeline` settings of the same
        names (how each version reaches generation); `overlap_publish`, whether a publish runs
        while the next step trains (`RunSpec.overlaps_publish` decides: an async run);
        `publish_in_flight`, the sharded publishes whose host copies may be held at once;
        `weight_delta`, whether a publish sends what changed since the last (`pipeline.
        weight_delta`, services/weights/delta.py).
        """
        if weight_transport not in ("object_store", "collective"):
            raise ValueError(f"unknown weight_transport {weight_transport!r}")
        if weight_bucket_mb < 1:
            raise ValueError(f"weight_bucket_mb must be >= 1, got {weight_bucket_mb}")
        torch.manual_seed(seed)
        self._args = (model_path, learner, algorithm, temperature, seed, ratio_dir)
        self._group = RankGroup(rank, learner.world_size)
        self._core: LearnerCore | None = None
        self._publisher: Publisher | None = None
        self._publishing = (
            weight_transport,
            weight_bucket_mb * MiB,
            overlap_publish,
            publish_in_flight,
            weight_delta,
        )
        self._last_step_end: float | None = None

    def rendezvous_address(self) -> str:
        """Where the group meets (asked of rank 0)."""
        return rendezvous_address()

    def setup(self, address: str, key: bytes = b"") -> None:
        """Join the process group at `address` (`key`: the group's secret, which every rank
        proves it holds) and build the core (a collective under fsdp2) and its publisher,
        whose fences the core's updates wait on."""
        model_path, learner, algorithm, temperature, seed, ratio_dir = self._args
        threads = max(1, int(learner.num_cpus))
        torch.set_num_threads(threads)
        device = torch.device("cuda" if learner.device.startswith("cuda") else "cpu")
        self._group.join(address, device, COLLECTIVE_TIMEOUT_S, key)
        fences = WeightsRead()
        self._core = LearnerCore(
            model_path,
            learner,
            algorithm,
            temperature,
            seed,
            None,
            ratio_dir,
            self._group,
            before_update=fences.wait,
        )
        transport, bucket_bytes, overlap, in_flight, delta = self._publishing
        self._publisher = Publisher(
            self._core, fences, self._group, transport, bucket_bytes, overlap, in_flight, delta
        )

    @property
    def core(self) -> LearnerCore:
        if self._core is None:
            raise RuntimeError("the learner rank is not set up: call setup first")
        return self._core

    @property
    def publisher(self) -> Publisher:
        if self._publisher is None:
            raise RuntimeError("the learner rank is not set up: call setup first")
        return self._publisher

    def version(self) -> int:
        """Policy version of the current weights (completed steps)."""
        return self.core.version

    def pid(self) -> int:
        """Process id of the actor (for tests and for killing a stuck learner)."""
        return os.getpid()

    def publish(self, version: int, send: bool = False) -> None:
        """Publish `version`, the version held; `send`: arm its collective send
        (`Publisher.publish`)."""
        self.publisher.publish(version, send)

    @ray.method(concurrency_group="send")
    def send(self, version: int) -> None:
        """Broadcast the armed `version` now (the driver is calling the receivers); returns
        once it is sent (rank 0)."""
        self.publisher.decide(version, go=True).result()

    @ray.method(concurrency_group="send")
    def cancel_send(self, version: int) -> None:
        """Drop the armed send of `version` (its group broke); returns once the publish thread
        let go of it."""
        self.publisher.decide(version, go=False).exception()

    @ray.method(concurrency_group="dense")
    def dense_offer(self, at_least: int = 0) -> WeightsOffer:
        """The last published version whole (delta publishes, rank 0), for a worker that
        cannot apply a delta (it missed a version, is new, or a patch failed its digest); on
        a thread of its own, beside the next step and the publishes."""
        return self.publisher.dense_offer(at_least)

    @ray.method(concurrency_group="publish")
    def offer(self, version: int) -> WeightsOffer | None:
        """The offer of `version` once its publish is done (rank 0; None elsewhere); runs on a
        thread of its own, beside the next step (it may be called before `publish` ran)."""
        return self.publisher.offer(version)

    def step(self, groups: list[ScoredGroup]) -> dict[str, float]:
        """One learner step: its metrics record (rank 0's; {} elsewhere), with the time the
        learner waited since its previous step (`learner_idle_seconds`). Publishing the new
        version is `publish`'s."""
        started = time.monotonic()
        metrics = self.core.train_step(groups)
        if self._last_step_end is not None:
            metrics["learner_idle_seconds"] = started - self._last_step_end
        metrics.update(self.publisher.publish_figures())  # the version before's publish
        self._last_step_end = time.monotonic()
        if self.core.version % HEAP_TRIM_EVERY_STEPS == 0:
            release_free_heap()
        return metrics if self._group.rank == 0 else {}

    def _rank_zero(self, what: str) -> None:
        if self._group.rank != 0:
            raise RuntimeError(f"{what} runs on learner rank 0, not rank {self._group.rank}")

    def open_weight_group(
        self,
        world_size: int,
        generation: int,
        timeout_s: float = WEIGHT_GROUP_TIMEOUT_S,
        join_timeout_s: float = WEIGHT_GROUP_JOIN_TIMEOUT_S,
    ) -> WeightGroup:
        """Serve a new weight group of `world_size` ranks, replacing any earlier one; return
        at once with where it meets (rank 0; `Publisher.open_weight_group`)."""
        self._rank_zero("open_weight_group")
        return self.publisher.open_weight_group(world_size, generation, timeout_s, join_timeout_s)

    def connect_weight_group(self, group: WeightGroup) -> None:
        """Join `group` as its rank 0; blocks until every receiver has joined (rank 0)."""
        self._rank_zero("connect_weight_group")
        self.publisher.connect_weight_group(group)

    def send_weights(self) -> None:
        """Broadcast the current version to the weight group (every rank gathers, rank 0
        sends)."""
        self.publisher.send_weights()

    def published_state_dict(self) -> dict[str, torch.Tensor]:
        """The current version's whole published state dict (rank 0's; every rank takes part).
        For checks: publishing streams buckets instead."""
        return self.core.state_dict_for_publish()

    def save_checkpoint(self, path: str) -> str:
        """Write this rank's part of the checkpoint directory at `path`; return its path."""
        return str(self.core.save_checkpoint(path))

    def load_checkpoint(self, path: str) -> int:
        """Restore a checkpoint written by `save_checkpoint`; return its version."""
        return self.core.load_checkpoint(Path(path))

    def export(self, learner_dir: str, out_dir: str) -> str:
        """Write the Hugging Face model of a checkpoint to `out_dir` (run on rank 0 alone: it
        reads the checkpoint from disk, whatever the group's sharding)."""
        return str(export_model(Path(learner_dir), Path(out_dir)))


# Applied as a call, not as a class decorator, so that type checkers see an actor class
# (`.remote`, `.options`) rather than the plain class. `offer` answers from a thread of its
# own while the default thread trains.
Learner = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(LearnerImpl)  # type: ignore[call-overload]
