"""The `pipeline` section: the run driver (mode, staleness, buffer, weights, checkpoints)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from kpo_core.config import StrictModel, read_as_off
from services.spec.bounds import (
    MAX_ACTORS,
    MAX_BATCH_GROUPS,
    MAX_BUFFER_GROUPS,
    MAX_STALENESS,
    MAX_STEPS,
    field_error,
)

# The adaptive bound starts here, clamped into its range: the static default (async).
AUTO_START = 2


class StalenessAuto(StrictModel):
    """The range of an adaptive staleness bound (`max_staleness: {auto: {min: M, max: N}}`):
    the driver moves the bound within [min, max] from the run's ratio health
    (services/pipeline/staleness.py)."""

    min: int = Field(ge=0, le=MAX_STALENESS, description="the lowest bound (the floor)")
    max: int = Field(
        ge=0, le=MAX_STALENESS, description="the highest bound (the ceiling; max_staleness)"
    )

    @model_validator(mode="after")
    def _ordered(self) -> StalenessAuto:
        if self.max < self.min:
            raise _error(("max",), f"must be at least min ({self.min}), got {self.max}", self.max)
        return self

    @property
    def start(self) -> int:
        """The bound a run starts with: AUTO_START clamped into [min, max]."""
        return min(self.max, max(self.min, AUTO_START))


class _AutoForm(StrictModel):
    auto: StalenessAuto


def _error(loc: tuple[str | int, ...], message: str, value: Any) -> ValidationError:
    return field_error("PipelineConfig", "staleness", loc, message, value)


def _relocated(error: ValidationError, prefix: tuple[str | int, ...]) -> ValidationError:
    """`error`'s problems, each located under `prefix` (where the user wrote the value)."""
    details = [
        InitErrorDetails(
            type=PydanticCustomError(item["type"], "{message}", {"message": item["msg"]}),
            loc=(*prefix, *item["loc"]),
            input=item["input"],
        )
        for item in error.errors()
    ]
    return ValidationError.from_exception_data("PipelineConfig", details)


