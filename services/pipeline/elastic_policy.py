"""When an elastic pool of generation workers grows or shrinks (`generation.actors`): a pure
policy over what the driver's loop observes, with no Ray and no clock of its own.

At every pass of its loop the driver reports one sample: the time, whether the learner is
*starved* (idle, waiting for a batch that generation has not delivered: generation is the
bottleneck) and whether the buffer is *backed up* (admission closed while a whole batch of
scored groups waits for a busy learner: the learner is the bottleneck, and workers sit idle).
Each sample's state holds until the next one, so the policy measures the fraction of the last
`window_s` seconds spent in each state, however irregular the loop's passes are.

- grow (one worker) when the learner was starved at least `grow_idle_fraction` of the window;
- shrink (one worker) when the buffer was backed up at least `shrink_full_fraction` of it;
- never beyond [min, max], and only on a full window of evidence gathered since the last
  decision: after a decision the window starts afresh, and no decision is taken for
  `cooldown_s` (a new worker needs time to start and to show its effect).

The two signals are distinct states (a starved learner has no batch waiting) and each has its
own threshold, so the evidence that grew the pool cannot shrink it again at the next pass: a
decision against the previous one needs a whole new window pointing the other way. That, and
the cooldown, is the hysteresis that keeps the pool from flapping.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

Direction = Literal["grow", "shrink"]


@dataclass(frozen=True)
class Sample:
    """What the loop saw at `time` (seconds, any monotonic clock)."""

    time: float
    starved: bool
    backed_up: bool


@dataclass(frozen=True)
class PoolDecision:
    """One grow or shrink, with the evidence behind it."""

    direction: Direction
    size: int  # the pool's size before the decision
    target: int  # its size after
    starved_fraction: float
    backed_up_fraction: float
    time: float

    @property
    def reason(self) -> str:
        if self.direction == "grow":
            return f"the learner waited for data {self.starved_fraction:.0%} of the window"
        return f"a batch waited for the learner {self.backed_up_fraction:.0%} of the window"


class ElasticPolicy:
    """Grow and shrink decisions for a pool within [low, high] (see the module's text)."""

    def __init__(
        self,
        low: int,
        high: int,
        window_s: float,
        cooldown_s: float,
        grow_idle_fraction: float,
        shrink_full_fraction: float,
    ) -> None:
        if not 1 <= low <= high or window_s <= 0 or cooldown_s < 0:
            raise ValueError(
                f"need 1 <= low <= high, window_s > 0, cooldown_s >= 0 (got {low}, {high}, "
                f"{window_s}, {cooldown_s})"
            )
        if not (0 < grow_idle_fraction <= 1 and 0 < shrink_full_fraction <= 1):
            raise ValueError("the thresholds are fractions of the window, in (0, 1]")
        self.low, self.high = low, high
        self.window_s, self.cooldown_s = window_s, cooldown_s
        self.grow_idle_fraction = grow_idle_fraction
        self.shrink_full_fraction = shrink_full_fraction
        self._samples: deque[Sample] = deque()
        self._quiet_until = float("-inf")  # no decision before (the cooldown)

    def observe(self, sample: Sample, size: int) -> PoolDecision | None:
        """Record `sample` of a pool of `size` workers; a decision, or None."""
        if self._samples and sample.time < self._samples[-1].time:
            raise ValueError("samples must come in time order")
        self._samples.append(sample)
        # Keep the newest sample at or before the window's start: its state covers that start.
        start = sample.time - self.window_s
        while len(self._samples) > 1 and self._samples[1].time <= start:
            self._samples.popleft()
        if sample.time < self._quiet_until or self._samples[0].time > start:
            return None  # cooling down, or less than a window of evidence yet
        starved, backed_up = self.fractions(sample.time)
        if starved >= self.grow_idle_fraction and size < self.high:
            return self._decide("grow", sample, size, starved, backed_up)
        if backed_up >= self.shrink_full_fraction and size > self.low:
            return self._decide("shrink", sample, size, starved, backed_up)
        return None

    def fractions(self, now: float) -> tuple[float, float]:
        """The fractions of the window ending at `now` that the learner was starved and the
        buffer backed up (0 before a first sample)."""
        start = now - self.window_s
        starved = backed_up = 0.0
        samples = list(self._samples)
        for index, sample in enumerate(samples):
            end = samples[index + 1].time if index + 1 < len(samples) else now
            held = max(0.0, min(end, now) - max(sample.time, start))
            starved += held if sample.starved else 0.0
            backed_up += held if sample.backed_up else 0.0
        return starved / self.window_s, backed_up / self.window_s

    def _decide(
        self, direction: Direction, sample: Sample, size: int, starved: float, backed_up: float
    ) -> PoolDecision:
        # The evidence is spent: the next decision needs a full window gathered after this one
        # (from this sample on, whose state holds until the next).
        self._samples.clear()
        self._samples.append(sample)
        self._quiet_until = sample.time + self.cooldown_s
        target = size + 1 if direction == "grow" else size - 1
        return PoolDecision(direction, size, target, starved, backed_up, sample.time)
