"""The run driver's fault rules for generation workers and verifier actors (docs/reliability.md's
fault policy). `ActorFaults` decides what a failure costs; replacing an actor is the supervisor's
(`ActorSupervisor`), handing prompts back and issuing calls again is the driver's.

What a generation worker absorbs: a request its backend refuses (a prompt too long for the
engine's context, one that encodes to nothing) comes back as a refusal, and its prompt is dropped
and counted (`groups_dropped_invalid`); a failed weight load is retried once by the worker, and
only a second failure reaches the driver, which replaces the worker (its prompts issued again,
without counting against them). What the driver handles: a generation actor that dies, raises,
or returns nothing past its stall deadline is replaced and its prompts are issued again (a prompt
whose generation raised on two actors fails the run, naming the actor and the error); with a
warm standby up (`generation.standby`) the standby takes its place instead of a new actor,
which counts as one replacement all the same. A verifier
actor that dies or hangs past `reward.call_timeout_s` is replaced and its groups are scored again
(twice failed: its responses are marked unverified, reward 0); one that raises has its groups
scored again by another verifier actor (a second error fails the run). Replacements draw on
`pipeline.actor_replacements`. A learner rank that dies takes the attempt with it: the driver
resumes from the last checkpoint (`RunDriver._restart_from_checkpoint`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from services.generation.base import Refusal
from services.generation.worker import WeightSwapError
from services.messages import Prompt
from services.pipeline.actors import RunActors
from services.pipeline.buffer import RolloutBuffer
from services.pipeline.calls import (
    Counters,
    GenerationFailed,
    PendingCall,
    PingCall,
    ScoringCall,
    ScoringFailed,
    unverified,
)
from services.pipeline.streams import WorkerStream
from services.pipeline.supervisor import ActorSupervisor
from services.spec.generation import GenerationConfig

log = logging.getLogger(__name__)

SCORING_ATTEMPTS = 2  # a batch whose verifier actor failed this often is marked unverified
GENERATION_ATTEMPTS = 2  # a prompt whose generation failed this often fails the run
# A worker that does not answer a ping (PingCall) in this long is taken for hung.
PING_TIMEOUT_S = 10.0


class ActorFaults:
    """What a failed generation worker or verifier actor costs the run.

    Keeps the strikes of prompts whose generation raised (a run-long tally, across learner
    restarts); the counters and the buffer it charges are handed in, as a learner restart
    replaces them.
    """

    def __init__(self, generation: GenerationConfig, supervisor: ActorSupervisor) -> None:
        self.generation = generation
        self.supervisor = supervisor
        self._strikes: dict[str, int] = {}  # prompt_id -> generation attempts that raised

    # --- generation workers -------------------------------------------------------------------

    def charge(self, worker: int, prompts: Iterable[Prompt], error: BaseException) -> None:
        """Count a failed worker's error against the prompts it held, where they may be its
        cause; raise GenerationFailed for a prompt that failed GENERATION_ATTEMPTS times."""
        if not isinstance(error, RayTaskError) or isinstance(error, WeightSwapError):
            # It died or hung, or gave up a weight load: the worker's fault, not its prompts'.
            return
        # The worker raised (its engine failed), which may be the prompts' doing: retried once
        # on another actor, then the run fails naming the actor and the error.
        for prompt in prompts:
            failed = self._strikes.get(prompt.prompt_id, 0) + 1
            self._strikes[prompt.prompt_id] = failed
            if failed >= GENERATION_ATTEMPTS:
                raise GenerationFailed(
                    f"generation of prompt {prompt.prompt_id!r} failed on "
                    f"{failed} actors; the last, generation worker {worker}, raised: "
                    f"{getattr(error, 'cause', error)!r}"
                ) from error

    def generated(self, prompts: Iterable[Prompt]) -> None:
        """These prompts came back generated: their strikes are forgotten."""
        for prompt in prompts:
            self._strikes.pop(prompt.prompt_id, None)

    def drop_refused(
        self, stream: WorkerStream, refusal: Refusal, counters: Counters, buffer: RolloutBuffer
    ) -> None:
        """The worker did not generate this prompt and never will (docs/reliability.md): it is
        dropped and counted, not retried, and the worker goes on."""
        prompt = stream.dropped(refusal.prompt_id)
        if prompt is None:
            return
        log.warning("prompt %r dropped (%s): %s", prompt.prompt_id, refusal.reason, refusal.message)
        buffer.release(1)
        self._strikes.pop(prompt.prompt_id, None)
        counters.groups_dropped_invalid += 1
        counters.rollouts_dropped_invalid += self.generation.group_size
        if refusal.reason == "prompt_too_long":
            counters.prompts_too_long += 1

    def stop_hung(
        self, pending: Collection[PendingCall], streams: Sequence[WorkerStream]
    ) -> dict[Any, PingCall]:
        """Kill the verifier actors and generation workers taken for hung, given the calls in
        flight; the pings sent to workers that may only be blocked, by their refs.

        A worker overdue with a weight delivery is pinged before it is killed: one blocked in a
        collective receive by a hung peer answers (and is kept), the hung one does not.
        """
        scoring = [
            (call.actor, call.verifier, call.started)
            for call in pending
            if isinstance(call, ScoringCall)
        ]
        self.supervisor.stop_hung_verifiers(scoring)
        gen = self.generation
        now = time.perf_counter()
        pinged = {call.worker: call for call in pending if isinstance(call, PingCall)}
        pings: dict[Any, PingCall] = {}
        for index, stream in enumerate(streams):
            ping = pinged.get(index)
            if ping is not None and ping.actor is stream.actor:
                if now - ping.started > PING_TIMEOUT_S:
                    self.supervisor.kill_as_hung(
                        stream.actor,
                        f"generation worker {index} acknowledged no weights and did not answer "
                        f"a ping in {PING_TIMEOUT_S:.0f} s",
                    )
                continue
            if not stream.stalled(now, gen.max_new_tokens, gen.first_group_timeout_s):
                continue
            if stream.unacknowledged:  # a delivery is overdue: a peer of the group may block it
                pings[stream.actor.policy_version.remote()] = PingCall(index, stream.actor, now)
                continue
            deadline = stream.stall_deadline(gen.max_new_tokens, gen.first_group_timeout_s)
            self.supervisor.kill_as_hung(
                stream.actor,
                f"generation worker {index} returned no group in {deadline:.0f} s holding "
                f"{len(stream.outstanding)} prompts",
            )
        return pings

    # --- verifier actors ----------------------------------------------------------------------

    def scoring_failed(
        self,
        actors: RunActors,
        call: ScoringCall,
        error: RayActorError | RayTaskError,
        counters: Counters,
        buffer: RolloutBuffer,
    ) -> int | None:
        """A scoring call failed: the verifier actor to score its groups on again (attempt + 1),
        or None where they were given up (put in `buffer`, marked unverified)."""
        if isinstance(error, RayTaskError):
            return self._scoring_raised(actors, call, error, counters)
        return self._scoring_lost(actors, call, error, counters, buffer)

    def _scoring_lost(
        self,
        actors: RunActors,
        call: ScoringCall,
        error: RayActorError,
        counters: Counters,
        buffer: RolloutBuffer,
    ) -> int | None:
        """The verifier died (or was killed as hung): replace it and score the batch again on
        the replacement, or give up on the batch."""
        self.supervisor.replace(actors, "verifier", call.verifier, call.actor, error)
        if call.attempt >= SCORING_ATTEMPTS:
            # The batch itself may be what kills verifiers: it must not take the run with it.
            log.warning(
                "%d groups failed scoring %d times: their responses are marked unverified",
                len(call.groups),
                call.attempt,
            )
            counters.unverified_groups += len(call.groups)
            buffer.add(unverified(call), reserved=len(call.prompts))
            return None
        counters.rescored_groups += len(call.groups)
        return call.verifier

    def _scoring_raised(
        self, actors: RunActors, call: ScoringCall, error: RayTaskError, counters: Counters
    ) -> int:
        """A verifier raised (it is alive): score the groups once more on another verifier
        actor; a second error fails the run, naming the actor and the error."""
        if call.attempt >= SCORING_ATTEMPTS:
            raise ScoringFailed(
                f"scoring {len(call.groups)} groups failed {call.attempt} times; the last, "
                f"verifier actor {call.verifier}, raised: {getattr(error, 'cause', error)!r}"
            ) from error
        log.warning("verifier actor %d raised %r: scoring again", call.verifier, error)
        counters.rescored_groups += len(call.groups)
        return (call.verifier + 1) % len(actors.verifiers)
