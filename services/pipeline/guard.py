"""The stability guard: objectives on each learner step's signals, and when to act on them.

`StabilityGuard.observe` reads one metrics record per learner step (services/metrics.py) and
compares the signals it names with the `stability.objectives` of the run spec
(services/spec/stability.py). It only decides; the run driver acts (warn, roll back, pause,
cancel) and tells the guard which checkpoints it wrote (`checkpointed`).

- Each objective reads one record key. A record without that key does not evaluate it, and
  leaves its count of consecutive broken evaluations as it was: held-out accuracy is only in the
  records an evaluation joins, and its drop stays open until the next evaluation shows it held.
- Baselines are running medians over the last `baseline_window` values of steps in which the
  objective held, so a collapse does not drag its own baseline down with it. The first
  `warmup_steps` records only feed them. A value that is not finite breaks its objective at any
  step: there is no baseline against which a NaN is healthy.
- An episode opens at the first step with a broken objective (the first warning) and closes
  after `patience` consecutive steps with none open (re-armed). In an episode the guard acts
  once, at the first objective broken for `patience` consecutive evaluations: one collapse
  seen by several objectives (entropy and its slope) is one action, not several.
- A checkpoint is healthy once `patience` steps trained on rollouts of its policy or a later
  one (each record's `staleness_max` says how old its batch is) passed, with no objective open
  at any step after it until then.
  At the first warning the guard asks for a checkpoint when the newest healthy one is older
  than `max_healthy_age_steps` (or there is none): if the warning passes, that checkpoint
  becomes healthy, and a later rollback loses less.
- `rollback` counts: past `max_rollbacks` the decision is `stop_unstable`, with the reason.
- After a `pause` the run resumes from the checkpoint of the paused step (`resumed`): the
  episode that acted is closed and every objective counts its broken evaluations afresh, so the
  guard acts again only once an objective has been broken for `patience` evaluations after the
  resume. Baselines and the checkpoints' judgement stay as they were.

Pure Python: its whole state is `state()`, JSON that the driver saves with its checkpoint.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from services.spec.stability import StabilityConfig

# `checkpoint` is an alert's (the driver answers alerts as actions); the guard never decides it.
Action = Literal["none", "warn", "checkpoint", "rollback", "pause", "cancel", "stop_unstable"]
STATE_VERSION = 1


class Comparison(StrEnum):
    """How an objective compares a value with its bound."""

    CEILING = "ceiling"  # value > bound
    FRACTION_OF_BASELINE = "fraction_of_baseline"  # value < bound x baseline
    MULTIPLE_OF_BASELINE = "multiple_of_baseline"  # value > bound x baseline
    DROP_FROM_BASELINE = "drop_from_baseline"  # value < baseline - bound
    DROP_FROM_BEST = "drop_from_best"  # value < best seen - bound
    SLOPE = "slope"  # least-squares slope over the window / baseline < bound

    @property
    def uses_baseline(self) -> bool:
        return self not in (Comparison.CEILING, Comparison.DROP_FROM_BEST)


@dataclass(frozen=True)
class Objective:
    """One objective of the spec: the record key it reads, its comparison, its bound.
    `requires`: a key that must be in the record too (the estimator whose diagnostic it is)."""

    name: str
    key: str
    comparison: Comparison
    bound: float
    requires: str | None = None


# Each field of `StabilityObjectives` with the record key it reads (services/metrics.py, and
# services/pipeline/evaluation.py for held-out accuracy) and its test. The filtered switch
# frequency is KPO's diagnostic: of the other estimators it is the token ratio's, whose switching
# is the noise KPO filters (0.43 healthy), so it is read only where KPO's gain is.
OBJECTIVE_COMPARISONS: dict[str, tuple[str, Comparison, str | None]] = {
    "entropy_min_fraction": ("entropy", Comparison.FRACTION_OF_BASELINE, None),
    "entropy_slope_min": ("entropy", Comparison.SLOPE, None),
    "clip_fraction_max": ("clip_fraction", Comparison.CEILING, None),
    "grad_norm_max_ratio": ("grad_norm", Comparison.MULTIPLE_OF_BASELINE, None),
    "nonfinite_tokens_max": ("nonfinite_tokens", Comparison.CEILING, None),
    "reward_drop_max": ("reward_mean", Comparison.DROP_FROM_BASELINE, None),
    "held_out_drop_max": ("eval_accuracy_avg_at_k", Comparison.DROP_FROM_BEST, None),
    "switch_frequency_max": ("filtered_switch_frequency", Comparison.CEILING, "kalman_gain_mean"),
    "truncated_fraction_max": ("truncated_fraction", Comparison.CEILING, None),
    "approx_kl_max": ("approx_kl", Comparison.CEILING, None),
}


def objectives_of(config: StabilityConfig) -> tuple[Objective, ...]:
    """The objectives `config` switches on (not null), in the spec's order."""
    bounds = config.objectives.model_dump()
    return tuple(
        Objective(name, key, comparison, float(bounds[name]), requires)
        for name, (key, comparison, requires) in OBJECTIVE_COMPARISONS.items()
        if bounds[name] is not None
    )


