"""Per-run outcomes and per-cell figures over seeds.

Each run ends in one of three outcomes, decided from its held-out evaluations (every
`checkpoint_every` steps, step 0 the starting model) and its training records:
- collapsed: its final accuracy is more than ACCURACY_DROP below the best it reached, *and* it
  shows a symptom of a collapse: more than TRUNCATION of the responses run into the length limit
  (at the last evaluation or over the last TAIL steps), its entropy over the last TAIL steps is
  above ENTROPY_BLOWUP or below ENTROPY_FRACTION times its first HEAD steps', or its KL from the
  starting model at the end is more than KL_FACTOR times the median of every run under the same
  setting (far past the others);
- learned: not collapsed, and its final accuracy is at least LEARNED_GAIN above the start's
  (about 2 paired standard errors on 512 prompts);
- did not learn: everything else, including a run that drifted down without a symptom.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stability_study.grid import Cell
from stability_study.runner import RunResult
from stability_study.stats import bootstrap_interval

TAIL = 10
HEAD = 5
ACCURACY_DROP = 0.05
TRUNCATION = 0.5
ENTROPY_BLOWUP = 2.0
ENTROPY_FRACTION = 0.3
KL_FACTOR = 4.0
LEARNED_GAIN = 0.03

COLLAPSED, LEARNED, DID_NOT_LEARN = "collapsed", "learned", "did not learn"
# The paper's ratio diagnostics the learner logs every step, of the raw ratios (`raw_`) and of
# the estimator's (`filtered_`: KPO's filtered ratio, the others' own).
DYNAMICS = (
    "switch_frequency",
    "low_frequency_ratio",
    "run_length_up",
    "run_length_down",
    "run_length_on",
)


@dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation over seeds (0 for a single seed)."""

    mean: float
    std: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        finite = [v for v in values if math.isfinite(v)]
        if not finite:
            return cls(math.nan, math.nan)
        std = float(np.std(finite, ddof=1)) if len(finite) > 1 else 0.0
        return cls(float(np.mean(finite)), std)

    def format(self, digits: int = 3) -> str:
        if math.isnan(self.mean):
            return "n/a"
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f}"


@dataclass(frozen=True)
class Interval:
    """A mean over seeds with its bootstrap 95% interval."""

    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Interval:
        low, high = bootstrap_interval(values)
        return cls(float(np.mean(values)), low, high)

    def format(self, digits: int = 3) -> str:
        return f"{self.mean:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"


def values_of(result: RunResult, key: str) -> list[float]:
    return [float(r[key]) for r in result.records if r.get(key) is not None]


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def final_step(result: RunResult) -> int:
    return max(result.evaluations)


def accuracy_gain(result: RunResult) -> float:
    """Final minus starting held-out accuracy: paired (same prompts, same sampling seed)."""
    return result.accuracy[final_step(result)] - result.accuracy[0]


def final_kl_from_start(result: RunResult) -> float:
    return result.evaluations[final_step(result)].kl_from_start


def symptoms(result: RunResult, kl_median: float) -> list[str]:
    """The signs of a collapse `result` shows (module doc); `kl_median` is that of every run
    under the same setting."""
    found = []
    final = result.evaluations[final_step(result)]
    truncated = max(final.truncated, _mean(values_of(result, "truncated_fraction")[-TAIL:]))
    if truncated > TRUNCATION:
        found.append(f"{truncated:.0%} of responses truncated")
    entropy = values_of(result, "entropy")
    if len(entropy) >= HEAD + TAIL:
        start, end = _mean(entropy[:HEAD]), _mean(entropy[-TAIL:])
        if end > ENTROPY_BLOWUP * start or end < ENTROPY_FRACTION * start:
            found.append(f"entropy {end:.3f} vs {start:.3f} at the start")
    if kl_median > 0 and final.kl_from_start > KL_FACTOR * kl_median:
        found.append(f"KL from the start {final.kl_from_start:.3f} vs median {kl_median:.3f}")
    return found


@dataclass(frozen=True)
class Outcome:
    kind: str  # COLLAPSED, LEARNED or DID_NOT_LEARN
    reasons: tuple[str, ...]


