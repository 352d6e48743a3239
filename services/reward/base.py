"""What a verifier check is: its verdict, the options every verifier shares, and its binding.

A check is a plain function `check(response_text, reference_answer, config) -> Verdict`. It runs
in a worker process (see `services.reward.pool`), so it must be defined at module level in an
importable module: it is sent to the worker by reference and its config by value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class Verdict:
    """Outcome of one successful check. Filled by a check; read by `scoring`."""

    correct: bool  # the final answer matches the reference
    well_formed: bool  # the answer is given in the expected form (marker / boxed), right or wrong


class VerifierConfig(BaseModel):
    """Options every verifier has. Verifier-specific configs subclass it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Wall-clock limit of one check, enforced by killing the worker process that runs it.
    timeout_s: float = Field(default=2.0, gt=0.0)
    # Added to the reward of a well-formed response. Kept below the correctness reward of 1 so
    # that a reward of at least 1 always means "correct" (see `scoring.is_correct`).
    format_reward: float = Field(default=0.0, ge=0.0, lt=1.0)


# `Any` for the config: each check takes its own VerifierConfig subclass.
CheckFn = Callable[[str, str, Any], Verdict]


@dataclass(frozen=True)
class Verifier:
    """A named check bound to its validated config; calling it runs the check once.

    It is the target that worker processes run, and it compares by value, so that a pool can be
    checked to belong to the verifier it is used with.
    """

    name: str
    check: CheckFn
    config: VerifierConfig

    def __call__(self, response_text: str, reference: str) -> Verdict:
        """Run the check and insist on a `Verdict`, so that a sloppy check fails loudly."""
        verdict = self.check(response_text, reference, self.config)
        if not isinstance(verdict, Verdict):
            raise TypeError(
                f"verifier {self.name!r} returned {type(verdict).__name__}, expected Verdict"
            )
        return verdict
