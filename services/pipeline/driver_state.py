"""The run driver's part of a checkpoint (`driver_state.json`, services/pipeline/checkpoints.py):
what a resumed run takes over from the driver to go on where the checkpoint left it.

It holds the run's counters, the prompt stream's position and the prompts to issue again (those
handed back, and those still being generated or scored when the checkpoint was taken), every
buffered group, the checkpointed step's metrics record while that is not yet emitted, and the
stability guard's state (`StabilityGuard.state()`) in a run with the guard on. A checkpoint the
guard's pause wrote says so (`paused`: the guard's action, as the status reports it): a driver
that resumes from it waits for the resume request first. `spec_patch` is the patch of the
resumes so far (merged), with which the run trains on.

A run with an adaptive staleness bound also saves its controller's state under `staleness`
(`StalenessController.state()`); a checkpoint without it starts the controller afresh.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.messages import Prompt
from services.observers import MetricsRecord
from services.pipeline.buffer import RolloutBuffer
from services.pipeline.calls import Counters, PendingCall, ScoringCall
from services.pipeline.outputs import json_safe_record
from services.pipeline.prompts import PromptStream
from services.pipeline.records import (
    group_from_json,
    group_to_json,
    prompt_from_json,
    prompt_to_json,
)
from services.pipeline.streams import WorkerStream
from services.spec import RunSpec


@dataclass
class DriverState:
    """What a resumed driver takes from its checkpoint."""

    counters: Counters
    prompts: PromptStream
    buffer: RolloutBuffer
    # The checkpointed step's record, if the checkpoint holds it (JSON-safe, as written).
    record: MetricsRecord | None
    # The stability guard's state, if the run that wrote the checkpoint had the guard on.
    guard: dict[str, Any] | None = None
    # The guard's pause that wrote the checkpoint (its action, as the status reports it).
    paused: dict[str, Any] | None = None
    # The resumes' patches so far, merged (spec-shaped; {} for none).
    spec_patch: dict[str, Any] | None = None


def in_flight_prompts(
    streams: Sequence[WorkerStream], pending: Collection[PendingCall]
) -> list[Prompt]:
    """The prompts being generated (held by a worker) or scored (in a pending verifier call)."""
    prompts: list[Prompt] = []
    for stream in streams:
        prompts.extend(prompt for prompt, _ in stream.outstanding.values())
    for call in pending:
        if isinstance(call, ScoringCall):
            prompts.extend(call.prompts)
    return prompts


def capture_driver_state(
    counters: Counters,
    elapsed_seconds: float,
    prompts: PromptStream,
    buffer: RolloutBuffer,
    in_flight: Sequence[Prompt],
    record: MetricsRecord | None,
    guard: dict[str, Any] | None = None,
    staleness: dict[str, Any] | None = None,
    paused: dict[str, Any] | None = None,
    spec_patch: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The driver's state as a checkpoint stores it (JSON-ready), taken between learner steps.

    `elapsed_seconds` is the run's wall time so far, `in_flight` the prompts being generated or
    scored, `record` the step's metrics record that waits for this checkpoint, if any,
    `guard` the stability guard's state (JSON), if the guard is on, `staleness` the adaptive
    staleness bound's controller state (JSON), with an adaptive bound, `paused` the guard's
    pause that this checkpoint is written for, if it is, and `spec_patch` the resumes' patches.
    """
    counters = Counters(**asdict(counters))  # a copy: the run's own go on counting
    counters.elapsed_seconds = elapsed_seconds
    counters.groups_issued -= len(in_flight)  # counted again when they are re-issued
    state: dict[str, Any] = {
        "counters": asdict(counters),
        "prompt_position": prompts.position,
        # Prompts still being generated or scored are re-issued by a resumed run.
        "handed_back": [prompt_to_json(p) for p in [*in_flight, *prompts.handed_back]],
        "buffer": [group_to_json(g) for g in buffer.groups],
    }
    if staleness is not None:  # the adaptive staleness bound's controller (its state, JSON)
        state["staleness"] = staleness
    if record is not None:  # the step's record, for a driver killed before it emitted it
        state["record"] = json_safe_record(record)
    if guard is not None:
        state["guard"] = guard
    if paused is not None:
        state["paused"] = paused
    if spec_patch:
        state["spec_patch"] = spec_patch
    return state


def restore_driver_state(spec: RunSpec, state: dict[str, Any]) -> DriverState:
    """The counters, prompt stream and rollout buffer that `state` (as checkpointed) left."""
    counters = Counters(**state["counters"])
    prompts = PromptStream(
        spec.task,
        spec.seed,
        state["prompt_position"],
        [prompt_from_json(p) for p in state["handed_back"]],
    )
    groups = [group_from_json(g) for g in state["buffer"]]
    pipe = spec.pipeline
    buffer = RolloutBuffer(pipe.buffer_groups, pipe.max_staleness, groups)
    # The buffer's drop tallies go on from the run's, as the counters are read from them.
    buffer.dropped_groups = counters.groups_dropped_stale
    buffer.dropped_responses = counters.rollouts_dropped_stale
    return DriverState(
        counters,
        prompts,
        buffer,
        state.get("record"),
        state.get("guard"),
        state.get("paused"),
        state.get("spec_patch"),
    )
