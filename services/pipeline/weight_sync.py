"""How the driver moves each new version of the weights from the learner to every worker.

`object_store`: the learner's step returns a `WeightsOffer` whose buckets rank 0 put into the
object store; every worker is offered it and loads it when its swap policy allows. A worker
becomes `ready` (may take prompts) once it acknowledged the offer, so a replacement never
generates with the weights on disk while the run is past version 0.

`collective`: at start, learner rank 0 and every worker's receiving processes form a weight
group; after each step the learner's ranks send (gather, rank 0 broadcasts) while every worker
receives. The learner takes no step while a send is in flight. A worker that is replaced (or a
send that failed because a receiver died) re-forms the group, at the next moment the learner is
idle, and the current version is sent again to everyone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from services.learner.group import wait_all
from services.pipeline.actors import RunActors
from services.pipeline.streams import WorkerStream
from services.weights.base import WeightsOffer, WeightTransportName

log = logging.getLogger(__name__)

WorkerFailed = Callable[[RunActors, int, Any, BaseException], None]


@dataclass(frozen=True)
class _WorkerAck:
    """A worker's answer to an offer (object_store) or a receive (collective)."""

    worker: int
    actor: Any


@dataclass(frozen=True)
class _LearnerSend:
    """One learner rank's part of a collective send."""


class WeightSync:
    """The current version's offer and the calls that deliver it."""

    def __init__(self, transport: WeightTransportName) -> None:
        self.transport = transport
        self.reset()

    def reset(self) -> None:
        """Forget everything of an attempt whose actors are gone."""
        self._offer: WeightsOffer | None = None
        self._version = 0
        self._calls: dict[Any, _WorkerAck | _LearnerSend] = {}
        self._streams: list[WorkerStream] = []
        self._group_generation = 0
        self._regroup = False

    @property
    def sending(self) -> bool:
        """A collective send is in flight (the learner is busy with it)."""
        return any(isinstance(call, _LearnerSend) for call in self._calls.values())

    def pending_refs(self) -> list[Any]:
        return list(self._calls)

    # --- set-up -------------------------------------------------------------------------------

    def connect(self, actors: RunActors, streams: list[WorkerStream]) -> None:
        """Start of an attempt: form the weight group (collective)."""
        self.reset()
        self._streams = streams
        if self.transport == "collective":
            self._form_group(actors)

    def _form_group(self, actors: RunActors) -> None:
        """Learner rank 0 and every worker's receiving processes join one group (blocking)."""
        self._group_generation += 1
        counts = wait_all([s.actor.weight_receivers.remote() for s in self._streams])
        group_ref = actors.learner.open_weight_group(1 + sum(counts), self._group_generation)
        group = ray.get(group_ref)
        refs = [actors.learner.connect_weight_group(group)]
        first = 1
        for stream, count in zip(self._streams, counts, strict=True):
            refs.append(stream.actor.join_weight_group.remote(group, first))
            first += count
        wait_all(refs)
        log.info("weight group %d formed: %d receivers", self._group_generation, first - 1)

    # --- publishing ---------------------------------------------------------------------------

    def publish(self, actors: RunActors, version: int, offer_ref: Any) -> None:
        """Deliver the weights of `version`, whose offer `offer_ref` the learner returned."""
        offer: WeightsOffer = ray.get(offer_ref)  # small: names, shapes and bucket refs
        self._offer, self._version = offer, version
        if self.transport == "object_store":
            for index, stream in enumerate(self._streams):
                self._offer_to(index, stream)
        else:
            self._send(actors)

    def _offer_to(self, index: int, stream: WorkerStream) -> None:
        assert self._offer is not None
        # In a list, so Ray hands the worker the offer's refs without fetching any bucket.
        ref = stream.actor.offer_weights.remote(self._version, [self._offer])
        self._calls[ref] = _WorkerAck(index, stream.actor)

    def _send(self, actors: RunActors) -> None:
        assert self._offer is not None
        for ref in actors.learner.send_weights():
            self._calls[ref] = _LearnerSend()
        for index, stream in enumerate(self._streams):
            ref = stream.actor.receive_weights.remote(self._offer.manifest)
            self._calls[ref] = _WorkerAck(index, stream.actor)

    def complete(self, actors: RunActors, ref: Any, on_worker_failed: WorkerFailed) -> None:
        """React to one finished delivery call."""
        call = self._calls.pop(ref)
        try:
            ray.get(ref)
        except (RayActorError, RayTaskError) as error:
            if isinstance(call, _WorkerAck):
                on_worker_failed(actors, call.worker, call.actor, error)
                return
            if isinstance(error, RayActorError):
                raise  # a learner rank died: the attempt ends
            # A receiver died mid-broadcast: the group is re-formed and the version sent again.
            log.warning("sending weights failed (%s): re-forming the weight group", error)
            self._regroup = True
            return
        if isinstance(call, _WorkerAck):
            stream = self._streams[call.worker]
            if stream.actor is call.actor:
                stream.ready = True

    def on_replaced(self, actors: RunActors, index: int, stream: WorkerStream) -> None:
        """A new worker at `index` (not ready): bring it to the current version."""
        self._streams[index] = stream
        if self._version == 0:
            stream.ready = True  # it loaded version 0 from disk like everyone
            if self.transport == "object_store":
                return
        if self.transport == "object_store":
            self._offer_to(index, stream)
        else:
            self._regroup = True

    def regroup_if_needed(
        self, actors: RunActors, learner_busy: bool, streams: list[WorkerStream]
    ) -> None:
        """Re-form the collective group once the learner is idle; send the version again."""
        if not self._regroup or learner_busy or self._calls:
            return
        self._regroup = False
        self._streams = streams
        self._form_group(actors)
        if self._version > 0:
            self._send(actors)
