"""The run driver: one event loop over the Ray calls of a run.

    prompts -> generation streams -> verifier actors -> rollout buffer -> learner -> new weights
                     ^                                                                  |
                     +------------- object store offer, or collective broadcast ---------+

Every call in flight is a Ray object ref in `_pending`; the loop waits for whichever finishes
first and reacts to it, so generation, scoring and training overlap (asynchronous mode). Each
generation worker holds up to `generation.prompts_per_batch` groups and hands back every group
as soon as its G responses end (`next_groups`), so the loop scores and buffers groups one poll at
a time, never waiting for the longest response of a batch. In synchronous mode generation is
only asked for while the learner is idle and only for the one batch it will train on next: the
on-policy baseline every async figure is compared with.

The learner is a group of ranks (`services.learner.group`) that answers as one learner. After a
step, the loop publishes the new version in a learner call of its own (`LearnerGroup.publish`,
apart from `train_step`; its offer is awaited with the other calls, and the learner takes no
step meanwhile), and the weights reach generation through `pipeline.weight_transport`:
`object_store` (rank 0 puts them into the object store bucket by bucket, every worker is offered
the buckets and loads them when its swap policy allows) or `collective` (rank 0 broadcasts them
bucket by bucket over a torch.distributed group that every worker's receiving processes joined).
With `pipeline.in_flight_updates` a worker loads them between decoding steps, without waiting
for its responses in flight. At the end of a run (or a cancel) the final checkpoint is exported
as a Hugging Face model to `RUN_DIR/model/`. Checkpoints are written beside the loop
(`CheckpointWriter`): generation and scoring go on meanwhile.

Faults (docs/reliability.md's fault policy): `ActorFaults` (services/pipeline/faults.py) decides
what a failed generation worker or verifier actor costs, and the `ActorSupervisor` replaces it.
With `generation.standby`, a warm standby worker (every version delivered to it, no prompts
admitted) takes a lost generation worker's place at once, and a new standby is built beside the
loop (`_promote`; docs/pipeline.md, warm standby workers).
A learner rank that dies takes the attempt with it: every actor is stopped and the run resumes
from its last checkpoint, up to `pipeline.learner_restarts` times. Nothing is trained twice:
results of the lost attempt are dropped with it. The driver's part of a checkpoint, as written
and as read back, is services/pipeline/driver_state.py's.

With `stability.enabled` the stability guard (services/pipeline/guard.py) judges each step's
record before it is emitted; the record gains the guard's keys (services/metrics.py's GUARD).
An action is logged as a warning; `warn` does nothing more, `cancel` stops the run as `cancel()`
does, with the guard's reason in the final status (`guard`). `rollback` ends the attempt as a
learner death does and starts the next one from the newest checkpoint the guard judged healthy
(from step 0 if none is): checkpoints after it are deleted, every rollout sampled after it is
dropped (counted in `rollouts_rolled_back_total`) and its prompts are issued again, and the run
trains on with `RunSpec.remedied` (the remedy once more per rollback). Past
`stability.max_rollbacks` the run stops and fails as unstable. `pause` checkpoints the step
(marked paused), exports it as a cancel would, ends the attempt (every actor stopped: the run
holds no GPU while it waits; what was in flight is issued again from the checkpoint) and waits
for a resume request from its `ResumeSource`s (the store's `resume` events, the run directory's
`resume.json`; services/pipeline/pause.py), polling every second, or for a cancel, which ends it
`cancelled`. A resume applies its spec patch (`RunSpec.patched`, merged with those before it and
saved with every later checkpoint) and starts the next attempt from the paused checkpoint; the
guard re-arms (`StabilityGuard.resumed`). A driver that resumes from a paused checkpoint (it was
restarted, or its learner died before the next checkpoint) waits again, and takes the request
that answered that pause if there is one already. Each action is reported as a `guard.action`
event to the observers that take events. At the first warning of an episode the guard may ask
for a checkpoint: with `pipeline.checkpoint_every` set and no checkpoint being written, that step
is checkpointed. The guard's state is saved with every checkpoint and taken over on resume, so a
resumed run trains with the remedies of its rollbacks.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import FrameType
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from services.generation.base import GroupRequest, SamplingSettings, StreamedGroups
from services.messages import Prompt, Response
from services.metrics import LEARNER_TOTALS
from services.observers import (
    AlertSource,
    EventObserver,
    MetricsRecord,
    ResumeRequest,
    ResumeSource,
    RewindObserver,
    RunObserver,
    RunState,
)
from services.pipeline.actors import RunActors, check_cluster_resources, start_actors
from services.pipeline.buffer import RolloutBuffer
from services.pipeline.calls import (
    CancelRequested,
    Counters,
    GenerationFailed,
    LearnerCall,
    LearnerPeerCall,
    PendingCall,
    PingCall,
    PollCall,
    ScoringCall,
    StartCall,
    SubmitCall,
    Throughput,
    sampling_seed,
)
from services.pipeline.checkpoint_writer import CheckpointWriter
from services.pipeline.checkpoints import (
    LEARNER_DIR,
    checkpoint_at,
    checkpoint_name,
    discard_checkpoints_after,
    latest_checkpoint,
    read_driver_state,
)
from services.pipeline.curves import CurveDrawer
from services.pipeline.driver_state import (
    capture_driver_state,
    in_flight_prompts,
    restore_driver_state,
)
from services.pipeline.elastic import ElasticPool
from services.pipeline.evaluation import Evaluator
from services.pipeline.faults import ActorFaults
from services.pipeline.guard import GuardDecision, StabilityGuard
from services.pipeline.held_out import held_out_prompts
from services.pipeline.outputs import EVAL_FILE, RunDirectory, json_safe
from services.pipeline.pause import ACTION_EVENT, PAUSED_EVENT, REFUSED_EVENT, RESUMED_EVENT
from services.pipeline.prompts import PromptStream, chats_strings
from services.pipeline.signals import on_stop_signals
from services.pipeline.staleness import StalenessController
from services.pipeline.streams import WorkerStream
from services.pipeline.supervisor import ActorSupervisor, FaultBudgetExhausted
from services.pipeline.weight_sync import WeightSync
from services.spec import RunSpec, merge_patches
from services.tasks.models import has_chat_template, resolve_model
from services.tools.metrics import tool_metrics

log = logging.getLogger(__name__)

RATIO_DIR = "ratios"  # the learner's log-ratio files (learner.record_ratios_every)
WAIT_SECONDS = 0.5  # longest the loop sleeps without news (it then checks for a cancel)
CHECKPOINT_POLL_SECONDS = 0.05  # how often the loop looks at a checkpoint being written
FINAL_EVAL_TIMEOUT_S = 1800.0  # a final evaluation call longer than this is given up (logged)
POLL_SECONDS = 5.0  # longest a worker's next_groups waits before answering with nothing
PAUSE_POLL_SECONDS = 1.0  # how often a paused run asks its sources for a resume request
# Events of a lost generation worker's place: a standby took it; the worker in its place
# returned its first group (with the seconds since the loss, and how the place was taken).
PROMOTED_EVENT = "generation.standby_promoted"
RESTORED_EVENT = "generation.worker_restored"

__all__ = ["FaultBudgetExhausted", "GenerationFailed", "RunDriver"]


class RollbackRequested(Exception):
    """The stability guard decided a rollback: the loop unwinds to `RunDriver.run`, which
    starts the next attempt from the guard's healthy checkpoint."""

    def __init__(self, decision: GuardDecision) -> None:
        super().__init__(decision.message)
        self.decision = decision


