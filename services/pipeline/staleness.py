"""The adaptive staleness bound (`pipeline.max_staleness: {auto: {min: M, max: N}}`).

A pure controller: the run driver hands it each learner step's metrics record and sets the
bound it answers as the rollout buffer's `max_staleness` and in generation's admission budget.
It knows nothing of Ray, actors or files; its state is plain JSON, saved with every checkpoint.

Signals (`HEALTH_SIGNALS`): how far the learner's policy has moved from the behaviour policy
that sampled the batch, read from the record where present: `clip_fraction`, `approx_kl`,
`filtered_switch_frequency`, `raw_local_variance` and `filtered_local_variance`. Each grows as
batches get staler; a key the record lacks is not judged.

The healthy band of a signal is learnt from the run: `factor` x the running median of its last
`window` values, plus an absolute `floor` (`SIGNAL_FLOORS`) so a band learnt from near-zero
values is not so narrow that noise leaves it. A value above the band, or one that is not a finite
number, is unhealthy; a step is healthy when none of its signals is. The window learns every
finite value capped at the band's edge (the warm-up's as they are): a value above the band
enters as the edge, not as itself. So a spike or a run going bad cannot drag the band up (a
sustained rise widens it by about `factor`-fold per half window, while the bound tightens), and
the median stays unbiased as long as most steps are healthy. (Learning healthy values only would
leave out the high end of the noise and narrow the band step by step: on noisy signals it
collapses towards a few floors and pins the bound at min.)

Rules, once the first `warmup` steps have been observed (the bound does not move before):

- tighten (bound - 1, not below min) at an unhealthy step;
- loosen (bound + 1, not above max) when the last `patience` steps were all healthy and the
  learner waited for data this step (`learner_idle_seconds` above `idle_fraction` x
  `step_seconds`): a fresher bound would cost nothing, a staler one may buy throughput;
- hold otherwise, and for `patience` steps after each move (hysteresis: the batches already
  admitted under the previous bound are trained first, so a move shows only steps later).

The bound starts at the static default (`services.spec.pipeline.AUTO_START`, 2) clamped into
[min, max].
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from services.spec.pipeline import AUTO_START

# The ratio-health signals, each worse when higher, with the band's absolute floor: a clipped
# token in a hundred, a thousandth of a nat, a ratio variance of 0.01 (a standard deviation of
# 0.1), a switch of side in one token pair of twenty.
SIGNAL_FLOORS: Mapping[str, float] = {
    "clip_fraction": 0.01,
    "approx_kl": 0.001,
    "filtered_switch_frequency": 0.05,
    "raw_local_variance": 0.01,
    "filtered_local_variance": 0.01,
}
HEALTH_SIGNALS = tuple(SIGNAL_FLOORS)

WINDOW = 20  # healthy values per signal that the band's median is taken over
WARMUP = 5  # steps observed (and learnt from) before the bound may move
FACTOR = 1.5  # the band: FACTOR x median + floor
PATIENCE = 3  # healthy steps before a loosening, and steps held after any move
IDLE_FRACTION = 0.1  # the learner waited for data: idle above this fraction of its step

Direction = Literal["tighten", "loosen", "hold"]


@dataclass(frozen=True)
class StalenessDecision:
    """The controller's answer to one step's record."""

    step: int
    bound: int  # in force from now on
    previous: int  # in force before this step's record was judged
    direction: Direction
    reason: str
    unhealthy: tuple[str, ...] = ()  # the signals above their band (or not finite)
    learner_waited: bool = False

    @property
    def moved(self) -> bool:
        return self.bound != self.previous


def learner_waited(record: Mapping[str, Any], idle_fraction: float = IDLE_FRACTION) -> bool:
    """Whether the learner waited for data before this step: `learner_idle_seconds` above
    `idle_fraction` x `step_seconds` (False when either is absent or not finite)."""
    idle = _number(record.get("learner_idle_seconds"))
    step = _number(record.get("step_seconds"))
    if not (math.isfinite(idle) and math.isfinite(step)):
        return False
    return idle > idle_fraction * max(step, 0.0)


def _number(value: Any) -> float:
    """`value` as a float; NaN for what is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