@dataclass(frozen=True)
class Breach:
    """An objective broken at one step. value: what was compared (the relative slope for
    `entropy_slope_min`); limit: the value's threshold that step (bound x baseline, ...; None
    for a value that is not finite); streak: consecutive broken evaluations, this one included;
    since: the step of the first of them."""

    objective: str
    key: str
    value: float
    bound: float
    limit: float | None
    streak: int
    since: int


@dataclass(frozen=True)
class GuardDecision:
    """What the guard asks of the driver after one step. `action` "none": nothing; otherwise
    the spec's action, or `stop_unstable` once `max_rollbacks` are spent. reason, key, value,
    bound, limit, since: of the objective that made it act. rollback_to: for a rollback, the
    newest healthy checkpoint (None: none is healthy yet). broken: every objective broken at
    this step, acted on or not."""

    step: int
    action: Action = "none"
    reason: str | None = None
    key: str | None = None
    value: float | None = None
    bound: float | None = None
    limit: float | None = None
    since: int | None = None
    rollback_to: int | None = None
    rollbacks: int = 0
    broken: tuple[Breach, ...] = ()

    @property
    def message(self) -> str:
        """One line for the run's log and events."""
        if self.action == "none":
            return f"step {self.step}: stable"
        if self.key is None or self.value is None or self.bound is None:  # an alert's action
            return f"step {self.step}: {self.action}: {self.reason}"
        limit = "not finite" if self.limit is None else f"limit {self.limit:.6g}"
        text = (
            f"step {self.step}: {self.action}: {self.reason} broken since step {self.since}: "
            f"{self.key} {self.value:.6g} ({limit}, bound {self.bound:.6g})"
        )
        if self.action == "stop_unstable":
            text += f"; unstable after {self.rollbacks} rollbacks"
        return text


@dataclass(frozen=True)
class Check:
    """One evaluation of an objective: broken or held, the value compared and its limit."""

    broken: bool
    value: float
    limit: float | None