class RunDriver:
    """Drives one run to `spec.pipeline.steps` learner steps, reporting to `observers`."""

    def __init__(
        self, spec: RunSpec, run_dir: RunDirectory, observers: Sequence[RunObserver]
    ) -> None:
        self.submitted_spec = spec  # as submitted; `spec` is it with the rollbacks' remedies
        self.spec = spec
        self.run_dir = run_dir
        self.observers = [run_dir, *observers]
        self._pending: dict[Any, PendingCall] = {}
        self._streams: list[WorkerStream] = []
        self._next_verifier = 0
        self._throughput = Throughput()
        self._started = time.perf_counter()
        self._cancel = False
        self._model_dir: Path | None = None
        self._checkpoints = CheckpointWriter()
        self._curves = CurveDrawer(run_dir.path, spec.name)
        self._held_record: MetricsRecord | None = None  # waits for its step's checkpoint
        self._records_after_checkpoint: list[MetricsRecord] = []  # steps taken while it is
        self._publish_due = False  # a step finished: its version is published next
        self.supervisor = ActorSupervisor(
            spec,
            lambda: self.counters,
            lambda: self._model_dir,
            lambda pids: self.run_dir.update_details(actors=pids),
        )
        self.faults = ActorFaults(spec.generation, self.supervisor)
        self.weights = WeightSync(spec.pipeline.weight_transport, spec.overlaps_publish)
        self.elastic = ElasticPool(
            spec, self.supervisor, self.weights, lambda: self._model_dir, self._report_event
        )
        self.evals = (
            Evaluator(spec.eval, spec.generation, spec.seed, run_dir.path / EVAL_FILE)
            if spec.eval is not None
            else None
        )
        self._final_eval: dict[str, float] | None = None
        self._guard_stop: dict[str, Any] | None = None  # the guard's cancel, for the status
        self._pause_request: GuardDecision | None = None  # the guard's pause, until carried out
        self._wake = threading.Event()  # set by cancel(): a paused run stops waiting
        self._exported_step: int | None = None  # the step this driver exported last
        self._start_from_scratch()

    # --- lifecycle --------------------------------------------------------------------------

    def _start_from_scratch(self) -> None:
        """Step 0: no progress, no buffered groups, the prompt stream from its beginning."""
        self.counters = Counters()
        pipe = self.spec.pipeline
        self.buffer = RolloutBuffer(pipe.buffer_groups, pipe.max_staleness)
        self._set_staleness(None)
        self.prompts = PromptStream(self.spec.task, self.spec.seed)
        self._resume_path: Path | None = None
        self._last_checkpoint_step = -1
        stability = self.spec.stability
        self.guard = StabilityGuard(stability) if stability.enabled else None
        self._spec_patch: dict[str, Any] = {}  # the resumes' patches, merged
        self._paused: dict[str, Any] | None = None  # the pause the run waits in (restored)

    def restore(self, at_step: int | None = None) -> int | None:
        """Load the driver state of the checkpoint of `at_step` (default: the newest complete
        one); its step, or None if there is none."""
        if at_step is None:
            found = latest_checkpoint(self.run_dir.checkpoints)
            if found is None:
                return None
            step, path = found
        else:
            step, path = at_step, checkpoint_at(self.run_dir.checkpoints, at_step)
        saved = read_driver_state(path)
        stability = self.submitted_spec.stability
        guard = None
        if stability.enabled:  # a checkpoint of a run without the guard starts it afresh
            found_guard = saved.get("guard")
            guard = (
                StabilityGuard(stability)
                if found_guard is None
                else StabilityGuard.from_state(stability, found_guard)
            )
        # The run trains on as its rollbacks (each one's remedy) and resumes (their patches)
        # left it, in this attempt too.
        self.guard = guard
        self._spec_patch = dict(saved.get("spec_patch") or {})
        self.spec = self._effective_spec()
        state = restore_driver_state(self.spec, saved)
        self.counters, self.prompts, self.buffer = state.counters, state.prompts, state.buffer
        self._paused = state.paused  # a pause's checkpoint: the run waits for its resume first
        self._resume_path = path
        self._last_checkpoint_step = step
        # The checkpointed step's record is emitted only once its checkpoint is written: a driver
        # killed in between left a checkpoint whose step one keeper or all of them lack (it
        # reaches them one after another). The keepers take it with the rewind; the observers
        # that keep nothing hear it only where the run directory lacked it, so at most once.
        held = state.record
        unrecorded = all(r["step"] != step for r in self.run_dir.read_metrics(["step"]))
        self._rewind_metrics(step, held)
        if held is not None and unrecorded:
            for observer in self.observers:
                if not isinstance(observer, RewindObserver):
                    observer.on_metrics(held)
        return step

    def _effective_spec(self, patch: dict[str, Any] | None = None) -> RunSpec:
        """The submitted spec with the remedies of the guard's rollbacks and the resumes'
        patches (`patch` instead of those in force, where given)."""
        rollbacks = 0 if self.guard is None else self.guard.rollbacks
        patch = self._spec_patch if patch is None else patch
        return self.submitted_spec.remedied(rollbacks).patched(patch)

    def run(self) -> RunState:
        """Start the actors, drive the loop to the last step (or a cancel), clean up.

        Signals are handled from the start, so a cancel while the actors start up also ends
        with a `cancelled` record (and no actors left behind).
        """
        resumed_step = self.restore()
        actors: RunActors | None = None
        try:
            with self._signals_request_cancel():
                self._model_dir = resolve_model(self.spec.model, self.spec.model_revision)
                self.prompts.chat = chats_strings(
                    self.spec.task, has_chat_template(self._model_dir)
                )
                if self.evals is not None:
                    self.evals.prepare(self._held_out())
                check_cluster_resources(self.spec)
                # Resumed from a pause's checkpoint: it waits (with no actor) for its resume.
                if self._paused is None or self._resume_paused(resumed_step or 0):
                    actors = self._start_actors()
                    self._report_status(
                        "running", actors=self.supervisor.pids, resumed_from=resumed_step
                    )
                while actors is not None:
                    try:
                        self._start(actors, resumed_step)
                        self._loop(actors)
                        if self._pause_request is not None:
                            restarted = self._pause(actors)
                            if restarted is None:  # cancelled while paused
                                break
                            actors, resumed_step = restarted
                            continue
                        self._finish(actors)
                        break
                    except RayActorError as error:  # the learner's: the others are handled
                        self._checkpoints.abandon()
                        if self._cancel:  # being stopped anyway: its last checkpoint stands
                            log.warning("the learner died during the cancel: %s", error)
                            break
                        restarted = self._restart_from_checkpoint(actors, error)
                        if restarted is None:  # cancelled while paused
                            break
                        actors, resumed_step = restarted
                    except RollbackRequested as rollback:
                        self._checkpoints.abandon()
                        actors, resumed_step = self._roll_back(actors, rollback.decision)
            state, details = self._final_state()
            self._report_status(state, **details)
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
            self._checkpoints.close()
            if actors is not None:
                actors.kill()
            self._curves.redraw()
            self._curves.finish()

    def _final_state(self) -> tuple[RunState, dict[str, Any]]:
        """How the run ended, with the details its final status reports."""
        state: RunState = "cancelled" if self._cancel else "succeeded"
        details: dict[str, Any] = {}
        if self._final_eval is not None:
            details["final_eval"] = self._final_eval
        if self._cancel and self._paused is not None:  # cancelled while paused
            details["error"] = f"cancelled while paused: {self._paused['message']}"
            details["guard"] = self._paused
            step = self._last_checkpoint_step
            if self._exported_step != step:  # paused by an earlier driver
                log.warning(
                    "the checkpoint of step %d was exported when the run paused, if it got "
                    "that far; `kpo export %s` exports it again",
                    step,
                    self.run_dir.path,
                )
        if self._cancel and self._guard_stop is not None:
            details["error"] = f"stability guard: {self._guard_stop['message']}"
            details["guard"] = self._guard_stop
            if self._guard_stop["action"] == "stop_unstable":
                state = "failed"  # unstable: its rollbacks did not make it stable
        return state, details

    def _start_actors(self) -> RunActors:
        assert self._model_dir is not None
        actors = start_actors(self.spec, self._model_dir, self.run_dir.path / RATIO_DIR)
        self.supervisor.pids = actors.pids()
        return actors

    def _start(self, actors: RunActors, resumed_step: int | None) -> None:
        self._pending.clear()
        self._resume_staleness()
        # The standby streams come after the serving ones: stream `n + k` is `actors.standby[k]`.
        self._streams = [WorkerStream(actor) for actor in actors.generation] + [
            WorkerStream(actor, standby=True) for actor in actors.standby
        ]
        self.weights.connect(actors, self._streams)
        self.elastic.reset(self.spec)
        if resumed_step is not None and self._resume_path is not None:
            learner_dir = str(self._resume_path / LEARNER_DIR)
            version = actors.learner.load_checkpoint(learner_dir)
            if version != resumed_step:
                raise RuntimeError(
                    f"checkpoint {self._resume_path} holds learner version {version}, "
                    f"expected {resumed_step}"
                )
            # Every worker holds the weights on disk: none takes a prompt until it acknowledged.
            self.weights.publish(actors, version)
        for index in range(len(self._streams)):
            self._poll(actors, index)
        self._throughput = Throughput()

    def _restart_from_checkpoint(
        self, actors: RunActors, error: RayActorError
    ) -> tuple[RunActors, int | None] | None:
        """The learner died: end this attempt and go on from the last checkpoint (or step 0).

        Everything since that checkpoint is dropped, in flight or buffered, and its prompts are
        issued again, so no rollout is lost and none is trained twice; the metrics records of
        the lost steps are replaced by those of the steps done again. A pause's checkpoint
        waits for its resume first (None: the run was cancelled meanwhile).
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
        faults["learner_restarts"] += 1
        resumed_step = self._end_attempt(actors, None, faults)
        log.warning(
            "the learner died (%s); restart %d of %d from %s",
            type(error).__name__,
            faults["learner_restarts"],
            allowed,
            "step 0" if resumed_step is None else f"the checkpoint of step {resumed_step}",
        )
        if self._paused is not None and not self._resume_paused(resumed_step or 0):
            return None
        actors = self._start_actors()
        self._report_status(
            "running",
            actors=self.supervisor.pids,
            resumed_from=resumed_step if resumed_step is not None else 0,
            learner_restarts=faults["learner_restarts"],
        )
        return actors, resumed_step

    def _end_attempt(
        self, actors: RunActors, at_step: int | None, carried: dict[str, int]
    ) -> int | None:
        """Stop this attempt's actors and drop what it had in flight, then restore the
        checkpoint of `at_step` (default: the newest; step 0 where there is none) with the run
        totals in `carried` kept as they are now. Returns the step restored (None: step 0)."""
        elapsed = self._elapsed()
        actors.kill()
        self._pending.clear()
        self._pause_request = None
        self._held_record = None
        self._records_after_checkpoint.clear()
        self._publish_due = False
        self.weights.reset()
        if self.evals is not None:
            self.evals.reset()
        resumed_step = self.restore(at_step)
        if resumed_step is None:
            self._start_from_scratch()
            self._rewind_metrics(0, None)
        for name, value in carried.items():
            setattr(self.counters, name, value)
        self.counters.elapsed_seconds, self._started = elapsed, time.perf_counter()
        return resumed_step

    def _guard_totals(self) -> dict[str, int]:
        """The run totals a guard's (or an alert's) rollback or pause keeps as they are now,
        over the restored checkpoint's: the faults survived and the guard's own counts."""
        return {
            **self.counters.faults(),
            "guard_actions_total": self.counters.guard_actions_total,
            "rollouts_rolled_back_total": self.counters.rollouts_rolled_back_total,
        }

    def _roll_back(
        self, actors: RunActors, decision: GuardDecision
    ) -> tuple[RunActors, int | None]:
        """The guard decided a rollback: end this attempt and go on from its healthy
        checkpoint (step 0 where none is healthy), with the remedy applied once more."""
        target = decision.rollback_to
        issued = self.counters.groups_issued
        discarded = discard_checkpoints_after(self.run_dir.checkpoints, target or 0)
        resumed_step = self._end_attempt(actors, target, self._guard_totals())
        if resumed_step is None:  # the guard of step 0 starts afresh: it counts rollbacks on
            self.guard = StabilityGuard(self.submitted_spec.stability)
        assert self.guard is not None  # a rollback is the guard's
        self.guard.rolled_back(resumed_step, decision.rollbacks)
        self.spec = self._effective_spec()  # its staleness bound: `_start`'s
        # Every group asked of generation since that checkpoint is dropped: trained on,
        # buffered or in flight. Their prompts come again from the restored stream.
        dropped = (issued - self.counters.groups_issued) * self.spec.generation.group_size
        self.counters.rollouts_rolled_back_total += dropped
        log.warning(
            "stability guard: rollback %d of %d to %s (checkpoints %s deleted); %d rollouts "
            "sampled after it dropped; training on with lr %.6g, max_staleness %d, "
            "estimator %s",
            decision.rollbacks,
            self.spec.stability.max_rollbacks,
            "step 0" if resumed_step is None else f"the checkpoint of step {resumed_step}",
            discarded or "none",
            dropped,
            self.spec.learner.lr,
            self.spec.pipeline.max_staleness,
            self.spec.algorithm.estimator.name,
        )
        actors = self._start_actors()
        self._report_status(
            "running",
            actors=self.supervisor.pids,
            resumed_from=resumed_step if resumed_step is not None else 0,
            guard=self._guard_details(decision),
        )
        return actors, resumed_step

    def _pause(self, actors: RunActors) -> tuple[RunActors, int | None] | None:
        """The guard decided a pause at the step just trained: checkpoint it (marked paused)
        and export it as a cancel would, end the attempt, wait for the resume request and start
        the next attempt from that checkpoint with its patch. None: cancelled while paused."""
        self._checkpoint_now(actors)
        step = self._last_checkpoint_step
        self._export(actors, step)  # a cancel while paused leaves this step's model
        self._end_attempt(actors, step, self._guard_totals())
        paused = self._paused  # as the checkpoint says
        if not self._resume_paused(step):
            return None
        actors = self._start_actors()
        self._report_status("running", actors=self.supervisor.pids, resumed_from=step, guard=paused)
        return actors, step

    def _resume_paused(self, step: int) -> bool:
        """The run is paused at the checkpoint of `step` (restored; no actor runs): announce
        it, wait for a resume request and apply it. False: cancelled while paused."""
        assert self._paused is not None
        paused = {**self._paused, "checkpoint": step}
        if self._cancel:
            return False
        taken = self._take_resume(step)
        if taken is None:
            log.warning(
                "stability guard: paused at step %d, no actor running (%s); waiting for a "
                "resume: POST /v1/runs/{id}/resume, or %s (kpo resume-paused)",
                step,
                paused["message"],
                self.run_dir.path / "resume.json",
            )
            self.run_dir.update_details(paused=paused)
            self._report_event(PAUSED_EVENT, paused)
            while taken is None:
                self._wake.wait(PAUSE_POLL_SECONDS)
                if self._cancel:
                    return False
                taken = self._take_resume(step)
        request, spec, merged = taken
        self._spec_patch, self.spec = merged, spec  # its staleness bound: `_start`'s
        if self.guard is not None:
            self.guard.resumed(step)
        self._paused = None
        self.run_dir.update_details(paused=None)
        self._started = time.perf_counter()  # the time paused is no time of the run's
        self._report_event(
            RESUMED_EVENT,
            {
                "checkpoint": step,
                "request": request.request_id,
                "requested_at": request.requested_at,
                "spec_patch": request.spec_patch,
                "in_force": merged,
            },
        )
        log.warning(
            "stability guard: resumed from the pause at step %d; training on with lr %.6g, "
            "max_staleness %d, estimator %s",
            step,
            spec.learner.lr,
            spec.pipeline.max_staleness,
            spec.algorithm.estimator.name,
        )
        return True

    def _take_resume(self, step: int) -> tuple[ResumeRequest, RunSpec, dict[str, Any]] | None:
        """The first resume request of the pause at `step` that one of the observers holds
        and that makes a valid spec: it, that spec and the patches in force with it. One that
        does not is refused (logged, reported, and its source told)."""
        refused: set[str] = set()
        for source in self.observers:
            if not isinstance(source, ResumeSource):
                continue
            while (request := source.take_resume(step)) is not None:
                if request.request_id in refused:  # a source that holds on to it
                    break
                try:
                    if request.problem is not None:
                        raise ValueError(request.problem)
                    merged = merge_patches(self._spec_patch, request.spec_patch)
                    return request, self._effective_spec(merged), merged
                except ValueError as error:  # SpecPatchError and ValidationError included
                    reason = str(error)
                    log.error("resume request %s refused: %s", request.request_id, reason)
                    self._report_event(
                        REFUSED_EVENT, {"request": request.request_id, "reason": reason}
                    )
                    source.refuse(request, reason)
                    refused.add(request.request_id)
        return None

    def _rewind_metrics(self, step: int, record: MetricsRecord | None) -> None:
        """Tell every observer that keeps records (the run directory, the store) that the
        steps after `step` (whose own record is `record`) are trained again: their new records
        replace what it holds."""
        for observer in self.observers:
            if isinstance(observer, RewindObserver):
                observer.on_metrics_rewound(step, record)

    def _report_event(self, kind: str, data: dict[str, Any]) -> None:
        safe = json_safe(data)
        for observer in self.observers:
            if isinstance(observer, EventObserver):
                observer.on_event(kind, safe)

    def _signals_request_cancel(self) -> AbstractContextManager[None]:
        """SIGINT/SIGTERM ask for a clean stop; a second one stops at once."""

        def handler(signum: int, frame: FrameType | None) -> None:
            if self._cancel:
                raise CancelRequested
            log.warning("cancel requested (signal %d): finishing the current step", signum)
            self._cancel = True

        return on_stop_signals(handler)

    def cancel(self) -> None:
        """Ask the loop to stop after the current learner step (from another thread); a paused
        run stops waiting at once."""
        self._cancel = True
        self._wake.set()

    # --- the loop ---------------------------------------------------------------------------

    def _learner_busy(self) -> bool:
        """The learner is stepping, writing its part of a checkpoint (a checkpoint still being
        hashed and flushed holds it only before the next checkpoint), its new version waits to
        be published, or it is taken by weight delivery (publishing, a collective group being
        formed, a send in flight or owed)."""
        return self._learner_stepping() or self._publish_due or self.weights.sending

    def _dispatch_publish(self, actors: RunActors) -> None:
        """Publish the version the learner just trained (the learner takes no step before)."""
        if self._publish_due:
            self._publish_due = False
            self.weights.publish(actors, self.counters.step)

    def _learner_stepping(self) -> bool:
        every = self.spec.pipeline.checkpoint_every
        return (
            self._checkpoints.holds_learner
            or (self._checkpoints.busy and bool(every) and (self.counters.step + 1) % every == 0)
            or any(isinstance(call, LearnerCall) for call in self._pending.values())
        )

    def _loop(self, actors: RunActors) -> None:
        """Drive the calls to the last step, or until a cancel (the learner idle) or the
        guard's pause (at once: `run` carries it out)."""
        total = self.spec.pipeline.steps
        while self._pause_request is None and (self.counters.step < total or self._learner_busy()):
            if self._checkpoints.done:
                self._on_checkpointed()
                continue
            self._curves.poll()
            self._dispatch_publish(actors)
            self.weights.regroup_if_needed(actors, self._learner_stepping())
            if self._cancel:
                if not self._learner_busy():
                    return
            elif self.counters.step < total:
                self._dispatch_generation(actors)
                self._dispatch_learner(actors)
                self._observe_pool(actors)
            refs = list(self._pending) + self.weights.pending_refs()
            if self.evals is not None:
                refs += self.evals.pending_refs()
            if not refs and not self._checkpoints.busy:
                raise RuntimeError("the pipeline stalled: nothing in flight and no batch ready")
            timeout = CHECKPOINT_POLL_SECONDS if self._checkpoints.busy else WAIT_SECONDS
            ready, _ = ray.wait(refs, num_returns=1, timeout=timeout) if refs else ([], [])
            for ref in ready:
                self._on_ready(actors, ref)
            self._stop_hung(actors)
            self.supervisor.record_pids()

    def _observe_pool(self, actors: RunActors) -> None:
        """An elastic pool's sample (services/pipeline/elastic.py): the learner starved (idle,
        no batch ready), or backed up (stepping, a whole batch waiting, admission closed). A
        learner held by weight delivery is neither: more or fewer workers would not change it."""
        waiting = len(self.buffer) >= self.spec.pipeline.batch_groups
        self.elastic.observe(
            actors,
            self._streams,
            self._pending,
            lambda index: self._poll(actors, index),
            starved=not self._learner_busy(),
            backed_up=self._learner_stepping() and waiting and self._generation_room() <= 0,
        )

    def _on_ready(self, actors: RunActors, ref: Any) -> None:
        """React to one finished call: the driver's own, or a weight delivery."""
        if ref in self._pending:
            self._complete(actors, ref, self._pending.pop(ref))
        elif self.evals is not None and self.evals.owns(ref):
            self.evals.complete(ref, actors.verifiers)
        else:
            self.weights.complete(actors, ref, self._on_worker_failed)

    def _generation_room(self) -> int:
        """How many more groups generation may be asked for now."""
        pipe = self.spec.pipeline
        if pipe.mode == "sync":
            if self._learner_busy():
                return 0
            return pipe.batch_groups - len(self.buffer) - self.buffer.reserved
        if pipe.admission == "capacity":
            return self.buffer.free()
        # A group admitted now is generated with version >= the one last delivered (a worker
        # takes no prompt before it acknowledged it) and is trained after the groups admitted
        # before it, so with the total admitted kept within (version + max_staleness + 1)
        # batches, none ages past the bound on the way. The learner's step may be ahead of it
        # while its publish is gathered. The bound is the buffer's: max_staleness, or the
        # adaptive bound in force (groups admitted under a looser one may then be dropped).
        version = self.weights.delivered_version
        budget = (version + self.buffer.max_staleness + 1) * pipe.batch_groups
        dropped = self.buffer.dropped_groups + self.counters.groups_dropped_invalid
        admitted = self.counters.groups_issued - dropped
        return min(self.buffer.free(), budget - admitted)

    def _sampling(self) -> SamplingSettings:
        gen = self.spec.generation
        seed = sampling_seed(self.spec.seed, self.counters.generation_calls)
        self.counters.generation_calls += 1
        return SamplingSettings(
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k,
            min_p=gen.min_p,
            max_new_tokens=gen.max_new_tokens,
            seed=seed,
            replay_max_kept=self.spec.replay_max_kept,
        )

    def _dispatch_generation(self, actors: RunActors) -> None:
        gen = self.spec.generation
        for index, stream in enumerate(self._streams):
            if stream.standby:  # held back, at the current version, for a lost worker's place
                continue
            n = min(stream.room(gen.prompts_per_batch, gen.streaming), self._generation_room())
            if n <= 0:
                continue
            prompts = self.prompts.take(n)
            self.buffer.reserve(len(prompts))
            self.counters.groups_issued += len(prompts)
            requests = [GroupRequest(p, gen.group_size, self._sampling()) for p in prompts]
            stream.submitted(prompts)
            ref = stream.actor.submit.remote(requests)
            self._pending[ref] = SubmitCall(index, stream.actor)

    def _poll(self, actors: RunActors, index: int) -> None:
        actor = self._streams[index].actor
        self._pending[actor.next_groups.remote(POLL_SECONDS)] = PollCall(index, actor)

    def _dispatch_learner(self, actors: RunActors) -> None:
        if self._learner_busy() or self.counters.step >= self.spec.pipeline.steps:
            return
        pipe = self.spec.pipeline
        self.buffer.evict_stale(self.counters.step)
        if len(self.buffer) < pipe.batch_groups * (1 + pipe.lead_batches):
            return
        batch = self.buffer.take_batch(pipe.batch_groups, self.counters.step)
        if batch is None:
            return
        responses = [r.response for group in batch for r in group.responses]
        spans = [response.version_span for response in responses]
        tools = tool_metrics(responses) if self.spec.tools.enabled else {}
        refs = actors.learner.train_step(batch)
        self._pending[refs.metrics] = LearnerCall(time.perf_counter(), spans, tools)
        for ref in refs.peers:
            self._pending[ref] = LearnerPeerCall()

    def _complete(self, actors: RunActors, ref: Any, call: PendingCall) -> None:
        try:
            result = ray.get(ref)
        except (RayActorError, RayTaskError) as error:
            if isinstance(call, SubmitCall | PollCall | PingCall | StartCall):
                self._on_worker_failed(actors, call.worker, call.actor, error)
            elif isinstance(call, ScoringCall):
                self._on_scoring_failed(actors, call, error)
            else:
                raise  # the learner's: its death ends the attempt (see run), its error the run
            return
        if isinstance(call, PollCall):
            self._on_generated(actors, call, result)
        elif isinstance(call, ScoringCall):
            self.buffer.add(result, reserved=len(call.prompts))
        elif isinstance(call, LearnerCall):
            self._on_trained(actors, call, result)
        elif isinstance(call, PingCall) and (index := self._index_of(call.actor)) is not None:
            # It answers: its delivery waits on the weight group, not on it.
            self._streams[index].last_progress = time.perf_counter()
        elif isinstance(call, StartCall) and (index := self._index_of(call.actor)) is not None:
            self._streams[index].up = True

    def _index_of(self, actor: Any) -> int | None:
        """Where `actor`'s stream is now (None: it was replaced). Looked up at each answer, not
        taken from the call: a promoted standby answers a poll it was sent as a standby."""
        return next((i for i, s in enumerate(self._streams) if s.actor is actor), None)

    def _serving(self) -> list[Any]:
        """The workers that take prompts (not the standby ones)."""
        return [stream.actor for stream in self._streams if not stream.standby]

    def _on_generated(self, actors: RunActors, call: PollCall, result: StreamedGroups) -> None:
        index = self._index_of(call.actor)
        if index is None:
            return  # the answer of an actor replaced meanwhile
        stream = self._streams[index]
        stream.up = True
        self._poll(actors, index)
        for refusal in result.refused:
            self.faults.drop_refused(stream, refusal, self.counters, self.buffer)
        groups = result.groups
        if not groups:
            return
        submitted = {pid: at for pid, (_, at) in stream.outstanding.items()}
        now = time.perf_counter()
        prompts = stream.returned(groups)
        if stream.took_over is not None:
            self._report_restored(index, stream.took_over, now)
            stream.took_over = None
        tokens = sum(len(r.response_token_ids) for group in groups for r in group)
        self.counters.tokens_generated_total += tokens
        self._throughput.tokens += tokens
        self._throughput.group_seconds.extend(now - submitted[p.prompt_id] for p in prompts)
        self.faults.generated(prompts)
        verifier = self._next_verifier % len(actors.verifiers)
        self._next_verifier += 1
        self._score(actors, verifier, prompts, groups)

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

    # --- faults of generation and verifier actors (their rules: services/pipeline/faults.py) ---

    def _on_worker_failed(
        self, actors: RunActors, index: int, actor: Any, error: BaseException
    ) -> None:
        """A worker died, raised or hung: a ready standby takes its place, else it is replaced
        (a standby that fails is replaced by a new standby); its prompts are issued again.

        `index` is where the failed call was made; the actor's stream may have moved since (a
        promoted standby), so it is looked up again."""
        found = self._index_of(actor)
        if found is None:
            return  # this actor was replaced at an earlier failed call
        index, stream, lost_at = found, self._streams[found], time.perf_counter()
        prompts = stream.take_all()
        self.faults.charge(index, prompts, error)  # a prompt's second strike fails the run
        standby = None if stream.standby else self._ready_standby()
        if standby is not None:
            self._promote(actors, index, standby, error, lost_at)
        else:
            self._replace(actors, index, error, lost_at)
        self.prompts.give_back(prompts)
        self.buffer.release(len(prompts))
        self.counters.groups_issued -= len(prompts)

    def _ready_standby(self) -> int | None:
        """The stream index of a standby that may take a lost worker's place now: one that
        holds the current version (all its deliveries acknowledged), else one up (its model
        loaded) whose delivery is still on its way: it is ready at its acknowledgement, long
        before a new worker would be. None: no standby, or none up yet (the lost worker is then
        replaced as without standby, and a standby still being built stays one)."""
        joined = [i for i, s in enumerate(self._streams) if s.standby and s.up and s.joined]
        ready = [i for i in joined if self._streams[i].ready]
        candidates = ready or joined
        return candidates[0] if candidates else None

    def _replace(self, actors: RunActors, index: int, error: BaseException, lost_at: float) -> None:
        """Today's path: a new actor at `index`, brought to the current version before it takes
        prompts (a model load, then a weight delivery)."""
        stream = self._streams[index]
        n = len(actors.generation)
        role, slot = ("standby", index - n) if stream.standby else ("generation", index)
        replacement = self.supervisor.replace(actors, role, slot, stream.actor, error)
        if replacement is None:
            return
        took_over = None if stream.standby else (lost_at, "replacement")
        self._streams[index] = WorkerStream(
            replacement, joined=False, standby=stream.standby, up=False, took_over=took_over
        )
        self.weights.on_replaced(actors, index, self._streams[index])
        self._poll(actors, index)
        self._watch_start(index)

    def _promote(
        self, actors: RunActors, index: int, standby: int, error: BaseException, lost_at: float
    ) -> None:
        """Standby stream `standby` takes the place of the lost worker at `index`: its poll in
        flight goes on (answered at its new place), so it takes prompts as soon as it is ready,
        with no model load and no delivery to wait for. A new standby is started at its place
        and brought to the current version as a replacement is."""
        slot = standby - len(actors.generation)
        dead = self._streams[index].actor
        fresh = self.supervisor.promote(actors, index, slot, dead, error)
        if fresh is None:
            return
        promoted = self._streams[standby]
        promoted.standby, promoted.took_over = False, (lost_at, "standby")
        new = WorkerStream(fresh, joined=False, standby=True, up=False)
        self._streams[index], self._streams[standby] = promoted, new
        self.weights.on_promoted(actors, index, standby, promoted, new)
        self._poll(actors, standby)
        self._watch_start(standby)
        details: dict[str, Any] = {
            "worker": index,
            "standby": slot,
            # The newest version delivered to it (0: none since the run's start, the weights
            # it loaded from disk), and whether it acknowledged it (else it is ready then).
            "version": max(promoted.newest_delivered, 0),
            "ready": promoted.ready,
            "error": type(error).__name__,
        }
        log.warning("standby %d took generation worker %d's place (%s)", slot, index, details)
        self._report_event(PROMOTED_EVENT, details)

    def _watch_start(self, index: int) -> None:
        """Learn as soon as the worker just started at `index` is up (its poll answers only
        once it has groups, or POLL_SECONDS after it is up)."""
        actor = self._streams[index].actor
        # Ray's own no-op call: any actor has it, whatever it is asked later.
        self._pending[actor.__ray_call__.remote(lambda _self: None)] = StartCall(index, actor)

    def _report_restored(self, index: int, took_over: tuple[float, str], now: float) -> None:
        """The first group of the worker that took a lost one's place: the time from the loss
        to it is the generation the run went without at that place."""
        lost_at, via = took_over
        seconds = now - lost_at
        log.info(
            "generation worker %d serving again %.2f s after the loss (%s)", index, seconds, via
        )
        self._report_event(RESTORED_EVENT, {"worker": index, "via": via, "seconds": seconds})

    def _on_scoring_failed(
        self, actors: RunActors, call: ScoringCall, error: RayActorError | RayTaskError
    ) -> None:
        """Score the groups of a failed verifier call again where the fault rules say so."""
        verifier = self.faults.scoring_failed(actors, call, error, self.counters, self.buffer)
        if verifier is not None:
            self._score(actors, verifier, call.prompts, call.groups, call.attempt + 1)

    def _stop_hung(self, actors: RunActors) -> None:
        """Kill the actors taken for hung; wait on the pings of workers that may be blocked."""
        self._pending.update(self.faults.stop_hung(self._pending.values(), self._streams))

    # --- learner steps, weights, checkpoints ---------------------------------------------------

    def _on_trained(
        self, actors: RunActors, call: LearnerCall, learner_metrics: dict[str, float]
    ) -> None:
        step_seconds = time.perf_counter() - call.started
        self.counters.step += 1
        self._publish_due = True  # by the loop, in a learner call of its own
        self.buffer.evict_stale(self.counters.step)
        self.counters.rollouts_dropped_stale = self.buffer.dropped_responses
        self.counters.groups_dropped_stale = self.buffer.dropped_groups
        self.counters.tokens_trained_total += int(learner_metrics["tokens_trained"])
        totals = {}
        for key in LEARNER_TOTALS:
            total = getattr(self.counters, f"{key}_total") + learner_metrics.get(key, 0.0)
            setattr(self.counters, f"{key}_total", total)
            totals[f"{key}_total"] = total
        spans = call.version_spans or [1]
        record: MetricsRecord = {
            "step": self.counters.step,
            "time": time.time(),
            "wall_seconds": self._elapsed(),
            **learner_metrics,
            "step_seconds": step_seconds,
            **self._throughput.record_and_reset(),
            "version_span_mean": sum(spans) / len(spans),
            "version_span_max": float(max(spans)),
            **call.tool_metrics,
            "tokens_generated_total": self.counters.tokens_generated_total,
            "tokens_trained_total": self.counters.tokens_trained_total,
            "rollouts_dropped_stale": self.counters.rollouts_dropped_stale,
            "groups_dropped_stale": self.counters.groups_dropped_stale,
            "rollouts_dropped_invalid": self.counters.rollouts_dropped_invalid,
            "groups_dropped_invalid": self.counters.groups_dropped_invalid,
            "prompts_too_long": self.counters.prompts_too_long,
            "buffer_groups": len(self.buffer),
            **self.elastic.record(self._streams),
            **totals,
            **self.counters.faults(),
        }
        self._adapt_staleness(record)
        if self.evals is not None:
            record.update(self.evals.take_result() or {})
            self.evals.start(self.counters.step, self._serving())
        guard_checkpoint = self._judge(record)
        alert_checkpoint = self._answer_alerts(record)
        every = self.spec.pipeline.checkpoint_every
        if (every and (self.counters.step % every == 0 or guard_checkpoint)) or alert_checkpoint:
            # The record waits for the checkpoint: a step recorded at a checkpoint boundary is
            # never lost, even when the learner dies while it is written and the run is then
            # cancelled.
            self._held_record = record
            self._start_checkpoint(actors)
        elif self._checkpoints.busy:  # records go out in step order
            self._records_after_checkpoint.append(record)
        else:
            self._emit(record)

    def _judge(self, record: MetricsRecord) -> bool:
        """The stability guard's judgement of the step's `record`, added to it and acted on;
        whether the guard asks for a checkpoint of this step that can be started now."""
        if self.guard is None:
            return False
        decision = self.guard.observe(record)
        if decision.action != "none":
            self.counters.guard_actions_total += 1
            self._act(decision)
        record["guard_broken_objectives"] = len(decision.broken)
        record["guard_actions_total"] = self.counters.guard_actions_total
        record["guard_rollbacks"] = self.guard.rollbacks
        record["rollouts_rolled_back_total"] = self.counters.rollouts_rolled_back_total
        return self.guard.wants_checkpoint(decision.step) and not self._checkpoints.busy

    def _answer_alerts(self, record: MetricsRecord) -> bool:
        """Answer the alerts' requests of this run (services/pipeline/pause.py), each once, as
        an action of the guard's: `pause` as the guard's pause; whether one asks for a
        checkpoint of this step that can be started now (one being written answers it)."""
        checkpoint = False
        for source in self.observers:
            if not isinstance(source, AlertSource):
                continue
            for request in source.take_alerts():
                if request.action == "checkpoint" and self._checkpoints.busy:
                    continue  # asked again at the next step
                decision = GuardDecision(self.counters.step, request.action, request.reason)
                self.counters.guard_actions_total += 1
                log.warning("%s (%s)", decision.message, request.summary)
                alert = {"alert": request.key, "summary": request.summary}
                self._report_event(ACTION_EVENT, {**self._guard_details(decision), **alert})
                if request.action == "pause":
                    self._pause_request = self._pause_request or decision
                else:
                    checkpoint = True
        if "guard_actions_total" in record:
            record["guard_actions_total"] = self.counters.guard_actions_total
        return checkpoint

    def _act(self, decision: GuardDecision) -> None:
        """Carry out the guard's action: log it and report it (a `guard.action` event);
        `cancel` and `stop_unstable` also stop the run, `rollback` unwinds the loop to `run`
        (RollbackRequested), `pause` ends the loop for `run` to pause the run (`_pause`)."""
        # The message names the step, the objective (reason), its key, value, limit and bound.
        log.warning("stability guard, %s", decision.message)
        self._report_event(ACTION_EVENT, self._guard_details(decision))
        if decision.action == "rollback":
            raise RollbackRequested(decision)
        if decision.action == "pause":  # carried out by `run` once the loop has returned
            self._pause_request = self._pause_request or decision
        elif decision.action in ("cancel", "stop_unstable") and self._guard_stop is None:
            self._guard_stop = self._guard_details(decision)
            self.cancel()
        elif decision.action not in ("warn", "cancel", "stop_unstable"):
            raise RuntimeError(f"stability guard action {decision.action!r} is not available")

    @staticmethod
    def _guard_details(decision: GuardDecision) -> dict[str, Any]:
        """The guard's action as the run's status reports it (JSON)."""
        value = decision.value
        return {
            "action": decision.action,
            "reason": decision.reason,
            "step": decision.step,
            "since": decision.since,
            "key": decision.key,
            "value": value if value is not None and math.isfinite(value) else None,
            "bound": decision.bound,
            "rollbacks": decision.rollbacks,
            "message": decision.message,
        }

    def _emit(self, record: MetricsRecord) -> None:
        for observer in self.observers:
            observer.on_metrics(record)

    def _elapsed(self) -> float:
        return self.counters.elapsed_seconds + time.perf_counter() - self._started

    # --- the adaptive staleness bound (pipeline.max_staleness: {auto: ...}) --------------------

    def _set_staleness(self, state: dict[str, Any] | None) -> None:
        """With an adaptive bound: its controller, afresh or from a checkpoint's `state`, and
        its bound as the buffer's. Without: no controller (the bound is max_staleness)."""
        auto = self.spec.pipeline.staleness_auto
        if auto is None:
            self.staleness: StalenessController | None = None
            self.buffer.max_staleness = self.spec.pipeline.max_staleness
            return
        if state is None:
            self.staleness = StalenessController(auto.min, auto.max, start=auto.start)
        else:
            self.staleness = StalenessController.from_state(auto.min, auto.max, state)
        self.buffer.max_staleness = self.staleness.bound

    def _resume_staleness(self) -> None:
        """The bound of the attempt starting: the adaptive one taken over from the checkpoint
        being resumed (afresh from step 0, or from a checkpoint of a run without it), or the
        spec's fixed one (a rollback's remedy may have replaced an adaptive bound)."""
        saved = None
        if self.spec.pipeline.staleness_auto is not None and self._resume_path is not None:
            saved = read_driver_state(self._resume_path).get("staleness")
        self._set_staleness(saved)

    def _adapt_staleness(self, record: MetricsRecord) -> None:
        """With an adaptive bound: judge the step's `record`, make the bound the buffer's (so
        the admission budget's too) for the batches taken from now on, and add it and the
        count of its moves to the record."""
        if self.staleness is None:
            return
        decision = self.staleness.observe(record)
        self.buffer.max_staleness = decision.bound
        if decision.moved:
            log.info(
                "staleness bound, step %d: %d -> %d (%s: %s)",
                decision.step,
                decision.previous,
                decision.bound,
                decision.direction,
                decision.reason,
            )
        record["staleness_bound"] = decision.bound
        record["staleness_bound_changes_total"] = self.staleness.changes

    def _start_checkpoint(self, actors: RunActors) -> None:
        """Checkpoint the current step beside the loop (the learner is idle between steps)."""

        def write_learner(path: Path) -> Callable[[], None]:
            return actors.learner.save_checkpoint(str(path))

        in_flight = in_flight_prompts(self._streams, self._pending.values())
        if self.guard is not None:  # the state saved knows the checkpoint it is saved with
            self.guard.checkpointed(self.counters.step)
        pause = self._pause_request  # a pause's checkpoint says so: its resume waits first
        state = capture_driver_state(
            self.counters,
            self._elapsed(),
            self.prompts,
            self.buffer,
            in_flight,
            self._held_record,
            None if self.guard is None else self.guard.state(),
            staleness=None if self.staleness is None else self.staleness.state(),
            paused=None if pause is None else self._guard_details(pause),
            spec_patch=self._spec_patch,
        )
        self._checkpoints.start(
            self.run_dir.checkpoints,
            self.counters.step,
            state,
            write_learner,
            self.spec.pipeline.keep_checkpoints,
            # A rollback returns to the guard's healthy checkpoint: never pruned.
            protect=() if self.guard is None else self.guard.kept_checkpoints(),
        )

    def _on_checkpointed(self) -> None:
        """The checkpoint in flight is written: emit the record that waited for it."""
        self._last_checkpoint_step = self._checkpoints.result()
        if self._held_record is not None:
            record, self._held_record = self._held_record, None
            self._emit(record)
        for record in self._records_after_checkpoint:
            self._emit(record)
        self._records_after_checkpoint.clear()
        self._curves.redraw()  # as often as the run is checkpointed

    def _checkpoint_now(self, actors: RunActors) -> None:
        if self._checkpoints.busy:
            self._on_checkpointed()
        if self.counters.step > self._last_checkpoint_step:
            self._start_checkpoint(actors)
            self._on_checkpointed()

    def _finish(self, actors: RunActors) -> None:
        """Final checkpoint (the last step, or where a cancel stopped the run), exported as a
        Hugging Face model to `RUN_DIR/model/`; then the final evaluation, with `eval`."""
        self._checkpoint_now(actors)
        # Written (and hashed) by this run or verified when it resumed: not hashed again.
        self._export(actors, self._last_checkpoint_step)
        if self.evals is not None and not self._cancel:
            self._deliver_all(actors)  # the final evaluation samples the last step's policy
            self._final_eval = self.evals.run_final(
                self.counters.step,
                self._serving(),
                actors.verifiers,
                FINAL_EVAL_TIMEOUT_S,
            )

    def _export(self, actors: RunActors, step: int) -> None:
        """Export the checkpoint of `step` (none before step 1) to `RUN_DIR/model/`."""
        if step >= 0:
            learner_dir = self.run_dir.checkpoints / checkpoint_name(step) / LEARNER_DIR
            out = actors.learner.export(str(learner_dir), str(self.run_dir.model))
            self._exported_step = step
            log.info("policy of step %d exported to %s", step, out)

    def _deliver_all(self, actors: RunActors) -> None:
        """Wait until every weight delivery in flight is acknowledged (or has failed)."""
        while refs := self.weights.pending_refs():
            ready, _ = ray.wait(refs, num_returns=1)
            for ref in ready:
                self.weights.complete(actors, ref, self._on_worker_failed)

    def _held_out(self) -> list[Prompt]:
        """The held-out prompts of `eval`, as the model sees training prompts."""
        assert self.spec.eval is not None
        prompts = held_out_prompts(self.spec.task, self.spec.seed, self.spec.eval.max_prompts)
        return [self.prompts.as_drawn(prompt) for prompt in prompts]

    def _report_status(self, state: RunState, error: str | None = None, **details: Any) -> None:
        for observer in self.observers:
            observer.on_status(state, error, step=self.counters.step, **details)
