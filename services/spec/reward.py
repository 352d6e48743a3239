"""The `reward` section: the verifier actors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import (
    Field,
    model_validator,
)

from kpo_core.config import StrictModel
from services.reward.registry import builtin_verifier_names
from services.spec.bounds import MAX_ACTORS, MAX_CPUS_PER_ACTOR

if TYPE_CHECKING:
    VerifierName = str
else:
    # A Literal built from the registry: the JSON schema lists the names, and pydantic's error
    # for a bad one names the valid ones.
    VerifierName = Literal[tuple(builtin_verifier_names())]


class RewardConfig(StrictModel):
    """Verifier actors and the verifier they run."""

    verifier: VerifierName = "exact"
    num_workers: int = Field(1, ge=1, le=MAX_ACTORS, description="verifier actors")
    # 256: a process per core of the largest nodes; an actor's processes share its node.
    processes_per_worker: int = Field(
        1, ge=1, le=256, description="check processes per verifier actor"
    )
    num_cpus: float = Field(
        0.25, ge=0.0, le=MAX_CPUS_PER_ACTOR, description="CPUs reserved per verifier actor"
    )
    timeout_s: float = Field(2.0, gt=0.0, description="wall-clock limit of one check")
    format_reward: float = Field(0.0, ge=0.0, lt=1.0, description="added for a well-formed answer")
    call_timeout_s: float = Field(
        300.0,
        gt=0.0,
        description="wall-clock limit of one verifier actor call (a whole batch); an actor "
        "past it is taken for hung, replaced, and the batch scored again",
    )

    @model_validator(mode="after")
    def _call_outlasts_a_check(self) -> RewardConfig:
        if self.call_timeout_s <= self.timeout_s:
            raise ValueError(
                f"call_timeout_s ({self.call_timeout_s}) must exceed timeout_s "
                f"({self.timeout_s}): a call holds at least one check"
            )
        return self