@dataclass
class Track:
    """What the guard keeps of one objective. baseline: values of steps in which it held;
    history: the latest values, held or not (the slope's window); best: the highest value
    seen (held-out accuracy)."""

    window: int
    streak: int = 0
    since: int | None = None
    best: float | None = None
    baseline: deque[float] = field(init=False)
    history: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        self.baseline = deque(maxlen=self.window)
        self.history = deque(maxlen=self.window)

    def state(self) -> dict[str, Any]:
        return {
            "streak": self.streak,
            "since": self.since,
            "best": self.best,
            "baseline": list(self.baseline),
            "history": list(self.history),
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        self.streak = int(state["streak"])
        self.since = state["since"]
        self.best = state["best"]
        # A window shortened on resume keeps the newest values (deque's maxlen).
        self.baseline.extend(float(v) for v in state["baseline"])
        self.history.extend(float(v) for v in state["history"])


def least_squares_slope(values: Sequence[float]) -> float:
    """Slope per step of the least-squares line through `values` at steps 0, 1, ..."""
    n = len(values)
    mean_x = (n - 1) / 2
    mean_y = math.fsum(values) / n
    sxx = math.fsum((i - mean_x) ** 2 for i in range(n))
    sxy = math.fsum((i - mean_x) * (y - mean_y) for i, y in enumerate(values))
    return sxy / sxx


def number(value: Any) -> float | None:
    """A record value as a float; None for one that is absent or not a number (a flag is not:
    True would read as 1). numpy's scalars count, as the learner's reductions may leave them."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def oldest_version(record: Mapping[str, Any], step: int) -> int:
    """The oldest policy version that sampled the batch of `step`'s record: the learner was at
    version step - 1, and its rollouts lagged at most `staleness_max` versions behind (on
    policy where the record does not say)."""
    lag = number(record.get("staleness_max"))
    lag = 0.0 if lag is None or not math.isfinite(lag) or lag < 0 else lag
    return step - 1 - int(lag)


def check(objective: Objective, track: Track, value: float, min_baseline: int) -> Check | None:
    """`value` against `objective`; None when it cannot be judged yet (too few values behind
    its baseline, no best seen, a window not yet full, a baseline of 0 to scale by)."""
    if not math.isfinite(value):
        return Check(True, value, None)
    bound = objective.bound
    if objective.comparison is Comparison.CEILING:
        return Check(value > bound, value, bound)
    if objective.comparison is Comparison.DROP_FROM_BEST:
        if track.best is None:
            return None
        return Check(value < track.best - bound, value, track.best - bound)
    if len(track.baseline) < min_baseline:
        return None
    base = statistics.median(track.baseline)
    if objective.comparison is Comparison.DROP_FROM_BASELINE:
        return Check(value < base - bound, value, base - bound)
    # The other comparisons scale by the baseline: one of 0 (or below) scales nothing.
    if base <= 0:
        return None
    if objective.comparison is Comparison.FRACTION_OF_BASELINE:
        return Check(value < bound * base, value, bound * base)
    if objective.comparison is Comparison.MULTIPLE_OF_BASELINE:
        return Check(value > bound * base, value, bound * base)
    if len(track.history) < track.window:
        return None
    slope = least_squares_slope(track.history) / base
    return Check(slope < bound, slope, bound)


class StabilityGuard:
    """Decides, per learner step, whether the run is still stable (module doc)."""

    def __init__(self, config: StabilityConfig) -> None:
        self.config = config
        self.objectives = objectives_of(config)
        self._tracks = {o.name: Track(config.baseline_window) for o in self.objectives}
        # Enough values behind a baseline for its median to mean something; at most a window.
        self._min_baseline = max(1, min(config.warmup_steps, config.baseline_window))
        self._seen = 0  # records observed
        self._last_step: int | None = None
        self._episode_start: int | None = None  # the first warning of the open episode
        self._fired = False  # whether the open episode has acted
        self._clean_run = 0  # consecutive steps with no objective open
        self._rollbacks = 0
        self._pending: list[int] = []  # checkpoints not yet healthy, nor spoilt
        # Per pending checkpoint: clean steps so far on rollouts its policy or a later one made.
        self._judged: dict[int, int] = {}
        self._healthy: int | None = None
        self._last_checkpoint: int | None = None

    @property
    def rollbacks(self) -> int:
        """Rollbacks decided so far."""
        return self._rollbacks

    def observe(self, record: Mapping[str, Any]) -> GuardDecision:
        """Judge one learner step's metrics record (once per step, in order)."""
        step = self._step_of(record)
        if not self.config.enabled:
            return GuardDecision(step)
        self._seen += 1
        breaches = tuple(
            breach
            for objective in self.objectives
            if (breach := self._evaluate(objective, record, step)) is not None
        )
        clean = all(track.streak == 0 for track in self._tracks.values())
        self._advance_checkpoints(step, clean, oldest_version(record, step))
        self._advance_episode(step, clean)
        return self._decide(step, breaches)

    def _step_of(self, record: Mapping[str, Any]) -> int:
        # The driver's `step` where the record has it; otherwise the next one.
        given = number(record.get("step"))
        if given is not None and math.isfinite(given):
            step = int(given)
        else:
            step = 1 if self._last_step is None else self._last_step + 1
        self._last_step = step
        return step

    def _evaluate(
        self, objective: Objective, record: Mapping[str, Any], step: int
    ) -> Breach | None:
        """Evaluate one objective on `record` (if it has the key), update what the guard keeps
        of it, and return the breach if it is broken."""
        value = number(record.get(objective.key))
        if value is None or (objective.requires and objective.requires not in record):
            return None
        track = self._tracks[objective.name]
        finite = math.isfinite(value)
        if finite and objective.comparison is Comparison.SLOPE:
            track.history.append(value)
        warming = finite and self._seen <= self.config.warmup_steps
        result = None if warming else check(objective, track, value, self._min_baseline)
        if finite and objective.comparison.uses_baseline and not (result and result.broken):
            track.baseline.append(value)
        if finite and objective.comparison is Comparison.DROP_FROM_BEST:
            track.best = value if track.best is None else max(track.best, value)
        if result is None:
            return None
        if not result.broken:
            track.streak, track.since = 0, None
            return None
        track.streak += 1
        track.since = step if track.since is None else track.since
        return Breach(
            objective.name,
            objective.key,
            result.value,
            objective.bound,
            result.limit,
            track.streak,
            track.since,
        )

    def _advance_checkpoints(self, step: int, clean: bool, oldest: int) -> None:
        # A pending checkpoint is healthy once `patience` clean steps trained on rollouts that
        # its policy or a later one sampled (`oldest`: the oldest version in the step's batch).
        # Under staleness the first steps after it train on older policies' rollouts, whose
        # signals say nothing of it: at staleness 8 a policy that collapsed at the checkpoint
        # shows it only about 8 steps later. Any step with an objective open before then spoils
        # it, whatever its rollouts' age.
        pending = []
        for at in self._pending:
            if at >= step:
                pending.append(at)
                continue
            if not clean:
                self._judged.pop(at, None)
                continue
            if oldest >= at:
                self._judged[at] = self._judged.get(at, 0) + 1
            if self._judged.get(at, 0) >= self.config.patience:
                self._judged.pop(at)
                self._healthy = at if self._healthy is None else max(self._healthy, at)
            else:
                pending.append(at)
        self._pending = pending

    def _advance_episode(self, step: int, clean: bool) -> None:
        if not clean:
            self._clean_run = 0
            if self._episode_start is None:
                self._episode_start = step
            return
        self._clean_run += 1
        if self._episode_start is not None and self._clean_run >= self.config.patience:
            self._episode_start, self._fired = None, False

    def _decide(self, step: int, breaches: tuple[Breach, ...]) -> GuardDecision:
        due = [b for b in breaches if b.streak >= self.config.patience]
        if self._fired or not due:
            return GuardDecision(step, rollbacks=self._rollbacks, broken=breaches)
        self._fired = True
        # The objective broken longest; the spec's order breaks ties.
        trigger = max(due, key=lambda b: b.streak)
        action: Action = self.config.action
        rollback_to = None
        if action == "rollback":
            if self._rollbacks >= self.config.max_rollbacks:
                action = "stop_unstable"
            else:
                self._rollbacks += 1
                rollback_to = self._healthy
        return GuardDecision(
            step,
            action,
            trigger.objective,
            trigger.key,
            trigger.value,
            trigger.bound,
            trigger.limit,
            trigger.since,
            rollback_to,
            self._rollbacks,
            breaches,
        )

    def checkpointed(self, step: int) -> None:
        """The driver wrote a checkpoint of the policy after `step`."""
        if step not in self._pending:
            self._pending.append(step)
            self._pending.sort()
        last = self._last_checkpoint
        self._last_checkpoint = step if last is None else max(last, step)

    def rolled_back(self, step: int | None, rollbacks: int) -> None:
        """The run went back to the checkpoint of `step` (None: to the start), this guard being
        the one saved with it; `rollbacks`: the run's rollbacks, this one included. That
        checkpoint is the healthy one, the episode that acted is closed, and newer checkpoints
        are gone with the steps they held."""
        self._rollbacks = rollbacks
        self._episode_start, self._fired, self._clean_run = None, False, 0
        self._pending = []  # older than the healthy one: they no longer matter
        self._judged = {}
        self._healthy = step
        self._last_checkpoint = step
        self._last_step = step
        for track in self._tracks.values():
            track.streak, track.since = 0, None

    def resumed(self, step: int) -> None:
        """The run paused at `step` (the guard decided `pause` there and the driver wrote its
        checkpoint, this guard being the one saved with it) and resumes from that checkpoint.

        The episode that acted is closed and each objective's count of consecutive broken
        evaluations starts again: an objective still broken after the resume (the operator's
        patch did not help) makes the guard act once it has been broken for `patience` more
        evaluations, not at the first step. Baselines are kept: they hold values of steps in
        which their objective held. The checkpoints keep their judgement: the one of `step`,
        taken with objectives broken, becomes healthy only once `patience` clean steps follow
        it, as any other."""
        self._episode_start, self._fired, self._clean_run = None, False, 0
        self._last_step = step
        for track in self._tracks.values():
            track.streak, track.since = 0, None

    def healthy_checkpoint(self) -> int | None:
        """The newest checkpoint judged healthy (module doc)."""
        return self._healthy

    def kept_checkpoints(self) -> tuple[int, ...]:
        """The checkpoints a rollback may still return to: the healthy one, and those not yet
        judged (pruning them could leave none healthy when one becomes so)."""
        healthy = () if self._healthy is None else (self._healthy,)
        return (*healthy, *self._pending)

    def wants_checkpoint(self, step: int) -> bool:
        """Whether the driver should write a checkpoint after `step`: the first warning of an
        episode, with no checkpoint there yet and the newest healthy one too old or absent."""
        if not self.config.enabled or self._episode_start != step:
            return False
        if self._last_checkpoint is not None and self._last_checkpoint >= step:
            return False
        healthy = self._healthy
        return healthy is None or step - healthy > self.config.max_healthy_age_steps

    def state(self) -> dict[str, Any]:
        """Everything the guard keeps, as JSON (baselines hold finite values only)."""
        return {
            "version": STATE_VERSION,
            "seen": self._seen,
            "last_step": self._last_step,
            "episode_start": self._episode_start,
            "fired": self._fired,
            "clean_run": self._clean_run,
            "rollbacks": self._rollbacks,
            "pending": list(self._pending),
            "judged": {str(at): clean for at, clean in self._judged.items()},
            "healthy": self._healthy,
            "last_checkpoint": self._last_checkpoint,
            "objectives": {name: track.state() for name, track in self._tracks.items()},
        }

    @classmethod
    def from_state(cls, config: StabilityConfig, state: Mapping[str, Any]) -> StabilityGuard:
        """A guard as `state()` left it. An objective switched on since starts afresh; one
        switched off is dropped."""
        if state.get("version") != STATE_VERSION:
            found = state.get("version")
            raise ValueError(f"stability guard state version {found!r}, expected {STATE_VERSION}")
        guard = cls(config)
        guard._seen = int(state["seen"])
        guard._last_step = state["last_step"]
        guard._episode_start = state["episode_start"]
        guard._fired = bool(state["fired"])
        guard._clean_run = int(state["clean_run"])
        guard._rollbacks = int(state["rollbacks"])
        guard._pending = [int(step) for step in state["pending"]]
        # A state saved before checkpoints were judged on their own rollouts has none counted.
        guard._judged = {int(at): int(clean) for at, clean in state.get("judged", {}).items()}
        guard._healthy = state["healthy"]
        guard._last_checkpoint = state["last_checkpoint"]
        for name, saved in state["objectives"].items():
            if name in guard._tracks:
                guard._tracks[name].restore(saved)
        return guard
