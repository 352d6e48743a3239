"""The run driver: one event loop over the Ray calls of a run.

    prompts -> generation actors -> verifier actors -> rollout buffer -> learner -> new weights
                     ^                                                                |
                     +------------------- offered between batches --------------------+

Every call in flight is a Ray object ref in `_pending`; the loop waits for whichever finishes
first and reacts to it, so generation, scoring and training overlap (asynchronous mode). In
synchronous mode generation is only asked for while the learner is idle and only for the one
batch it will train on next, which is on-policy training: the baseline every async figure is
compared with.

The learner is a group of ranks (`services.learner.group`) that answers as one learner. Weights
go from it to the generation actors through the object store: rank 0's `step` returns them as a
second return value, stored once and owned by this process; every generation actor is offered
the ref and fetches it when its current batch is done. At the end of a run (or a cancel) the
final checkpoint is exported as a Hugging Face model to `RUN_DIR/model/`.

Faults (docs/reliability.md): a generation actor that dies is replaced and its prompts are
issued again; a verifier actor that dies, or hangs past `reward.call_timeout_s`, is replaced and
its batch is scored again (twice failed: its responses are marked unverified, reward 0). Both
draw on `pipeline.actor_replacements`. A learner rank that dies takes the attempt with it:
every actor is stopped and the run resumes from its last checkpoint, up to
`pipeline.learner_restarts` times. Nothing is trained twice: results of the lost attempt are
dropped with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import ray
from ray.exceptions import RayActorError

from kpo_core.config import RunSpec
from services.generation.base import SamplingSettings
from services.messages import Prompt, Response, ScoredGroup, ScoredResponse
from services.metrics import FAULT_COUNTERS, LEARNER_TOTALS
from services.pipeline.actors import (
    RunActors,
    check_cluster_resources,
    start_actors,
    start_generation_worker,
    start_verifier,
)
from services.pipeline.buffer import RolloutBuffer
from services.pipeline.checkpoints import (
    LEARNER_DIR,
    latest_checkpoint,
    prune_checkpoints,
    read_driver_state,
    write_checkpoint,
)
from services.pipeline.outputs import MetricsRecord, RunDirectory, RunObserver, RunState
from services.pipeline.plots import PLOTTED_KEYS, plot_curves
from services.pipeline.prompts import PromptStream
from services.pipeline.records import (
    group_from_json,
    group_to_json,
    prompt_from_json,
    prompt_to_json,
)
from services.pipeline.signals import on_stop_signals
from services.tasks.models import resolve_model

log = logging.getLogger(__name__)

RATIO_DIR = "ratios"  # the learner's log-ratio files (learner.record_ratios_every)
WAIT_SECONDS = 0.5  # longest the loop sleeps without news (it then checks for a cancel)
ROLE_KEYS = {"generation": "generation", "verifier": "verifiers"}  # role -> status.json key
SCORING_ATTEMPTS = 2  # a batch whose verifier actor failed this often is marked unverified
VERIFIER_LOST = "verifier actor lost"  # the `failure` of a response no actor could score


@dataclass
class Counters:
    """Run totals that a checkpoint carries over into a resumed run."""

    step: int = 0  # learner steps done = the learner's policy version
    generation_calls: int = 0  # also numbers the sampling seeds, so a resumed run draws anew
    groups_issued: int = 0  # asked of generation (prompts handed back are not counted)
    tokens_generated_total: int = 0
    tokens_trained_total: int = 0
    rollouts_dropped_stale: int = 0  # responses
    groups_dropped_stale: int = 0
    elapsed_seconds: float = 0.0  # wall time of earlier attempts of this run
    # Faults survived (docs/reliability.md); also in every metrics record.
    learner_restarts: int = 0
    generation_replacements: int = 0
    verifier_replacements: int = 0
    rescored_groups: int = 0  # scored again after their verifier actor died or hung
    unverified_groups: int = 0  # their verifier actor failed SCORING_ATTEMPTS times
    # Bad numbers the learner masked or skipped (docs/numerics.md), summed over the run.
    nonfinite_rewards_total: float = 0.0
    nonfinite_tokens_total: float = 0.0
    extreme_ratio_tokens_total: float = 0.0
    skipped_minibatches_total: float = 0.0

    def faults(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in FAULT_COUNTERS}


@dataclass(frozen=True)
class GenerationCall:
    worker: int
    actor: Any  # the handle called: a replacement may sit at `worker` by the time this fails
    prompts: list[Prompt]
    started: float


@dataclass(frozen=True)
class ScoringCall:
    verifier: int
    actor: Any
    prompts: list[Prompt]
    groups: list[list[Response]]
    started: float
    attempt: int = 1


@dataclass(frozen=True)
class LearnerCall:
    weights_ref: Any
    started: float


@dataclass(frozen=True)
class LearnerPeerCall:
    """A step's result on a rank other than 0: watched only so that its death is noticed."""


