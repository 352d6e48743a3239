"""Per-cell figures over seeds, and the collapse criterion.

A run counts as collapsed when any of these holds (each names a failure seen in RL of LLMs):
- held-out accuracy at the end is more than ACCURACY_DROP below the best it reached (step 0,
  the starting model, included): training destroyed what the model could do;
- mean token entropy over the last TAIL steps is below ENTROPY_FRACTION of the first steps':
  the policy collapsed onto a few outputs;
- over the last TAIL steps more than TRUNCATION of the responses hit max_new_tokens: the model
  stopped ending its answers (end-of-sequence decay).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stability_study.grid import Cell
from stability_study.runner import RunResult

TAIL = 10
HEAD = 5
ACCURACY_DROP = 0.05
ENTROPY_FRACTION = 0.3
TRUNCATION = 0.5


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


def _values(result: RunResult, key: str) -> list[float]:
    return [float(r[key]) for r in result.records if r.get(key) is not None]


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def collapse_reasons(result: RunResult) -> list[str]:
    """Why `result` counts as collapsed (module doc); empty when it did not."""
    reasons = []
    steps = sorted(result.accuracy)
    if steps:
        best = max(result.accuracy.values())
        final = result.accuracy[steps[-1]]
        if final < best - ACCURACY_DROP:
            reasons.append(f"held-out accuracy {final:.3f} vs best {best:.3f}")
    entropy = _values(result, "entropy")
    if len(entropy) > HEAD + TAIL:
        start, end = _mean(entropy[:HEAD]), _mean(entropy[-TAIL:])
        if end < ENTROPY_FRACTION * start:
            reasons.append(f"entropy {end:.3f} vs {start:.3f} at the start")
    truncated = _mean(_values(result, "truncated_fraction")[-TAIL:])
    if truncated > TRUNCATION:
        reasons.append(f"{truncated:.0%} of responses truncated")
    return reasons


@dataclass(frozen=True)
class CellSummary:
    cell: Cell
    seeds: int
    reward_tail: Spread  # mean reward of the last TAIL steps
    accuracy: dict[int, Spread]  # held-out accuracy by step
    accuracy_gain: Spread  # final minus initial held-out accuracy
    entropy_tail: Spread
    clip_fraction: Spread  # mean over steps
    kl_mean: Spread  # approx_kl (k3 against the reference) averaged over steps
    kl_max: float  # the largest per-step approx_kl of any seed
    staleness: Spread  # measured staleness_mean averaged over steps
    step_seconds: Spread  # learner seconds per step
    collapsed: int
    reasons: tuple[str, ...]


def summarize(results: Sequence[RunResult]) -> CellSummary:
    """The figures of one cell from its runs (one per seed)."""
    if not results:
        raise ValueError("a cell summary needs at least one run")
    steps = sorted(set.intersection(*(set(r.accuracy) for r in results)))
    reasons = [(r.seed, collapse_reasons(r)) for r in results]
    return CellSummary(
        cell=results[0].cell,
        seeds=len(results),
        reward_tail=Spread.of([_mean(_values(r, "reward_mean")[-TAIL:]) for r in results]),
        accuracy={s: Spread.of([r.accuracy[s] for r in results]) for s in steps},
        accuracy_gain=Spread.of([r.accuracy[steps[-1]] - r.accuracy[steps[0]] for r in results]),
        entropy_tail=Spread.of([_mean(_values(r, "entropy")[-TAIL:]) for r in results]),
        clip_fraction=Spread.of([_mean(_values(r, "clip_fraction")) for r in results]),
        kl_mean=Spread.of([_mean(_values(r, "approx_kl")) for r in results]),
        kl_max=max(max(_values(r, "approx_kl"), default=math.nan) for r in results),
        staleness=Spread.of([_mean(_values(r, "staleness_mean")) for r in results]),
        step_seconds=Spread.of([_mean(_values(r, "step_seconds")) for r in results]),
        collapsed=sum(bool(found) for _, found in reasons),
        reasons=tuple(f"seed {seed}: {'; '.join(found)}" for seed, found in reasons if found),
    )


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
