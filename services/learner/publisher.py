"""The one owner of a learner rank's publishes: the publish thread, the weight group's channel,
and one `Publication` per version with its own fence, offer, send decision and job.

Publishing a version (`pipeline.weight_transport`, services/weights): every rank walks the
same bucket plan, gathering FSDP2 shards tensor by tensor, and rank 0 hands each bucket on
before gathering the next (services.learner.publish).

- `object_store`: rank 0 puts each bucket into Ray's object store as it is gathered, and the
  offer carries the refs. Rank 0 owns those objects, so they die with it; that costs nothing,
  since a dead learner fails the step's attempt and the restarted one publishes its weights
  again. Overlapped (`overlap_publish`), `publish` only starts the publish: the publish thread
  reads and puts the buckets while the next step trains, whose first update waits until the
  weights are read (a sharded learner gathers first, with its peers, and the thread only puts);
  `offer` answers once the buckets are in.
- `collective`: the offer is the manifest alone. Rank 0 serves the weight group
  (`open_weight_group`), waits for the receivers (`connect_weight_group`), and `send_weights`
  (called on every rank) broadcasts the current version bucket by bucket. Overlapped,
  `publish(version, send=True)` arms the send of that version at once, between two steps, and
  the publish thread broadcasts it while the next step trains (one rank: it reads the weights
  then; sharded: the ranks gather before the next step and rank 0's thread broadcasts the
  buckets as they come), but only once the driver called `send(version)` (the receivers are
  being called then) or `cancel_send(version)` (the group broke meanwhile: nothing is sent, the
  version is sent later with `send_weights`). Until then a one-rank learner's next update
  waits, so a driver must decide every armed send.

A publish waits for the previous one's offer; an armed send's offer is answered once it is
armed, so two sends may be in flight. Each publication that reads the live weights does so
under a fence of its own (`publish.Fence`, armed in the rank's `WeightsRead`, which every update
waits on): the late end of one publication can never free the next one's update.

The weight group and rank 0's channel into it are formed and closed by the actor's default
thread and sent on (and closed on failure) by the publish thread: both are read and replaced
under one lock, never held during a send, and a send that failed closes only its own group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Any

import ray
import torch

from services.learner.distributed import RankGroup
from services.learner.publish import (
    Fence,
    Handed,
    WeightsRead,
    drain,
    handed_buckets,
    publish_point,
)
from services.learner.step import LearnerCore
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
from services.weights.delta import DeltaBase
from services.weights.object_store import put_buckets, put_dense

# A weight-group collective that waits this long raises: a receiver that died fails the publish
# instead of holding the learner forever (long: a broadcast of a multi-GB bucket is legitimate).
WEIGHT_GROUP_TIMEOUT_S = 600.0
# Joining a weight group has its own, shorter deadline: a receiver that died or never came while
# the group formed holds learner rank 0 (no step taken) this long at most. collective.py owns it.
WEIGHT_GROUP_JOIN_TIMEOUT_S = collective.DEFAULT_JOIN_TIMEOUT_S

Buckets = Iterator[dict[str, torch.Tensor]]


class SendCancelled(RuntimeError):
    """An armed send that the driver cancelled: nothing of it was broadcast."""


@dataclass(eq=False)
class Publication:
    """One version's publish on rank 0: its `offer` (answered by `Publisher.offer`), and for
    an armed send the driver's `decision` (send or not) and the publish thread's `job`."""

    version: int
    offer: Future[WeightsOffer | None] = field(default_factory=Future)
    decision: Future[bool] | None = None
    job: Future[None] | None = None
    offered: bool = False  # `offer` has answered

    @property
    def settled(self) -> bool:
        """Nothing more is asked of it: offered, and any armed send decided."""
        return self.offered and (self.decision is None or self.decision.done())


class Publisher:
    """The publishes of one learner rank (module doc), over its `core` and the `fences` its
    updates wait on; `overlap`: publishes run on a thread of their own beside the next step."""

    def __init__(
        self,
        core: LearnerCore,
        fences: WeightsRead,
        group: RankGroup,
        transport: WeightTransportName,
        bucket_bytes: int,
        overlap: bool,
        in_flight: int = 1,
        delta: bool = False,
    ) -> None:
        if in_flight < 1:
            raise ValueError(f"publish_in_flight must be >= 1, got {in_flight}")
        self.core = core
        self.fences = fences
        self._group = group
        self._transport: WeightTransportName = transport
        self._bucket_bytes = bucket_bytes
        self._sharded = core.learner.strategy != "single"
        self._thread = ThreadPoolExecutor(1, "publish") if overlap else None
        self._publications: dict[int, Publication] = {}
        # Rank 0's sharded publishes whose gathered host copy is still held (until their put or
        # broadcast ends): at most `in_flight`, the next gather waits for room.
        self._in_flight = in_flight
        self._holding: list[tuple[int, Future[Any]]] = []  # (version, its put or send job)
        # Called when a gather waits for room, with the versions of the copies it waits on.
        self.waits_for_room: Callable[[list[int]], None] = _ignore
        self._changed = threading.Condition()
        self._channel: Channel | None = None
        self._weight_group: WeightGroup | None = None
        self._group_lock = threading.Lock()
        self._timeout_s = WEIGHT_GROUP_TIMEOUT_S
        self._join_timeout_s = WEIGHT_GROUP_JOIN_TIMEOUT_S
        # Delta publishes over object_store (rank 0): the last put version's buckets, diffed
        # against by the next put and read whole by `dense_offer`, under `_delta_lock`.
        # (The collective transport's channels hold their own: services/weights/collective.py.)
        self._delta_publishes = delta
        self._delta: DeltaBase | None = None  # made by the first object-store put
        self._delta_manifest: WeightsManifest | None = None
        self._delta_lock = threading.Lock()
        self._last_publish: dict[str, float] = {}

    def switch(
        self, transport: WeightTransportName | None = None, overlap: bool | None = None
    ) -> None:
        """Publish over `transport`, overlapped or not, from now on (between publishes: for a
        benchmark that measures each from one loaded model)."""
        if transport is not None:
            self._transport = transport
        if overlap is not None:
            self._thread = ThreadPoolExecutor(1, "publish") if overlap else None

    # --- publishing a version -------------------------------------------------------------------

    def publish(self, version: int, send: bool = False) -> None:
        """Publish `version`, which must be the version held (a publish of another would hand
        out weights under a wrong number); every rank takes part, rank 0's `offer(version)`
        answers with it. Overlapped, this returns once the publish has started; `send`
        (collective, overlapped): also arm the send of `version` to the weight group."""
        publication = Publication(version)
        earlier: list[Future[WeightsOffer | None]] = []
        if self._group.rank == 0:  # the others' part ends with this call, and nobody asks them
            with self._changed:
                earlier = [p.offer for p in self._publications.values()]
                self._publications[version] = publication
                self._changed.notify_all()
        offer = publication.offer
        try:
            for previous in earlier:
                previous.exception()  # the previous publish's offer (an armed send's: armed)
            if version != self.core.version:
                raise RuntimeError(
                    f"publish of version {version}, but the learner holds version "
                    f"{self.core.version}"
                )
            if send and (self._thread is None or self._transport != "collective"):
                raise ValueError("publish(send=True) needs an overlapped collective publish")
            if self._thread is None or (self._transport == "collective" and not send):
                offer.set_result(self._publish_now())
            elif send:
                self._publish_armed(publication)
            elif self._sharded:
                self._put_gathered(offer)
            else:
                self._put_overlapped(offer)
        except Exception as error:
            if not offer.done():  # a sharded publish's put may have failed first
                offer.set_exception(error)
            raise

    def offer(self, version: int) -> WeightsOffer | None:
        """The offer of `version` once its publish is done (rank 0; None elsewhere); callable
        from another thread, beside the next step (and before `publish` ran)."""
        with self._changed:
            self._changed.wait_for(lambda: version in self._publications)
            publication = self._publications[version]
        try:
            return publication.offer.result()
        finally:
            with self._changed:
                publication.offered = True
                self._forget(publication)

    def _forget(self, publication: Publication) -> None:
        """Drop a settled publication (holding `_changed`)."""
        if publication.settled and self._publications.get(publication.version) is publication:
            del self._publications[publication.version]

    def _publish_now(self) -> WeightsOffer | None:
        """The current version's offer, on the calling thread. object_store: every rank
        gathers, rank 0 puts; collective: no gathering until `send_weights`."""
        manifest = self.core.weights_manifest(self._bucket_bytes)
        if self._transport == "collective":
            return WeightsOffer("collective", manifest) if self._group.rank == 0 else None
        buckets = self.core.weight_buckets(manifest, "cpu")
        if self._group.rank != 0:
            drain(buckets)
            return None
        return self._put(manifest, buckets)

    def _put_overlapped(self, offer: Future[WeightsOffer | None]) -> None:
        """A one-rank overlapped publish over object_store: the publish thread reads the
        weights under the publication's fence while the next step trains, then puts."""
        assert self._thread is not None
        fence = self.fences.arm()
        after = publish_point(self.core.device)

        def read_and_put() -> WeightsOffer:
            try:
                manifest = self.core.weights_manifest(self._bucket_bytes)
                buckets = self.core.overlapped_weight_buckets(manifest, fence, after)
                return self._put(manifest, buckets)
            finally:
                fence.release()  # also when nothing was read (a failed start)

        self._thread.submit(read_and_put).add_done_callback(lambda done: _settle(offer, done))

    def _gather(
        self,
        offer: Future[WeightsOffer | None],
        manifest: WeightsManifest,
        start: Callable[[Buckets], Future[Any]],
    ) -> None:
        """A sharded overlapped publish (services.learner.publish): every rank gathers here,
        with the others; rank 0 `start`s the publish thread's part on its buckets as they are
        handed over (on the host: pinned under a GPU, by copies the host does not wait for),
        once fewer than `in_flight` earlier copies are still held."""
        if self._group.rank == 0:
            self._wait_for_room()
        cuda = self.core.device.type == "cuda"
        buckets = self.core.weight_buckets(manifest, "cpu", pinned=cuda)
        if self._group.rank != 0:
            drain(buckets)
            offer.set_result(None)
            return
        handed: SimpleQueue[Handed] = SimpleQueue()
        self._holding.append((manifest.version, start(handed_buckets(handed))))
        try:
            for bucket in buckets:
                handed.put((bucket, publish_point(self.core.device)))
                del bucket
        finally:
            handed.put(None)  # a gather that failed leaves the publish short: it fails

    def _wait_for_room(self) -> None:
        """Block until fewer than `in_flight` gathered copies are held (rank 0, before a
        gather; the copies are let go of by the publish thread, which never waits on this)."""
        self._holding = [(v, job) for v, job in self._holding if not job.done()]
        while len(self._holding) >= self._in_flight:
            self.waits_for_room([version for version, _ in self._holding])
            wait([job for _, job in self._holding], return_when=FIRST_COMPLETED)
            self._holding = [(v, job) for v, job in self._holding if not job.done()]

    def _put_gathered(self, offer: Future[WeightsOffer | None]) -> None:
        """A sharded overlapped publish over object_store: the publish thread puts the buckets
        while the next step trains."""
        assert self._thread is not None
        thread = self._thread
        manifest = self.core.weights_manifest(self._bucket_bytes)

        def put(buckets: Buckets) -> Future[WeightsOffer]:
            running = thread.submit(self._put, manifest, buckets)
            running.add_done_callback(lambda done: _settle(offer, done))
            return running

        self._gather(offer, manifest, put)

    def _put(self, manifest: WeightsManifest, buckets: Buckets) -> WeightsOffer:
        """Put `manifest`'s version into the object store: each bucket whole, or as a patch
        against the last version put (delta publishes). Records what it cost."""
        started = time.perf_counter()
        if not self._delta_publishes:
            offer = put_buckets(manifest, buckets)
        else:
            with self._delta_lock:
                self._delta = self._delta or DeltaBase()
                offer = put_buckets(manifest, buckets, self._delta, _current_actor())
                self._delta_manifest = manifest
        self._last_publish = {
            "publish_seconds": time.perf_counter() - started,
            "publish_bytes": float(offer.sent_bytes),
            "publish_changed_fraction": offer.changed_fraction,
        }
        return offer

    def dense_offer(self, at_least: int = 0) -> WeightsOffer:
        """The last version put, whole, from the held copy (delta publishes, rank 0): what a
        worker that cannot apply a patch loads instead. Puts it anew on each call. The last
        version put is the newest offered, so it is at least any `at_least` a worker asks."""
        if self._group.rank != 0:
            raise RuntimeError("dense_offer is rank 0's, with delta publishes")
        with self._delta_lock:
            manifest = self._delta_manifest
            if self._delta is None or manifest is None or manifest.version < at_least:
                held = "nothing" if manifest is None else f"version {manifest.version}"
                raise RuntimeError(f"dense_offer of version {at_least} or newer: {held} put")
            return put_dense(self._delta, manifest, _current_actor())

    def publish_figures(self) -> dict[str, float]:
        """What the last finished publish cost (rank 0; {} before one): seconds, bytes sent
        and the fraction of weights that changed."""
        return dict(self._last_publish)

    # --- armed sends ----------------------------------------------------------------------------

    def _publish_armed(self, publication: Publication) -> None:
        """A collective publish that arms its send (module doc). One rank: the publish thread
        reads the weights under the publication's fence once the send starts, and the next
        update waits until it has. Sharded: every rank gathers here and rank 0's publish thread
        broadcasts the buckets as they come once the send starts. The offer is answered once
        the send is armed: the driver may start it at once."""
        manifest = self.core.weights_manifest(self._bucket_bytes)
        offer = publication.offer
        published = WeightsOffer("collective", manifest) if self._group.rank == 0 else None
        if self._sharded:

            def arm(buckets: Buckets) -> Future[None]:
                job = self._arm(publication, manifest, lambda: buckets, None)
                offer.set_result(published)
                return job

            self._gather(offer, manifest, arm)
            return
        fence = self.fences.arm()
        after = publish_point(self.core.device)
        device = self._weight_device()
        self._arm(
            publication,
            manifest,
            lambda: self.core.overlapped_weight_buckets(manifest, fence, after, device),
            fence,
        )
        offer.set_result(published)

    def _arm(
        self,
        publication: Publication,
        manifest: WeightsManifest,
        buckets: Callable[[], Buckets],
        fence: Fence | None,
    ) -> Future[None]:
        """Arm the send of `manifest`'s version, the one held: the publish thread broadcasts
        `buckets()` once the driver starts it (`send`), or drops it (`cancel_send`); `fence`:
        the publication's own, which a one-rank send reads the live weights under. Returns
        the publish thread's job."""
        assert self._thread is not None
        decision: Future[bool] = Future()
        job = self._thread.submit(self._send_armed, decision, manifest, buckets, fence)
        with self._changed:
            publication.decision, publication.job = decision, job
        return job

    def _send_armed(
        self,
        decision: Future[bool],
        manifest: WeightsManifest,
        buckets: Callable[[], Buckets],
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
                    self._timed_send(channel, manifest, buckets())
            except WeightGroupError:
                self._close_weight_group(channel)  # a receiver died or hung: form another
                raise
        finally:
            if fence is not None:  # a one-rank send's, also when nothing was read: its own
                fence.release()

    def decide(self, version: int, go: bool) -> Future[None]:
        """The driver's decision on the armed send of `version`: broadcast it now (`go`, the
        receivers are being called) or drop it (its group broke); returns its job."""
        with self._changed:
            publication = self._publications.get(version)
            if publication is None or publication.decision is None:
                raise RuntimeError(f"no send of version {version} is armed")
            if publication.decision.done():
                raise RuntimeError(f"the send of version {version} was decided already")
            publication.decision.set_result(go)
            job = publication.job
            self._forget(publication)
        assert job is not None
        return job

    # --- the weight group -----------------------------------------------------------------------

    def _weight_device(self) -> torch.device:
        """Where the buckets of a collective publish are assembled: the GPU under NCCL."""
        return self.core.device if self.core.device.type == "cuda" else torch.device("cpu")

    def open_weight_group(
        self, world_size: int, generation: int, timeout_s: float, join_timeout_s: float
    ) -> WeightGroup:
        """Serve a new weight group of `world_size` ranks (rank 0 and every receiving
        process), replacing any earlier one; return at once with where it meets.
        `join_timeout_s` bounds `connect_weight_group`, `timeout_s` every send after it."""
        self._close_weight_group()
        backend: WeightGroupBackend = "nccl" if self._weight_device().type == "cuda" else "gloo"
        group = collective.open_weight_group(
            world_size, backend, generation, timeout_s=timeout_s, delta=self._delta_publishes
        )
        with self._group_lock:
            self._weight_group = group
        self._timeout_s, self._join_timeout_s = timeout_s, join_timeout_s
        return group

    def connect_weight_group(self, group: WeightGroup) -> None:
        """Join `group` as its rank 0; blocks until every receiver has joined, or raises
        `WeightGroupError` naming those that did not after the join deadline."""
        if group != self._weight_group:
            raise ValueError(f"weight group {group} is not the one this learner opened last")
        channel = collective.connect(
            group, 0, timeout_s=self._timeout_s, join_timeout_s=self._join_timeout_s
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
            self._timed_send(channel, manifest, buckets)
        except WeightGroupError:
            # A receiver died or hung: this group is done, but the learner is not. Finishing
            # the walk keeps the other ranks' gathers in step, so the driver can form a new
            # group and send again.
            self._close_weight_group(channel)
            drain(buckets)
            raise

    def _timed_send(self, channel: Channel, manifest: WeightsManifest, buckets: Buckets) -> None:
        """Send on `channel`, recording what it cost (`publish_figures`)."""
        started, before = time.perf_counter(), sum(channel.messages)
        channel.send(manifest, buckets)
        self._last_publish = {
            "publish_seconds": time.perf_counter() - started,
            "publish_bytes": float(sum(channel.messages) - before),
            "publish_changed_fraction": channel.changed_fraction,
        }

    def attach_channel(self, channel: Channel | None) -> None:
        """Use `channel` as the weight group's (a group formed elsewhere: tests, benchmarks)."""
        with self._group_lock:
            self._channel = channel

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


def _current_actor() -> Any:
    """This process's actor handle (who answers `dense_offer`); None outside an actor."""
    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:
        return None


def _ignore(versions: list[int]) -> None:
    """No one watches a publish wait for room."""


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