class PipelineConfig(StrictModel):
    """The run driver: synchronous or asynchronous, staleness bound, buffer, steps, checkpoints."""

    mode: Literal["async", "sync"] = Field(
        "async",
        description="sync: generation pauses while the learner trains (the on-policy baseline)",
    )
    max_staleness: int = Field(
        -1,
        ge=-1,
        le=MAX_STALENESS,
        description="max learner version minus a group's version; -1: 0 (sync), 2. Or, async, "
        "{auto: {min: M, max: N}}: an adaptive bound the driver moves within [M, N] from the "
        "run's ratio health (docs/pipeline.md); max_staleness then reads N, the ceiling",
    )
    staleness_auto: StalenessAuto | None = Field(
        None,
        description="the range of an adaptive bound, filled from max_staleness: {auto: ...} "
        "(None: the bound is max_staleness, fixed)",
    )
    admission: Literal["staleness", "capacity"] = Field(
        "staleness",
        description="async only. staleness: generation is asked only for groups that can "
        "still be trained within max_staleness (no wasted rollouts, as in AReaL); capacity: "
        "generation runs ahead until the buffer is full, and groups that age past the bound "
        "are dropped and counted",
    )
    batch_groups: int = Field(
        16, ge=1, le=MAX_BATCH_GROUPS, description="groups (prompts) per learner step"
    )
    lead_batches: int = Field(
        0,
        ge=0,
        le=MAX_STALENESS,
        description="async only. The learner trains only while the buffer holds this many "
        "batches beyond the one it takes, so generation runs that many versions ahead: a "
        "controlled staleness, as with many rollout workers (at most max_staleness)",
    )
    buffer_groups: int = Field(
        0,
        ge=0,
        le=MAX_BUFFER_GROUPS,
        description="rollout buffer capacity in groups; 0: max(4, lead_batches + 1) batches",
    )
    steps: int = Field(100, ge=1, le=MAX_STEPS, description="learner steps of the run")
    checkpoint_every: int = Field(
        10, ge=0, le=MAX_STEPS, description="steps between checkpoints; 0: last only"
    )
    # A checkpoint of an 8B model with its optimiser state is about 100 GB, on a volume that all
    # runs share: 100 of them is already far more than one run should hold.
    keep_checkpoints: int = Field(2, ge=1, le=100, description="newest checkpoints kept on disk")
    # Each restart reloads the model and the last checkpoint on the learner's GPUs: a learner
    # that died 100 times will die again.
    learner_restarts: int = Field(
        2,
        ge=0,
        le=100,
        description="times the run resumes itself from its last checkpoint after the learner "
        "dies; 0: a dead learner fails the run",
    )
    # 10,000: ten for each of the most actors a run may have.
    actor_replacements: int = Field(
        10,
        ge=0,
        le=10 * MAX_ACTORS,
        description="generation and verifier actors that may die (or hang) and be replaced, "
        "in all, before the run fails",
    )
    weight_transport: Literal["object_store", "collective"] = Field(
        "object_store",
        description="how new weights reach generation: object_store (tensors in buckets "
        "through Ray's object store) or collective (a torch.distributed broadcast from learner "
        "rank 0 to every generation worker's receiving processes; NCCL on GPUs, CUDA IPC handles "
        "where they all share one GPU, gloo on CPU)",
    )
    weight_bucket_mb: int = Field(
        256,
        ge=1,
        le=16384,
        description="size of one bucket of weights sent at a time: bounds the full tensors "
        "held beyond a rank's shard while gathering, and each message on the way",
    )
    weight_delta: Annotated[Literal["auto", "off"], BeforeValidator(read_as_off)] = Field(
        "auto",
        description="auto: after the first version, each publish sends per bucket only what "
        "changed since the version before (changed words' indices and values, or their "
        "compressed XOR, whichever is smaller; the whole bucket where more than half "
        "changed), checked by a digest on arrival and resent dense on a mismatch; a worker that "
        "missed a version, or a new one, gets the weights dense. Sender and every receiver hold "
        "one copy of the published weights in host memory. off: every publish sends them all",
    )
    overlap_publish: bool = Field(
        True,
        description="async: read and put (object_store) or broadcast (collective) each new "
        "version while the next learner step trains (its first optimiser update waits until "
        "the weights are read) instead of before it; a sharded learner gathers before the next "
        "step and puts or broadcasts beside it; a sync run publishes before the next step",
    )
    publish_in_flight: int = Field(
        1,
        ge=1,
        le=MAX_STALENESS + 1,
        description="a sharded learner's overlapped publishes whose gathered host copy of the "
        "weights may be held at once (each until it is put or broadcast): the next publish "
        "waits for room, so host memory holds at most this many copies beyond the shards",
    )
    in_flight_updates: bool = Field(
        False,
        description="async only. Load new weights between decoding steps without waiting for "
        "the responses in flight (their KV cache is kept, see recompute_kv); each token keeps "
        "the version and behaviour log-prob of the weights that sampled it",
    )
    recompute_kv: bool = Field(
        False,
        description="with in_flight_updates: recompute the KV cache of responses in flight "
        "under the new weights (exact, costs a prefill) instead of keeping it",
    )

    @model_validator(mode="before")
    @classmethod
    def _auto_form(cls, data: Any) -> Any:
        """`max_staleness: {auto: {min, max}}` is the ceiling `max` in `max_staleness` (the
        field every reader uses) and the range in `staleness_auto`."""
        if not isinstance(data, dict) or not isinstance(data.get("max_staleness"), dict):
            return data
        try:
            auto = _AutoForm.model_validate(data["max_staleness"]).auto
        except ValidationError as error:
            raise _relocated(error, ("max_staleness",)) from None
        if data.get("staleness_auto") is not None:
            raise _error(
                ("staleness_auto",),
                "set by max_staleness: {auto: ...}; give one of the two",
                data["staleness_auto"],
            )
        return {**data, "max_staleness": auto.max, "staleness_auto": auto}

    @model_validator(mode="after")
    def _resolve(self) -> PipelineConfig:
        if self.staleness_auto is not None:
            self._check_auto(self.staleness_auto)
        if self.mode == "sync" and self.max_staleness > 0:
            raise ValueError(
                f"mode 'sync' trains on-policy, so max_staleness must be 0 or left out "
                f"(got {self.max_staleness}); use mode 'async' for stale batches"
            )
        if self.max_staleness < 0:
            object.__setattr__(self, "max_staleness", 0 if self.mode == "sync" else 2)
        if self.buffer_groups == 0:
            batches = max(4, self.lead_batches + 1)
            object.__setattr__(self, "buffer_groups", batches * self.batch_groups)
        if self.buffer_groups < self.batch_groups:
            raise ValueError(
                f"buffer_groups ({self.buffer_groups}) must hold at least one batch "
                f"(batch_groups = {self.batch_groups})"
            )
        if self.lead_batches > 0:
            self._check_lead()
        if self.in_flight_updates and self.mode == "sync":
            raise ValueError("in_flight_updates needs mode 'async' (sync trains on-policy)")
        if self.recompute_kv and not self.in_flight_updates:
            raise ValueError("recompute_kv applies to in_flight_updates: set that too")
        return self

    def _check_auto(self, auto: StalenessAuto) -> None:
        if self.mode == "sync":
            raise _error(
                ("max_staleness", "auto"),
                "an adaptive staleness bound needs mode 'async': mode 'sync' trains on-policy "
                "(staleness 0); give max_staleness 0 or leave it out",
                auto.model_dump(),
            )
        if self.max_staleness == -1:  # the range given on its own (as a dumped spec holds it)
            object.__setattr__(self, "max_staleness", auto.max)
        elif self.max_staleness != auto.max:
            raise _error(
                ("staleness_auto", "max"),
                f"must equal max_staleness ({self.max_staleness}), the ceiling of the adaptive "
                f"bound, got {auto.max}; write max_staleness: {{auto: {{min, max}}}} instead",
                auto.max,
            )
        if self.lead_batches > auto.min:
            # The learner waits for lead_batches + 1 batches, which a bound below
            # lead_batches never lets generation admit.
            raise _error(
                ("lead_batches",),
                f"lead_batches ({self.lead_batches}) must not exceed the adaptive bound's min "
                f"({auto.min}): the learner would wait for batches that a bound that low "
                "never admits",
                self.lead_batches,
            )

    def _check_lead(self) -> None:
        # Every condition below would leave the learner waiting for a buffer level that
        # generation is never allowed to reach.
        if self.mode == "sync":
            raise ValueError("lead_batches needs mode 'async' (sync trains on-policy)")
        if self.lead_batches > self.max_staleness:
            raise ValueError(
                f"lead_batches ({self.lead_batches}) must not exceed max_staleness "
                f"({self.max_staleness}): older batches could never be trained"
            )
        needed = (self.lead_batches + 1) * self.batch_groups
        if self.buffer_groups < needed:
            raise ValueError(
                f"buffer_groups ({self.buffer_groups}) must hold lead_batches + 1 batches "
                f"({needed} groups)"
            )
