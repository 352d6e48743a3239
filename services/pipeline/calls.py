"""What the run driver's loop waits on and counts: the kinds of call in flight, the run's
counters (carried over by checkpoints), generation throughput between steps, and the errors
that end a run."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from services.messages import Prompt, Response, ScoredGroup, ScoredResponse
from services.metrics import FAULT_COUNTERS

VERIFIER_LOST = "verifier actor lost"  # the `failure` of a response no actor could score


@dataclass
class Counters:
    """Run totals that a checkpoint carries over into a resumed run."""

    step: int = 0  # learner steps done = the learner's policy version
    generation_calls: int = 0  # groups asked for; also numbers their sampling seeds
    groups_issued: int = 0  # asked of generation (prompts handed back are not counted)
    tokens_generated_total: int = 0
    tokens_trained_total: int = 0
    rollouts_dropped_stale: int = 0  # responses
    groups_dropped_stale: int = 0
    # Prompts a generation worker refused (too long for its context, or its backend refused
    # them): dropped, never retried. Groups, and the responses they would have had.
    groups_dropped_invalid: int = 0
    rollouts_dropped_invalid: int = 0
    prompts_too_long: int = 0  # of groups_dropped_invalid: the prompt did not fit the context
    elapsed_seconds: float = 0.0  # wall time of earlier attempts of this run
    # Faults survived (docs/reliability.md); also in every metrics record.
    learner_restarts: int = 0
    generation_replacements: int = 0
    standby_promotions: int = 0  # of generation_replacements: a warm standby took the place
    verifier_replacements: int = 0
    rescored_groups: int = 0  # scored again after their verifier actor died or hung
    unverified_groups: int = 0  # their verifier actor failed SCORING_ATTEMPTS times
    # Bad numbers the learner masked or skipped (docs/numerics.md), summed over the run.
    nonfinite_rewards_total: float = 0.0
    nonfinite_tokens_total: float = 0.0
    extreme_ratio_tokens_total: float = 0.0
    skipped_minibatches_total: float = 0.0
    guard_actions_total: int = 0  # actions of the stability guard (services/pipeline/guard.py)
    rollouts_rolled_back_total: int = 0  # sampled after a rollback's checkpoint: dropped

    def faults(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in FAULT_COUNTERS}


@dataclass(frozen=True)
class SubmitCall:
    """Prompts handed to a worker's stream: watched so that a failure to take them is seen."""

    worker: int
    actor: Any


@dataclass(frozen=True)
class PollCall:
    """A worker's `next_groups`: one is always pending per worker."""

    worker: int
    actor: Any


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
    started: float
    version_spans: list[int] = field(default_factory=list)  # of the batch's responses
    tool_metrics: dict[str, float] = field(default_factory=dict)  # with tools: the batch's


@dataclass(frozen=True)
class LearnerPeerCall:
    """A learner call's result on a rank other than 0: watched so that its death is noticed."""


@dataclass(frozen=True)
class PingCall:
    """A worker overdue with a weight delivery is asked whether it still answers: one blocked in
    a collective receive by a peer that hangs does (its clock starts again), the hung one not."""

    worker: int
    actor: Any
    started: float


@dataclass(frozen=True)
class StartCall:
    """The first call of a generation worker just started: it answers once the constructor
    (the model load) has run, which makes a new standby one that may be promoted."""

    worker: int
    actor: Any


PendingCall = (
    SubmitCall | PollCall | ScoringCall | LearnerCall | LearnerPeerCall | PingCall | StartCall
)


@dataclass
class Throughput:
    """Generation between two learner steps: tokens, and the seconds each group took."""

    tokens: int = 0
    group_seconds: list[float] = field(default_factory=list)
    since: float = field(default_factory=time.perf_counter)

    def record_and_reset(self) -> dict[str, float]:
        now = time.perf_counter()
        seconds = self.group_seconds
        record = {
            "generation_tokens_per_s": self.tokens / max(now - self.since, 1e-9),
            # Mean over the groups that ended since the last step (0 if none did).
            "generation_batch_seconds": sum(seconds) / len(seconds) if seconds else 0.0,
            "generation_batches": float(len(seconds)),
        }
        self.tokens, self.group_seconds, self.since = 0, [], now
        return record


class CancelRequested(Exception):
    """Raised by the signal handler on a second Ctrl-C: stop without waiting."""


class GenerationFailed(RuntimeError):
    """A prompt's generation failed on GENERATION_ATTEMPTS actors: the run cannot go on."""


class ScoringFailed(RuntimeError):
    """Verifier actors raised on the same groups SCORING_ATTEMPTS times."""


def sampling_seed(run_seed: int, call: int) -> int:
    """A distinct, reproducible sampling seed for every group a run asks for."""
    digest = hashlib.sha256(f"{run_seed}/{call}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def unverified(call: ScoringCall) -> list[ScoredGroup]:
    """The call's groups with every response marked as not verified (reward 0)."""
    return [
        ScoredGroup(prompt, [ScoredResponse(r, 0.0, False, VERIFIER_LOST) for r in responses])
        for prompt, responses in zip(call.prompts, call.groups, strict=True)
    ]