def outcome(result: RunResult, kl_median: float) -> Outcome:
    """How `result` ended (module doc)."""
    best = max(result.accuracy.values())
    final = result.accuracy[final_step(result)]
    fell = final < best - ACCURACY_DROP
    found = symptoms(result, kl_median)
    if fell and found:
        return Outcome(COLLAPSED, (f"held-out accuracy {final:.3f} vs best {best:.3f}", *found))
    if accuracy_gain(result) >= LEARNED_GAIN:
        return Outcome(LEARNED, ())
    why = [f"accuracy {result.accuracy[0]:.3f} -> {final:.3f}"]
    if fell:
        why.append(f"fell from {best:.3f} without a collapse symptom")
    return Outcome(DID_NOT_LEARN, tuple(why + found))


def setting_kl_median(results: Sequence[RunResult]) -> float:
    """The median final KL from the start over `results` (every run under one setting)."""
    values = [final_kl_from_start(r) for r in results]
    return float(statistics.median(values)) if values else math.nan


@dataclass(frozen=True)
class CellSummary:
    cell: Cell
    seeds: tuple[int, ...]
    gains: dict[int, float]  # accuracy gain by seed
    gain: Interval
    accuracy: dict[int, Spread]  # held-out accuracy by evaluation step
    reward_tail: Spread  # mean reward of the last TAIL steps
    entropy_tail: Spread
    clip_fraction: Spread  # mean over steps
    shrinkage: Spread  # kalman_shrinkage_mean over steps (KPO only)
    kl_behaviour: Spread  # approx_kl (k3 against the behaviour policy) averaged over steps
    kl_from_start: Spread  # at the last evaluation
    truncated: Spread  # at the last evaluation
    staleness: Spread  # measured staleness_mean averaged over steps
    step_seconds: Spread
    outcomes: dict[int, Outcome]  # by seed
    # `raw_<name>` and `filtered_<name>` of DYNAMICS, each averaged over steps, over seeds.
    dynamics: dict[str, Spread]

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes.values())


def summarize(results: Sequence[RunResult], kl_median: float) -> CellSummary:
    """The figures of one cell from its runs (one per seed); `kl_median` as in `outcome`."""
    if not results:
        raise ValueError("a cell summary needs at least one run")
    steps = sorted(set.intersection(*(set(r.accuracy) for r in results)))
    gains = {r.seed: accuracy_gain(r) for r in results}
    last = [r.evaluations[final_step(r)] for r in results]
    return CellSummary(
        cell=results[0].cell,
        seeds=tuple(r.seed for r in results),
        gains=gains,
        gain=Interval.of(list(gains.values())),
        accuracy={s: Spread.of([r.accuracy[s] for r in results]) for s in steps},
        reward_tail=Spread.of([_mean(values_of(r, "reward_mean")[-TAIL:]) for r in results]),
        entropy_tail=Spread.of([_mean(values_of(r, "entropy")[-TAIL:]) for r in results]),
        clip_fraction=Spread.of([_mean(values_of(r, "clip_fraction")) for r in results]),
        shrinkage=Spread.of([_mean(values_of(r, "kalman_shrinkage_mean")) for r in results]),
        kl_behaviour=Spread.of([_mean(values_of(r, "approx_kl")) for r in results]),
        kl_from_start=Spread.of([e.kl_from_start for e in last]),
        truncated=Spread.of([e.truncated for e in last]),
        staleness=Spread.of([_mean(values_of(r, "staleness_mean")) for r in results]),
        step_seconds=Spread.of([_mean(values_of(r, "step_seconds")) for r in results]),
        outcomes={r.seed: outcome(r, kl_median) for r in results},
        dynamics={
            key: Spread.of([_mean(values_of(r, key)) for r in results])
            for name in DYNAMICS
            for key in (f"raw_{name}", f"filtered_{name}")
        },
    )


def paired_difference(arm: CellSummary, baseline: CellSummary) -> Interval | None:
    """The arm's gain minus the baseline's on the seeds both ran, with its bootstrap interval."""
    shared = sorted(set(arm.gains) & set(baseline.gains))
    if not shared:
        return None
    return Interval.of([arm.gains[s] - baseline.gains[s] for s in shared])


def curve(
    results: Sequence[RunResult], key: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, min, max) of `key` over the seeds, on the steps every run recorded it."""
    by_step: dict[int, list[float]] = {}
    for result in results:
        for record in result.records:
            value = record.get(key)
            if value is not None and math.isfinite(value):
                by_step.setdefault(int(record["step"]), []).append(float(value))
    steps = np.array(sorted(s for s, v in by_step.items() if len(v) == len(results)))
    values = [by_step[int(s)] for s in steps]
    return (
        steps,
        np.array([np.mean(v) for v in values]),
        np.array([min(v) for v in values]),
        np.array([max(v) for v in values]),
    )