PendingCall = GenerationCall | ScoringCall | LearnerCall | LearnerPeerCall


@dataclass
class _Throughput:
    """Generation between two learner steps: tokens, and the seconds of each generate call."""

    tokens: int = 0
    batch_seconds: list[float] = field(default_factory=list)
    since: float = field(default_factory=time.perf_counter)

    def record_and_reset(self) -> dict[str, float]:
        now = time.perf_counter()
        batches = self.batch_seconds
        record = {
            "generation_tokens_per_s": self.tokens / max(now - self.since, 1e-9),
            # Mean over the calls that finished since the last step (0 if none did).
            "generation_batch_seconds": sum(batches) / len(batches) if batches else 0.0,
            "generation_batches": float(len(batches)),
        }
        self.tokens, self.batch_seconds, self.since = 0, [], now
        return record


class CancelRequested(Exception):
    """Raised by the signal handler on a second Ctrl-C: stop without waiting."""


class FaultBudgetExhausted(RuntimeError):
    """More actors died than the run's spec allows it to survive."""


def sampling_seed(run_seed: int, call: int) -> int:
    """A distinct, reproducible sampling seed for every generation call of a run."""
    digest = hashlib.sha256(f"{run_seed}/{call}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


class RunDriver:
    """Drives one run to `spec.pipeline.steps` learner steps, reporting to `observers`."""

    def __init__(
        self, spec: RunSpec, run_dir: RunDirectory, observers: Sequence[RunObserver]
    ) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.observers = [run_dir, *observers]
        self._pending: dict[Any, PendingCall] = {}
        self._idle_workers: list[int] = []
        self._next_verifier = 0
        self._weights_ref: Any = None  # newest published weights, kept alive while offered
        self._weights_version = 0
        self._hung: list[Any] = []  # verifier handles killed as hung (each is killed once)
        self._actor_pids: dict[str, list[int]] = {}
        self._new_pids: list[tuple[str, int, Any]] = []  # (role key, index, pid ref)
        self._throughput = _Throughput()
        self._started = time.perf_counter()
        self._cancel = False
        self._model_dir: Path | None = None
        self._start_from_scratch()

    # --- lifecycle --------------------------------------------------------------------------

    def _start_from_scratch(self) -> None:
        """Step 0: no progress, no buffered groups, the prompt stream from its beginning."""
        self.counters = Counters()
        pipe = self.spec.pipeline
        self.buffer = RolloutBuffer(pipe.buffer_groups, pipe.max_staleness)
        self.prompts = PromptStream(self.spec.task, self.spec.seed)
        self._resume_path: Path | None = None
        self._last_checkpoint_step = -1

    def restore(self) -> int | None:
        """Load the newest complete checkpoint's driver state; its step, or None if none."""
        found = latest_checkpoint(self.run_dir.checkpoints)
        if found is None:
            return None
        step, path = found
        state = read_driver_state(path)
        self.counters = Counters(**state["counters"])
        self.prompts = PromptStream(
            self.spec.task,
            self.spec.seed,
            state["prompt_position"],
            [prompt_from_json(p) for p in state["handed_back"]],
        )
        groups = [group_from_json(g) for g in state["buffer"]]
        pipe = self.spec.pipeline
        self.buffer = RolloutBuffer(pipe.buffer_groups, pipe.max_staleness, groups)
        self.buffer.dropped_groups = self.counters.groups_dropped_stale
        self.buffer.dropped_responses = self.counters.rollouts_dropped_stale
        self._resume_path = path
        self._last_checkpoint_step = step
        self.run_dir.keep_metrics_through(step)
        return step

    def run(self) -> RunState:
        """Start the actors, drive the loop to the last step (or a cancel), clean up.

        Signals are handled from the start, so a cancel while the actors start up also ends
        with a `cancelled` record (and no actors left behind).
        """
        resumed_step = self.restore()
        actors: RunActors | None = None
        try:
            with self._signals_request_cancel():
                self._model_dir = resolve_model(self.spec.model)
                check_cluster_resources(self.spec)
                actors = self._start_actors()
                self._report_status("running", actors=self._actor_pids, resumed_from=resumed_step)
                while True:
                    try:
                        self._start(actors, resumed_step)
                        self._loop(actors)
                        self._finish(actors)
                        break
                    except RayActorError as error:  # the learner's: the others are handled
                        if self._cancel:  # being stopped anyway: its last checkpoint stands
                            log.warning("the learner died during the cancel: %s", error)
                            break
                        actors, resumed_step = self._restart_from_checkpoint(actors, error)
            state: RunState = "cancelled" if self._cancel else "succeeded"
            self._report_status(state)
            return state
        except CancelRequested:
            self._report_status("cancelled", error="stopped at once by a second interrupt")
            return "cancelled"
        except Exception as error:
            message = f"{type(error).__name__}: {error}"
            self._report_status(
                "failed", error=f"starting the run: {error}" if actors is None else message
            )
            raise
        finally:
            if actors is not None:
                actors.kill()
            self._plot()

    def _start_actors(self) -> RunActors:
        assert self._model_dir is not None
        actors = start_actors(self.spec, self._model_dir, self.run_dir.path / RATIO_DIR)
        self._actor_pids, self._new_pids = actors.pids(), []
        return actors

    def _start(self, actors: RunActors, resumed_step: int | None) -> None:
        if resumed_step is not None and self._resume_path is not None:
            learner_dir = str(self._resume_path / LEARNER_DIR)
            version = actors.learner.load_checkpoint(learner_dir)
            if version != resumed_step:
                raise RuntimeError(
                    f"checkpoint {self._resume_path} holds learner version {version}, "
                    f"expected {resumed_step}"
                )
            self._offer_weights(actors, version, actors.learner.initial_weights())
        self._idle_workers = list(range(len(actors.generation)))
        self._throughput = _Throughput()

    def _restart_from_checkpoint(
        self, actors: RunActors, error: RayActorError
    ) -> tuple[RunActors, int | None]:
        """The learner died: end this attempt and go on from the last checkpoint (or step 0).

        Everything since that checkpoint is dropped, in flight or buffered, and its prompts are
        issued again, so no rollout is lost and none is trained twice; the metrics records of
        the lost steps are replaced by those of the steps done again.
        """
        allowed = self.spec.pipeline.learner_restarts
        faults = self.counters.faults()
        if allowed == 0:
            raise error
        if faults["learner_restarts"] >= allowed:
            raise FaultBudgetExhausted(
                f"the learner died again after {allowed} restarts "
                f"(pipeline.learner_restarts): {type(error).__name__}: {error}"
            ) from error
        elapsed = self._elapsed()
        actors.kill()
        self._pending.clear()
        self._weights_ref, self._weights_version = None, 0
        resumed_step = self.restore()
        if resumed_step is None:
            self._start_from_scratch()
            self.run_dir.keep_metrics_through(0)
        faults["learner_restarts"] += 1
        for name, value in faults.items():
            setattr(self.counters, name, value)
        self.counters.elapsed_seconds, self._started = elapsed, time.perf_counter()
        log.warning(
            "the learner died (%s); restart %d of %d from %s",
            type(error).__name__,
            faults["learner_restarts"],
            allowed,
            "step 0" if resumed_step is None else f"the checkpoint of step {resumed_step}",
        )
        actors = self._start_actors()
        self._report_status(
            "running",
            actors=self._actor_pids,
            resumed_from=resumed_step if resumed_step is not None else 0,
            learner_restarts=faults["learner_restarts"],
        )
        return actors, resumed_step

    def _signals_request_cancel(self) -> AbstractContextManager[None]:
        """SIGINT/SIGTERM ask for a clean stop; a second one stops at once."""

        def handler(signum: int, frame: FrameType | None) -> None:
            if self._cancel:
                raise CancelRequested
            log.warning("cancel requested (signal %d): finishing the current step", signum)
            self._cancel = True

        return on_stop_signals(handler)

    def cancel(self) -> None:
        """Ask the loop to stop after the current learner step (from another thread)."""
        self._cancel = True

    # --- the loop ---------------------------------------------------------------------------

    def _learner_busy(self) -> bool:
        return any(isinstance(call, LearnerCall) for call in self._pending.values())

    def _loop(self, actors: RunActors) -> None:
        total = self.spec.pipeline.steps
        while self.counters.step < total:
            if self._cancel:
                if not self._learner_busy():
                    return
            else:
                self._dispatch_generation(actors)
                self._dispatch_learner(actors)
            if not self._pending:
                raise RuntimeError("the pipeline stalled: nothing in flight and no batch ready")
            ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=WAIT_SECONDS)
            for ref in ready:
                self._complete(actors, ref, self._pending.pop(ref))
            self._stop_hung_verifiers()
            self._record_pids()

    def _generation_room(self) -> int:
        """How many more groups generation may be asked for now."""
        pipe = self.spec.pipeline
        if pipe.mode == "sync":
            if self._learner_busy():
                return 0
            return pipe.batch_groups - len(self.buffer) - self.buffer.reserved
        if pipe.admission == "capacity":
            return self.buffer.free()
        # A group admitted now is generated with version >= the learner's current one and is
        # trained after the groups admitted before it, so with the total admitted kept within
        # (version + max_staleness + 1) batches, none ages past the bound on the way.
        budget = (self.counters.step + pipe.max_staleness + 1) * pipe.batch_groups
        admitted = self.counters.groups_issued - self.buffer.dropped_groups
        return min(self.buffer.free(), budget - admitted)

    def _dispatch_generation(self, actors: RunActors) -> None:
        gen = self.spec.generation
        while self._idle_workers:
            n = min(gen.prompts_per_batch, self._generation_room())
            if n <= 0:
                return
            prompts = self.prompts.take(n)
            self.buffer.reserve(len(prompts))
            self.counters.groups_issued += len(prompts)
            worker = self._idle_workers.pop(0)
            sampling = SamplingSettings(
                temperature=gen.temperature,
                top_p=gen.top_p,
                top_k=gen.top_k,
                max_new_tokens=gen.max_new_tokens,
                seed=sampling_seed(self.spec.seed, self.counters.generation_calls),
            )
            self.counters.generation_calls += 1
            actor = actors.generation[worker]
            ref = actor.generate.remote(prompts, gen.group_size, sampling)
            self._pending[ref] = GenerationCall(worker, actor, prompts, time.perf_counter())

    def _dispatch_learner(self, actors: RunActors) -> None:
        if self._learner_busy():
            return
        pipe = self.spec.pipeline
        self.buffer.evict_stale(self.counters.step)
        if len(self.buffer) < pipe.batch_groups * (1 + pipe.lead_batches):
            return
        batch = self.buffer.take_batch(pipe.batch_groups, self.counters.step)
        if batch is None:
            return
        refs = actors.learner.step(batch)
        self._pending[refs.metrics] = LearnerCall(refs.weights, time.perf_counter())
        for ref in refs.peers:
            self._pending[ref] = LearnerPeerCall()

    def _complete(self, actors: RunActors, ref: Any, call: PendingCall) -> None:
        try:
            result = ray.get(ref)
        except RayActorError as error:
            if isinstance(call, GenerationCall):
                self._on_generation_lost(actors, call, error)
            elif isinstance(call, ScoringCall):
                self._on_scoring_lost(actors, call, error)
            else:
                raise
            return
        if isinstance(call, GenerationCall):
            self._on_generated(actors, call, result)
        elif isinstance(call, ScoringCall):
            self.buffer.add(result, reserved=len(call.prompts))
        elif isinstance(call, LearnerCall):
            self._on_trained(actors, call, result)

    def _on_generated(
        self, actors: RunActors, call: GenerationCall, groups: list[list[Response]]
    ) -> None:
        self._idle_workers.append(call.worker)
        tokens = sum(len(r.response_token_ids) for group in groups for r in group)
        self.counters.tokens_generated_total += tokens
        self._throughput.tokens += tokens
        self._throughput.batch_seconds.append(time.perf_counter() - call.started)
        verifier = self._next_verifier % len(actors.verifiers)
        self._next_verifier += 1
        self._score(actors, verifier, call.prompts, groups)

    def _score(
        self,
        actors: RunActors,
        verifier: int,
        prompts: list[Prompt],
        groups: list[list[Response]],
        attempt: int = 1,
    ) -> None:
        actor = actors.verifiers[verifier]
        ref = actor.score.remote(list(zip(prompts, groups, strict=True)))
        self._pending[ref] = ScoringCall(
            verifier, actor, prompts, groups, time.perf_counter(), attempt
        )

    # --- faults of generation and verifier actors ---------------------------------------------

    def _on_generation_lost(
        self, actors: RunActors, call: GenerationCall, error: RayActorError
    ) -> None:
        """Replace the dead worker and issue its prompts again (nothing of them was kept)."""
        self._replace(actors, "generation", call.worker, call.actor, error)
        self.prompts.give_back(call.prompts)
        self.buffer.release(len(call.prompts))
        self.counters.groups_issued -= len(call.prompts)
        self._idle_workers.append(call.worker)

    def _on_scoring_lost(self, actors: RunActors, call: ScoringCall, error: RayActorError) -> None:
        """Replace the dead (or hung) verifier and score the batch again, or give up on it."""
        self._replace(actors, "verifier", call.verifier, call.actor, error)
        if call.attempt >= SCORING_ATTEMPTS:
            # The batch itself may be what kills verifiers: it must not take the run with it.
            log.warning(
                "%d groups failed scoring %d times: their responses are marked unverified",
                len(call.groups),
                call.attempt,
            )
            self.counters.unverified_groups += len(call.groups)
            self.buffer.add(_unverified(call), reserved=len(call.prompts))
            return
        self.counters.rescored_groups += len(call.groups)
        self._score(actors, call.verifier, call.prompts, call.groups, call.attempt + 1)

    def _replace(
        self, actors: RunActors, role: str, index: int, dead: Any, error: RayActorError
    ) -> None:
        """Put a new actor at `actors.<role>[index]`, unless `dead` was replaced already."""
        pool = actors.generation if role == "generation" else actors.verifiers
        if pool[index] is not dead:
            return  # several calls failed with the same actor; it was replaced at the first
        c = self.counters
        used = c.generation_replacements + c.verifier_replacements
        allowed = self.spec.pipeline.actor_replacements
        if used >= allowed:
            raise FaultBudgetExhausted(
                f"a {role} actor died after {used} actors were replaced already "
                f"(pipeline.actor_replacements = {allowed}): {type(error).__name__}: {error}"
            ) from error
        log.warning("%s actor %d died (%s): replacing it", role, index, type(error).__name__)
        try:
            ray.kill(dead, no_restart=True)
        except Exception as kill_error:  # already gone, which is what we want
            log.debug("kill %s: %s", dead, kill_error)
        if role == "generation":
            assert self._model_dir is not None
            pool[index] = start_generation_worker(self.spec, self._model_dir)
            c.generation_replacements += 1
            if self._weights_ref is not None:
                pool[index].offer_weights.remote(self._weights_version, [self._weights_ref])
        else:
            pool[index] = start_verifier(self.spec)
            c.verifier_replacements += 1
        # Asked now, read once the actor is up (a vLLM engine takes minutes): see _record_pids.
        pid_ref = pool[index].__ray_call__.remote(lambda _self: os.getpid())
        self._new_pids.append((ROLE_KEYS[role], index, pid_ref))

    def _record_pids(self) -> None:
        """Put the pids of replacement actors that are up into status.json, for operators."""
        if not self._new_pids:
            return
        refs = [ref for _, _, ref in self._new_pids]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if not ready:
            return
        waiting = []
        for key, index, ref in self._new_pids:
            if ref not in ready:
                waiting.append((key, index, ref))
                continue
            # One that died while starting is replaced again when its first call fails.
            with contextlib.suppress(RayActorError):
                self._actor_pids[key][index] = ray.get(ref)
        self._new_pids = waiting
        self.run_dir.update_details(actors=self._actor_pids)

    def _stop_hung_verifiers(self) -> None:
        """Kill a verifier actor whose call has run past `reward.call_timeout_s`.

        Its calls then fail like those of a dead actor, which replaces it. Checks inside an
        actor have their own timeout (reward.timeout_s); this catches the actor itself stuck.
        """
        limit = self.spec.reward.call_timeout_s
        now = time.perf_counter()
        for call in list(self._pending.values()):
            if not isinstance(call, ScoringCall) or now - call.started <= limit:
                continue
            if any(call.actor is hung for hung in self._hung):
                continue
            self._hung.append(call.actor)
            log.warning(
                "verifier actor %d has not answered in %.0f s (reward.call_timeout_s): "
                "taking it for hung",
                call.verifier,
                now - call.started,
            )
            ray.kill(call.actor, no_restart=True)

    def _on_trained(
        self, actors: RunActors, call: LearnerCall, learner_metrics: dict[str, float]
    ) -> None:
        step_seconds = time.perf_counter() - call.started
        self.counters.step += 1
        self._offer_weights(actors, self.counters.step, call.weights_ref)
        self.buffer.evict_stale(self.counters.step)
        self.counters.rollouts_dropped_stale = self.buffer.dropped_responses
        self.counters.groups_dropped_stale = self.buffer.dropped_groups
        self.counters.tokens_trained_total += int(learner_metrics["tokens_trained"])
        totals = {}
        for key in LEARNER_TOTALS:
            total = getattr(self.counters, f"{key}_total") + learner_metrics.get(key, 0.0)
            setattr(self.counters, f"{key}_total", total)
            totals[f"{key}_total"] = total
        record: MetricsRecord = {
            "step": self.counters.step,
            "time": time.time(),
            "wall_seconds": self._elapsed(),
            **learner_metrics,
            "step_seconds": step_seconds,
            **self._throughput.record_and_reset(),
            "tokens_generated_total": self.counters.tokens_generated_total,
            "tokens_trained_total": self.counters.tokens_trained_total,
            "rollouts_dropped_stale": self.counters.rollouts_dropped_stale,
            "groups_dropped_stale": self.counters.groups_dropped_stale,
            "buffer_groups": len(self.buffer),
            **totals,
            **self.counters.faults(),
        }
        every = self.spec.pipeline.checkpoint_every
        checkpointed = bool(every) and self.counters.step % every == 0
        if checkpointed:
            # Before the record: a step recorded at a checkpoint boundary is never lost, even
            # when the learner dies while it is written and the run is then cancelled.
            self._checkpoint(actors)
        for observer in self.observers:
            observer.on_metrics(record)
        if checkpointed:  # the curves are redrawn as often as the run is checkpointed
            self._plot()

    def _offer_weights(self, actors: RunActors, version: int, weights_ref: Any) -> None:
        # Wrapped in a list so Ray hands the worker the ref, not the fetched weights: a busy
        # worker then fetches only the newest version, when its current batch is done.
        for worker in actors.generation:
            worker.offer_weights.remote(version, [weights_ref])
        self._weights_ref, self._weights_version = weights_ref, version

    # --- checkpoints, end of run ------------------------------------------------------------

    def _elapsed(self) -> float:
        return self.counters.elapsed_seconds + time.perf_counter() - self._started

    def _in_flight_prompts(self) -> list[Prompt]:
        prompts: list[Prompt] = []
        for call in self._pending.values():
            if isinstance(call, GenerationCall | ScoringCall):
                prompts.extend(call.prompts)
        return prompts

    def _checkpoint(self, actors: RunActors) -> None:
        """Checkpoint at the current step; the learner must be idle (it is, between steps)."""
        in_flight = self._in_flight_prompts()
        counters = Counters(**asdict(self.counters))
        counters.elapsed_seconds = self._elapsed()
        counters.groups_issued -= len(in_flight)  # counted again when they are re-issued
        state = {
            "counters": asdict(counters),
            "prompt_position": self.prompts.position,
            # Prompts still being generated or scored are re-issued by a resumed run.
            "handed_back": [prompt_to_json(p) for p in [*in_flight, *self.prompts.handed_back]],
            "buffer": [group_to_json(g) for g in self.buffer.groups],
        }

        def write_learner(path: Path) -> None:
            actors.learner.save_checkpoint(str(path))

        root = self.run_dir.checkpoints
        write_checkpoint(root, self.counters.step, state, write_learner)
        prune_checkpoints(root, self.spec.pipeline.keep_checkpoints)
        self._last_checkpoint_step = self.counters.step

    def _finish(self, actors: RunActors) -> None:
        """Final checkpoint (the last step, or where a cancel stopped the run), exported as a
        Hugging Face model to `RUN_DIR/model/`."""
        if self.counters.step > self._last_checkpoint_step:
            self._checkpoint(actors)
        found = latest_checkpoint(self.run_dir.checkpoints)
        if found is not None:
            out = actors.learner.export(str(found[1] / LEARNER_DIR), str(self.run_dir.model))
            log.info("policy of step %d exported to %s", found[0], out)

    def _plot(self) -> None:
        records = self.run_dir.read_metrics(PLOTTED_KEYS)
        if records:
            plot_curves(records, self.run_dir.curves, title=self.spec.name)

    def _report_status(self, state: RunState, error: str | None = None, **details: Any) -> None:
        for observer in self.observers:
            observer.on_status(state, error, step=self.counters.step, **details)


def _unverified(call: ScoringCall) -> list[ScoredGroup]:
    """The call's groups with every response marked as not verified (reward 0)."""
    return [
        ScoredGroup(prompt, [ScoredResponse(r, 0.0, False, VERIFIER_LOST) for r in responses])
        for prompt, responses in zip(call.prompts, call.groups, strict=True)
    ]