class StalenessController:
    """Moves a staleness bound within [minimum, maximum] from each step's ratio health."""

    def __init__(
        self,
        minimum: int,
        maximum: int,
        *,
        start: int | None = None,
        window: int = WINDOW,
        warmup: int = WARMUP,
        factor: float = FACTOR,
        patience: int = PATIENCE,
        idle_fraction: float = IDLE_FRACTION,
        floors: Mapping[str, float] = SIGNAL_FLOORS,
    ) -> None:
        if not 0 <= minimum <= maximum:
            raise ValueError(f"need 0 <= minimum <= maximum, got {minimum} and {maximum}")
        if window < 1 or warmup < 0 or patience < 1 or factor < 1.0 or idle_fraction < 0.0:
            raise ValueError(
                f"need window >= 1, warmup >= 0, patience >= 1, factor >= 1 and "
                f"idle_fraction >= 0 (got {window}, {warmup}, {patience}, {factor}, "
                f"{idle_fraction})"
            )
        self.minimum, self.maximum = minimum, maximum
        self.window, self.warmup, self.factor = window, warmup, factor
        self.patience, self.idle_fraction = patience, idle_fraction
        self.floors = dict(floors)
        self.bound = self._clamp(AUTO_START if start is None else start)
        self.seen = 0  # steps observed
        self.hold = 0  # steps left in which the bound does not move (after a move)
        self.healthy_run = 0  # consecutive healthy steps (reset by a move)
        self.changes = 0  # moves in the run
        self._values: dict[str, deque[float]] = {key: deque(maxlen=window) for key in self.floors}

    def _clamp(self, bound: int) -> int:
        return min(self.maximum, max(self.minimum, bound))

    def band(self, key: str) -> float | None:
        """The upper edge of `key`'s healthy band; None while nothing was learnt."""
        values = self._values[key]
        if not values:
            return None
        return self.factor * statistics.median(values) + self.floors[key]

    def observe(self, record: Mapping[str, Any]) -> StalenessDecision:
        """Judge one learner step's record; the bound for the batches taken from now on."""
        self.seen += 1
        number = record.get("step")
        step = number if isinstance(number, int) and not isinstance(number, bool) else self.seen
        waited = learner_waited(record, self.idle_fraction)
        values = {key: _number(record[key]) for key in self.floors if key in record}
        unhealthy: list[str] = []
        reasons: list[str] = []
        edges = {key: None if self.seen <= self.warmup else self.band(key) for key in values}
        for key, value in values.items():
            edge = edges[key]
            if not math.isfinite(value):
                unhealthy.append(key)
                reasons.append(f"{key} is {value}")
            elif edge is not None and value > edge:
                unhealthy.append(key)
                reasons.append(f"{key} {value:.4g} above its band {edge:.4g}")
        for key, value in values.items():
            if math.isfinite(value):  # capped at the band's edge (as it was before this step)
                edge = edges[key]
                self._values[key].append(value if edge is None else min(value, edge))
        self.healthy_run = 0 if unhealthy else self.healthy_run + 1

        previous = self.bound
        direction: Direction = "hold"
        if self.seen <= self.warmup:
            reason = f"warm-up, step {self.seen} of {self.warmup}"
        elif self.hold > 0:
            self.hold -= 1
            reason = f"held after a move ({self.hold} more steps)"
        elif unhealthy and self.bound > self.minimum:
            direction, reason = "tighten", "; ".join(reasons)
        elif unhealthy:
            reason = f"at the floor ({self.minimum}): " + "; ".join(reasons)
        elif self.healthy_run < self.patience:
            reason = f"healthy for {self.healthy_run} of {self.patience} steps"
        elif not waited:
            reason = "healthy, but the learner did not wait for data"
        elif self.bound < self.maximum:
            direction = "loosen"
            reason = f"healthy for {self.healthy_run} steps and the learner waited for data"
        else:
            reason = f"healthy, at the ceiling ({self.maximum})"
        if direction != "hold":
            self.bound += 1 if direction == "loosen" else -1
            self.hold = self.patience
            self.healthy_run = 0
            self.changes += 1
        return StalenessDecision(
            step, self.bound, previous, direction, reason, tuple(unhealthy), waited
        )

    def state(self) -> dict[str, Any]:
        """The controller's state, JSON-ready, for a checkpoint."""
        return {
            "bound": self.bound,
            "seen": self.seen,
            "hold": self.hold,
            "healthy_run": self.healthy_run,
            "changes": self.changes,
            "values": {key: list(values) for key, values in self._values.items()},
        }

    @classmethod
    def from_state(
        cls, minimum: int, maximum: int, state: Mapping[str, Any], **settings: Any
    ) -> StalenessController:
        """A controller over [minimum, maximum] that goes on from `state` (as `state()` gave
        it; a bound outside the range is clamped into it). `settings`: as the constructor's."""
        controller = cls(minimum, maximum, start=int(state["bound"]), **settings)
        controller.seen = int(state["seen"])
        controller.hold = int(state["hold"])
        controller.healthy_run = int(state["healthy_run"])
        controller.changes = int(state["changes"])
        for key, values in state.get("values", {}).items():
            if key in controller._values:
                controller._values[key].extend(float(v) for v in values)
        return controller
