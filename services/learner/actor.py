"""A learner rank: a thin Ray shell around `LearnerCore`.

It joins its group's process group, builds its core, and then receives the same calls as every
other rank of the group (`services.learner.group.LearnerGroup` fans them out). `step` trains
and returns the metrics record; `publish(version)` returns the offer of the version the ranks
hold, in a call of its own, so that a step never waits on a publish it does not need. Ranks
other than 0 return an empty record, and rank 0 alone answers `offer(version)`.

Publishing a version (`pipeline.weight_transport`, services/weights): every rank walks the
same bucket plan, gathering FSDP2 shards tensor by tensor, and rank 0 hands each bucket on
before gathering the next (services.learner.publish).

- `object_store`: rank 0 puts each bucket into Ray's object store as it is gathered, and the
  offer carries the refs. Rank 0 owns those objects, so they die with it; that costs nothing,
  since a dead learner fails the step's attempt and the restarted one publishes its weights
  again. With `overlap_publish`, `publish` only starts the publish: a thread of the actor
  reads and puts the buckets while the next step trains, whose first update waits until the
  weights are read (services.learner.publish; a sharded learner gathers first, with its peers,
  and the thread only puts); `offer`, in a concurrency group of its own, answers once the
  buckets are in. A publish waits for the previous one's offer (an armed send's is answered
  once it is armed, so two sends may be in flight); each publication reads under a fence of its
  own (`publish.Fence`), so the late end of one can never free the next one's update.
- `collective`: the offer is the manifest alone. Rank 0 serves the weight group
  (`open_weight_group`), waits for the receivers (`connect_weight_group`), and `send_weights`
  (called on every rank) broadcasts the current version bucket by bucket. With
  `overlap_publish`, `publish(version, send=True)` arms the send of that version at once,
  between two steps, and the publish thread broadcasts it while the next step trains (one
  rank: it reads the weights then; sharded: the ranks gather before the next step and rank 0's
  thread broadcasts the buckets as they come), but only once the driver called
  `send(version)` (the receivers are being called then) or `cancel_send(version)` (the group
  broke meanwhile: nothing is sent, the version is sent later with `send_weights`). Until then
  a one-rank learner's next update waits, so a driver must decide every armed send.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue

import ray
import torch

from kpo_core.config import AlgorithmConfig
from services.host_memory import release_free_heap
from services.learner.distributed import RankGroup, rendezvous_address
from services.learner.export import export_model
from services.learner.publish import Fence, Handed, MiB, drain, handed_buckets, publish_point
from services.learner.step import LearnerCore
from services.messages import ScoredGroup
from services.spec import LearnerConfig
from services.weights import collective
from services.weights.base import (
    Channel,
    WeightGroup,
    WeightGroupBackend,
    WeightGroupError,
    WeightsManifest,
    WeightsOffer,
    WeightTransportName,
)
from services.weights.object_store import put_buckets

# A rank that waits this long for the others in a collective gives up (the driver notices a
# dead rank at once and stops the group; this bounds what a lost network would cost).
COLLECTIVE_TIMEOUT_S = 1800.0
# Every this many steps each rank hands its freed heap back to the OS (services/host_memory.py:
# without it, the demo's learner grew ~340 MiB per 1,000 steps, mostly memory no longer used).
HEAP_TRIM_EVERY_STEPS = 10
# A weight-group collective that waits this long raises: a receiver that died fails the publish
# instead of holding the learner forever (long: a broadcast of a multi-GB bucket is legitimate).
WEIGHT_GROUP_TIMEOUT_S = 600.0
# Joining a weight group has its own, shorter deadline: a receiver that died or never came while
# the group formed holds learner rank 0 (no step taken) this long at most. collective.py owns it.
WEIGHT_GROUP_JOIN_TIMEOUT_S = collective.DEFAULT_JOIN_TIMEOUT_S
# The concurrency groups of an actor of `LearnerImpl` (or a subclass): `offer`'s thread, and
# the thread of `send` and `cancel_send` (a send waits for its broadcast; an offer must not wait
# behind it).
CONCURRENCY_GROUPS = {"publish": 1, "send": 1}


class SendCancelled(RuntimeError):
    """An armed send that the driver cancelled: nothing of it was broadcast."""


@dataclass(frozen=True)
class _ArmedSend:
    """A collective send armed by `publish`: the driver's decision (send or not), and the
    publish thread's job that waits for it."""

    decision: Future[bool]
    job: Future[None]


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
    ) -> None:
        """Remember the settings; `setup` joins the group and loads the model.

        `weight_transport` and `weight_bucket_mb` are the run's `pipeline` settings of the same
        names (how each version reaches generation); `overlap_publish`, whether a publish runs
        while the next step trains (`RunSpec.overlaps_publish` decides: an async run).
        """
        if weight_transport not in ("object_store", "collective"):
            raise ValueError(f"unknown weight_transport {weight_transport!r}")
        if weight_bucket_mb < 1:
            raise ValueError(f"weight_bucket_mb must be >= 1, got {weight_bucket_mb}")
        torch.manual_seed(seed)
        self._args = (model_path, learner, algorithm, temperature, seed, ratio_dir)
        self._group = RankGroup(rank, learner.world_size)
        self._core: LearnerCore | None = None
        self._transport: WeightTransportName = weight_transport
        self._bucket_bytes = weight_bucket_mb * MiB
        # The weight group and rank 0's channel into it: formed and closed by the default
        # thread, sent on (and closed on failure) by the publish thread, so read and replaced
        # under `_group_lock` (never held during a send).
        self._channel: Channel | None = None
        self._weight_group: WeightGroup | None = None
        self._group_lock = threading.Lock()
        self._weight_timeout_s = WEIGHT_GROUP_TIMEOUT_S
        self._weight_join_timeout_s = WEIGHT_GROUP_JOIN_TIMEOUT_S
        self._sharded = learner.strategy != "single"
        self._publisher = ThreadPoolExecutor(1, "publish") if overlap_publish else None
        # version -> its publish's offer, from `publish`'s start until `offer` answered.
        self._offers: dict[int, Future[WeightsOffer | None]] = {}
        # version -> its armed collective send, until `send` or `cancel_send` ended it.
        self._armed: dict[int, _ArmedSend] = {}
        self._offers_changed = threading.Condition()
        self._last_step_end: float | None = None

    def rendezvous_address(self) -> str:
        """Where the group meets (asked of rank 0)."""
        return rendezvous_address()

    def setup(self, address: str) -> None:
        """Join the process group at `address` and build the core (a collective under fsdp2)."""
        model_path, learner, algorithm, temperature, seed, ratio_dir = self._args
        threads = max(1, int(learner.num_cpus))
        torch.set_num_threads(threads)
        device = torch.device("cuda" if learner.device.startswith("cuda") else "cpu")
        self._group.join(address, device, COLLECTIVE_TIMEOUT_S)
        self._core = LearnerCore(
            model_path, learner, algorithm, temperature, seed, None, ratio_dir, self._group
        )

    @property
    def core(self) -> LearnerCore:
        if self._core is None:
            raise RuntimeError("the learner rank is not set up: call setup first")
        return self._core

    def version(self) -> int:
        """Policy version of the current weights (completed steps)."""
        return self.core.version

    def pid(self) -> int:
        """Process id of the actor (for tests and for killing a stuck learner)."""
        return os.getpid()

    def publish(self, version: int, send: bool = False) -> None:
        """Publish `version`, which must be the version held (a publish of another would hand
        out weights under a wrong number); every rank takes part, rank 0's `offer(version)`
        answers with it. Overlapped (module doc), this returns once the publish has started;
        `send` (collective, overlapped): also arm the send of `version` to the weight group."""
        offer: Future[WeightsOffer | None] = Future()
        earlier: list[Future[WeightsOffer | None]] = []
        if self._group.rank == 0:  # the others' part ends with this call, and nobody asks them
            with self._offers_changed:
                earlier = list(self._offers.values())
                self._offers[version] = offer
                self._offers_changed.notify_all()
        try:
            for previous in earlier:
                previous.exception()  # the previous publish's offer (an armed send's: armed)
            if version != self.core.version:
                raise RuntimeError(
                    f"publish of version {version}, but the learner holds version "
                    f"{self.core.version}"
                )
            if send and (self._publisher is None or self._transport != "collective"):
                raise ValueError("publish(send=True) needs an overlapped collective publish")
            if self._publisher is None or (self._transport == "collective" and not send):
                offer.set_result(self._publish())
                return
            if send:
                self._publish_armed(offer)
                return
            if self._sharded:
                self._put_gathered(offer)
                return
            fence = self.core.weights_read.arm()
            after = publish_point(self.core.device)
        except Exception as error:
            if not offer.done():  # a sharded publish's put may have failed first
                offer.set_exception(error)
            raise
        running = self._publisher.submit(self._put_overlapped, fence, after)
        running.add_done_callback(lambda done: _settle(offer, done))

    def _publish_gathered(
        self,
        offer: Future[WeightsOffer | None],
        manifest: WeightsManifest,
        start: Callable[[Iterator[dict[str, torch.Tensor]]], None],
    ) -> None:
        """A sharded overlapped publish (services.learner.publish): every rank gathers here,
        with the others; rank 0 `start`s the publish thread's part on its buckets as they are
        handed over (on the host: pinned under a GPU, by copies the host does not wait for)."""
        cuda = self.core.device.type == "cuda"
        buckets = self.core.weight_buckets(manifest, "cpu", pinned=cuda)
        if self._group.rank != 0:
            drain(buckets)
            offer.set_result(None)
            return
        handed: SimpleQueue[Handed] = SimpleQueue()
        start(handed_buckets(handed))
        try:
            for bucket in buckets:
                handed.put((bucket, publish_point(self.core.device)))
                del bucket
        finally:
            handed.put(None)  # a gather that failed leaves the publish short: it fails

    def _put_gathered(self, offer: Future[WeightsOffer | None]) -> None:
        """A sharded overlapped publish over object_store: the publish thread puts the buckets
        while the next step trains."""
        assert self._publisher is not None
        publisher = self._publisher
        manifest = self.core.weights_manifest(self._bucket_bytes)

        def put(buckets: Iterator[dict[str, torch.Tensor]]) -> None:
            running = publisher.submit(put_buckets, manifest, buckets)
            running.add_done_callback(lambda done: _settle(offer, done))

        self._publish_gathered(offer, manifest, put)

    def _publish_armed(self, offer: Future[WeightsOffer | None]) -> None:
        """A collective publish that arms its send (module doc). One rank: the publish thread
        reads the weights once the send starts, and the next update waits until it has. Sharded:
        every rank gathers here and rank 0's publish thread broadcasts the buckets as they come
        once the send starts. The offer is answered once the send is armed: the driver may
        start it at once."""
        manifest = self.core.weights_manifest(self._bucket_bytes)
        published = WeightsOffer("collective", manifest) if self._group.rank == 0 else None
        if self._sharded:

            def arm(buckets: Iterator[dict[str, torch.Tensor]]) -> None:
                self._arm_send(manifest, lambda: buckets, None)
                offer.set_result(published)

            self._publish_gathered(offer, manifest, arm)
            return
        fence = self.core.weights_read.arm()
        after = publish_point(self.core.device)
        device = self._weight_device()
        self._arm_send(
            manifest,
            lambda: self.core.overlapped_weight_buckets(manifest, fence, after, device),
            fence,
        )
        offer.set_result(published)

    def _arm_send(
        self,
        manifest: WeightsManifest,
        buckets: Callable[[], Iterator[dict[str, torch.Tensor]]],
        fence: Fence | None,
    ) -> None:
        """Arm the send of `manifest`'s version, the one held: the publish thread broadcasts
        `buckets()` once the driver starts it (`send`), or drops it (`cancel_send`); `fence`:
        the publication's own, which a one-rank send reads the live weights under."""
        assert self._publisher is not None
        decision: Future[bool] = Future()
        job = self._publisher.submit(self._send_armed, decision, manifest, buckets, fence)
        with self._offers_changed:
            self._armed[manifest.version] = _ArmedSend(decision, job)

    def _send_armed(
        self,
        decision: Future[bool],
        manifest: WeightsManifest,
        buckets: Callable[[], Iterator[dict[str, torch.Tensor]]],
        fence: Fence | None,
    ) -> None:
        """The publish thread's part of an armed send: once the driver said go, broadcast the
        buckets while the next step trains (on a GPU from a stream of this thread's own, so
        that the broadcast does not queue behind the step's kernels)."""
        try:
            if not decision.result():
                raise SendCancelled(f"the send of version {manifest.version} was cancelled")
            with self._group_lock:
                channel = self._channel
            if channel is None:
                raise WeightGroupError(
                    f"no weight group to send version {manifest.version} to: the last one failed"
                )
            cuda = self._weight_device().type == "cuda"
            side = torch.cuda.stream(torch.cuda.Stream()) if cuda else nullcontext()  # type: ignore[no-untyped-call]
            try:
                with side:
                    channel.send(manifest, buckets())
            except WeightGroupError:
                self._close_weight_group(channel)  # a receiver died or hung: form another
                raise
        finally:
            if fence is not None:  # a one-rank send's, also when nothing was read: its own
                fence.release()

    @ray.method(concurrency_group="send")
    def send(self, version: int) -> None:
        """Broadcast the armed `version` now (the driver is calling the receivers); returns
        once it is sent (rank 0, module doc)."""
        self._decided(version, go=True).result()

    @ray.method(concurrency_group="send")
    def cancel_send(self, version: int) -> None:
        """Drop the armed send of `version` (its group broke); returns once the publish thread
        let go of it."""
        self._decided(version, go=False).exception()

    def _decided(self, version: int, go: bool) -> Future[None]:
        with self._offers_changed:
            armed = self._armed.pop(version, None)
        if armed is None:
            raise RuntimeError(f"no send of version {version} is armed")
        armed.decision.set_result(go)
        return armed.job

    @ray.method(concurrency_group="publish")
    def offer(self, version: int) -> WeightsOffer | None:
        """The offer of `version` once its publish is done (rank 0; None elsewhere); runs on a
        thread of its own, beside the next step (it may be called before `publish` ran)."""
        with self._offers_changed:
            self._offers_changed.wait_for(lambda: version in self._offers)
            found = self._offers[version]
        try:
            return found.result()
        finally:
            with self._offers_changed:
                self._offers.pop(version, None)

    def _put_overlapped(self, fence: Fence, after: torch.cuda.Event | None) -> WeightsOffer:
        """The publish thread's part: read the weights while the next step trains, then put
        (the version cannot move on before they are read: its update waits for `fence`)."""
        try:
            manifest = self.core.weights_manifest(self._bucket_bytes)
            buckets = self.core.overlapped_weight_buckets(manifest, fence, after)
            return put_buckets(manifest, buckets)
        finally:
            fence.release()  # also when nothing was read (a failed start)

    def step(self, groups: list[ScoredGroup]) -> dict[str, float]:
        """One learner step: its metrics record (rank 0's; {} elsewhere), with the time the
        learner waited since its previous step (`learner_idle_seconds`). Publishing the new
        version is `publish`'s."""
        started = time.monotonic()
        metrics = self.core.train_step(groups)
        if self._last_step_end is not None:
            metrics["learner_idle_seconds"] = started - self._last_step_end
        self._last_step_end = time.monotonic()
        if self.core.version % HEAP_TRIM_EVERY_STEPS == 0:
            release_free_heap()
        return metrics if self._group.rank == 0 else {}

    def _publish(self) -> WeightsOffer | None:
        """The current version's offer (module doc). object_store: every rank gathers, rank 0
        puts; collective: no gathering until `send_weights`."""
        manifest = self.core.weights_manifest(self._bucket_bytes)
        if self._transport == "collective":
            return WeightsOffer("collective", manifest) if self._group.rank == 0 else None
        buckets = self.core.weight_buckets(manifest, "cpu")
        if self._group.rank != 0:
            drain(buckets)
            return None
        return put_buckets(manifest, buckets)

    def _rank_zero(self, what: str) -> None:
        if self._group.rank != 0:
            raise RuntimeError(f"{what} runs on learner rank 0, not rank {self._group.rank}")

    def _weight_device(self) -> torch.device:
        """Where the buckets of a collective publish are assembled: the GPU under NCCL."""
        return self.core.device if self.core.device.type == "cuda" else torch.device("cpu")

    def open_weight_group(
        self,
        world_size: int,
        generation: int,
        timeout_s: float = WEIGHT_GROUP_TIMEOUT_S,
        join_timeout_s: float = WEIGHT_GROUP_JOIN_TIMEOUT_S,
    ) -> WeightGroup:
        """Serve a new weight group of `world_size` ranks (this rank and every receiving
        process), replacing any earlier one; return at once with where it meets (rank 0).
        `join_timeout_s` bounds `connect_weight_group`, `timeout_s` every send after it."""
        self._rank_zero("open_weight_group")
        self._close_weight_group()
        backend: WeightGroupBackend = "nccl" if self._weight_device().type == "cuda" else "gloo"
        group = collective.open_weight_group(world_size, backend, generation, timeout_s=timeout_s)
        with self._group_lock:
            self._weight_group = group
        self._weight_timeout_s = timeout_s
        self._weight_join_timeout_s = join_timeout_s
        return group

    def connect_weight_group(self, group: WeightGroup) -> None:
        """Join `group` as its rank 0; blocks until every receiver has joined, or raises
        `WeightGroupError` naming those that did not after the join deadline (rank 0)."""
        self._rank_zero("connect_weight_group")
        if group != self._weight_group:
            raise ValueError(f"weight group {group} is not the one this learner opened last")
        channel = collective.connect(
            group,
            0,
            timeout_s=self._weight_timeout_s,
            join_timeout_s=self._weight_join_timeout_s,
        )
        with self._group_lock:
            self._channel = channel

    def send_weights(self) -> None:
        """Broadcast the current version to the weight group (every rank gathers, rank 0
        sends). The receivers must be receiving the manifest of this version's offer."""
        manifest = self.core.weights_manifest(self._bucket_bytes)
        buckets = self.core.weight_buckets(manifest, self._weight_device())
        with self._group_lock:
            channel = self._channel
        if channel is None:
            drain(buckets)  # rank 0 too: the other ranks' gathers need it
            if self._group.rank == 0:
                raise RuntimeError("send_weights before connect_weight_group: no weight group")
            return
        try:
            channel.send(manifest, buckets)
        except WeightGroupError:
            # A receiver died or hung: this group is done, but the learner is not. Finishing
            # the walk keeps the other ranks' gathers in step, so the driver can form a new
            # group and send again.
            self._close_weight_group(channel)
            drain(buckets)
            raise

    def published_state_dict(self) -> dict[str, torch.Tensor]:
        """The current version's whole published state dict (rank 0's; every rank takes part).
        For checks: publishing streams buckets instead."""
        return self.core.state_dict_for_publish()

    def _close_weight_group(self, failed: Channel | None = None) -> None:
        """Close the weight group; `failed`: only if that channel is still the group's (a send
        that failed on the publish thread must not close a group formed since)."""
        with self._group_lock:
            if failed is not None and self._channel is not failed:
                return
            channel, group = self._channel, self._weight_group
            self._channel = None
            self._weight_group = None
        if channel is not None:
            channel.close()
        if group is not None:
            collective.stop_serving(group)

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


def _settle(offer: Future[WeightsOffer | None], done: Future[WeightsOffer]) -> None:
    """Hand a finished publish thread's result or error on to `offer` (unless the training
    thread's part failed first and said so)."""
    if offer.done():
        return
    error = done.exception()
    if error is None:
        offer.set_result(done.result())
    else:
        offer.set_exception(error)


# Applied as a call, not as a class decorator, so that type checkers see an actor class
# (`.remote`, `.options`) rather than the plain class. `offer` answers from a thread of its
# own while the default thread trains.
Learner = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(LearnerImpl)  # type: ignore[call-overload]
