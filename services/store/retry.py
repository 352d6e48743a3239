"""Retrying a call through a short outage, with exponential backoff, up to a deadline."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long a call keeps trying before the store buffers it or reports the server down."""

    # Total time one call spends retrying. Short: past it, writes go to the outage buffer and
    # return, so a learner step never stalls for long on a Redis restart.
    deadline_s: float = 2.0
    first_delay_s: float = 0.02
    max_delay_s: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s or self.deadline_s < 0:
            raise ValueError(
                "RetryPolicy needs 0 < first_delay_s <= max_delay_s and deadline_s >= 0, "
                f"got {self}"
            )


def call_with_retry(
    fn: Callable[[], T],
    policy: RetryPolicy,
    transient: tuple[type[BaseException], ...],
    deadline: float | None = None,
) -> T:
    """Call `fn` until it returns, retrying `transient` errors until the deadline passes.

    `deadline` is a `time.monotonic()` instant (default: now + policy.deadline_s); after it the
    last transient error is raised. Delays double from `first_delay_s` up to `max_delay_s`, each
    drawn from [delay/2, delay] so that many clients reconnecting after a restart spread out.
    """
    end = time.monotonic() + policy.deadline_s if deadline is None else deadline
    delay = policy.first_delay_s
    while True:
        try:
            return fn()
        except transient:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise
            time.sleep(min(random.uniform(delay / 2, delay), remaining))
            delay = min(2 * delay, policy.max_delay_s)
