"""An elastic pool of generation workers (`generation.actors: {min, max}`), as the driver runs it.

The driver reports, at every pass of its loop, whether the learner is starved and whether the
buffer is backed up (`ElasticPool.observe`); the policy (services/pipeline/elastic_policy.py)
turns that into decisions, which this module carries out without blocking the loop:

- grow: a new worker is started (its constructor runs while the loop goes on), appended to
  `RunActors.generation` and to the driver's streams, and brought to the current version as a
  replacement is (`WeightSync.on_added`: offered the current weights, or the collective group
  re-formed with it); it takes prompts once it acknowledged them.
- shrink: the *last* worker drains: it takes no new prompt (`WorkerStream.draining`), its groups
  in flight come back and are scored as any others, and once it holds none and no weight
  delivery involves it, it is killed, its pending calls forgotten and its stream removed
  (collective: the group is re-formed without it). A grow while a worker drains keeps that worker
  instead of starting another.

Only the last worker ever leaves, so every other worker keeps its index: the driver's streams,
`RunActors.generation`, `WeightSync`'s streams and the pending calls' `worker` stay coherent.

Every decision is a `generation.pool` event (direction, sizes, evidence) and the step records
carry the pool's size (`generation_workers`) and its run totals of grows and shrinks. The policy
starts observing at each attempt's first learner step (engines starting up are no evidence),
and an attempt started after a learner restart, rollback or pause starts at
`generation.num_workers` again, as its actors do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.pipeline.actors import RunActors, start_generation_worker
from services.pipeline.calls import PendingCall
from services.pipeline.elastic_policy import ElasticPolicy, PoolDecision, Sample
from services.pipeline.streams import WorkerStream
from services.pipeline.supervisor import ActorSupervisor
from services.pipeline.weight_sync import WeightSync
from services.spec import RunSpec

log = logging.getLogger(__name__)

POOL_EVENT = "generation.pool"  # a grow or shrink decision, or a drained worker stopped

ReportEvent = Callable[[str, dict[str, Any]], None]


class ElasticPool:
    """The driver's side of an elastic pool; with a fixed pool it only reports its size."""

    def __init__(
        self,
        spec: RunSpec,
        supervisor: ActorSupervisor,
        weights: WeightSync,
        model_dir: Callable[[], Path | None],
        report_event: ReportEvent,
    ) -> None:
        self.spec = spec
        self.supervisor = supervisor
        self.weights = weights
        self._model_dir = model_dir
        self._report_event = report_event
        self.grows = 0  # run totals (the records' counters)
        self.shrinks = 0
        self.reset()

    def reset(self, spec: RunSpec | None = None) -> None:
        """A new attempt (of `spec`, where it changed): its actors are `generation.num_workers`
        fresh ones."""
        self.spec = spec or self.spec
        pool = self.spec.generation.actors
        self.policy = (
            None
            if pool is None
            else ElasticPolicy(
                pool.min,
                pool.max,
                pool.window_s,
                pool.cooldown_s,
                pool.grow_idle_fraction,
                pool.shrink_full_fraction,
            )
        )
        self._draining: int | None = None  # index of the worker leaving (always the last)
        self._observing = False  # from the attempt's first learner step

    def size(self, streams: list[WorkerStream]) -> int:
        """Workers in the pool, one that drains not counted."""
        return len(streams) - (self._draining is not None)

    def record(self, streams: list[WorkerStream]) -> dict[str, int]:
        """The pool's keys of a step's record; the policy observes from the first one on."""
        self._observing = True
        return {
            "generation_workers": self.size(streams),
            "generation_pool_grows_total": self.grows,
            "generation_pool_shrinks_total": self.shrinks,
        }

    def observe(
        self,
        actors: RunActors,
        streams: list[WorkerStream],
        pending: dict[Any, PendingCall],
        poll: Callable[[int], None],
        starved: bool,
        backed_up: bool,
    ) -> None:
        """One pass of the loop: finish a drain that may end, feed the policy its sample and
        carry out its decision. `poll(index)` starts the polling of a worker."""
        if self.policy is None:
            return
        self._finish_drain(actors, streams, pending)
        if not self._observing:
            return
        sample = Sample(time.perf_counter(), starved, backed_up)
        decision = self.policy.observe(sample, self.size(streams))
        if decision is None:
            return
        log.info(
            "generation pool: %s %d -> %d (%s)",
            decision.direction,
            decision.size,
            decision.target,
            decision.reason,
        )
        self._report(decision, streams)
        if decision.direction == "shrink":
            self.shrinks += 1
            self._draining = len(streams) - 1
            streams[-1].draining = True
        elif self._draining is not None:  # keep the worker that drains rather than start one
            self.grows += 1
            streams[self._draining].draining = False
            self._draining = None
        else:
            self.grows += 1
            self._grow(actors, streams, poll)

    def _report(self, decision: PoolDecision, streams: list[WorkerStream]) -> None:
        self._report_event(
            POOL_EVENT,
            {
                "action": decision.direction,
                "size": decision.size,
                "target": decision.target,
                "workers": len(streams),
                "starved_fraction": round(decision.starved_fraction, 4),
                "backed_up_fraction": round(decision.backed_up_fraction, 4),
                "reason": decision.reason,
            },
        )

    def _grow(
        self, actors: RunActors, streams: list[WorkerStream], poll: Callable[[int], None]
    ) -> None:
        """Start a worker at the end of the pool; not waited for (its calls queue behind its
        constructor), not ready until it holds the current version."""
        model_dir = self._model_dir()
        assert model_dir is not None
        handle = start_generation_worker(self.spec, model_dir)
        actors.generation.append(handle)
        stream = WorkerStream(handle, joined=False)
        streams.append(stream)
        self.supervisor.added(actors, handle)
        self.weights.on_added(actors, stream)
        poll(len(streams) - 1)

    def _finish_drain(
        self, actors: RunActors, streams: list[WorkerStream], pending: dict[Any, PendingCall]
    ) -> None:
        """Stop the draining worker once it holds no group and no delivery involves it."""
        index = self._draining
        if index is None:
            return
        stream = streams[index]
        stream.draining = True  # also a replacement of it (it died while draining)
        if stream.outstanding or not self.weights.settled(index):
            return
        # Its pending calls (its poll) are forgotten: their answers would name a worker gone.
        for ref, call in list(pending.items()):
            if getattr(call, "actor", None) is stream.actor:
                del pending[ref]
        self.supervisor.kill(stream.actor)
        del streams[index:]
        del actors.generation[index:]
        self.supervisor.removed(index)
        self.weights.on_removed(actors, index)
        self._draining = None
        log.info("generation pool: worker %d drained and stopped", index)
        self._report_event(POOL_EVENT, {"action": "removed", "worker": index, "workers": index})
