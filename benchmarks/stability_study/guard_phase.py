"""The guard phase's figures (stability_study.grid: GUARD_ARMS, GUARDED, BOUND_SETTINGS).

- Each arm under the stress without and with the stability guard rolling back: collapses by
  the study's criterion (summary.outcome), final held-out accuracy, paired by seed with the arm
  without the guard and with GRPO without it (the healthy baseline), the runs that end within
  its noise, rollbacks, and the responses the rollbacks dropped.
- False alarms: the guard's actions on healthy runs, GRPO under the stress and the demo's
  configuration (examples/demo.yaml, its 300 steps, the guard warning).
- The adaptive staleness bound against fixed bounds: trained tokens per second of wall time and
  final held-out accuracy.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.pipeline.launch import execute_run
from services.pipeline.outputs import RunDirectory, read_metrics
from services.spec import RunSpec
from stability_study.grid import BOUND_SETTINGS, GRPO, GUARD_ARMS, GUARD_STRESS, GUARDED, Cell
from stability_study.report import markdown_table
from stability_study.runner import RunResult, run_status, stopped_unstable
from stability_study.summary import (
    COLLAPSED,
    LEARNED,
    Interval,
    Spread,
    final_step,
    outcome,
    setting_kl_median,
    values_of,
)

DEMO_DIR = "demo-guard"
# A guarded run "ends within the healthy baseline's noise" when its final held-out accuracy is
# at least this many standard deviations (over seeds) below the baseline's mean, or above it.
NOISE_SDS = 2.0


def final_accuracy(result: RunResult) -> float:
    return result.accuracy[final_step(result)]


def last_value(records: Sequence[Mapping[str, object]], key: str) -> float:
    """The newest record's `key` (0 when no record carries it: the guard was off)."""
    for record in reversed(records):
        value = record.get(key)
        if isinstance(value, int | float):
            return float(value)
    return 0.0


def tokens_per_second(result: RunResult) -> float:
    """Trained tokens over the run's wall time (every attempt's, the learner's and waits)."""
    seconds = last_value(result.records, "wall_seconds")
    return last_value(result.records, "tokens_trained_total") / seconds if seconds else math.nan


def within_noise(value: float, baseline: Sequence[float]) -> bool:
    spread = Spread.of(baseline)
    return value >= spread.mean - NOISE_SDS * spread.std


@dataclass(frozen=True)
class DemoRun:
    """The demo's configuration run with the guard on: its steps and what the guard did."""

    steps: int
    actions: int
    broken_steps: int  # steps with at least one broken objective, acted on or not
    state: str


def run_demo(spec: RunSpec, out: Path, start: bool) -> DemoRun | None:
    """The demo configuration's run under `out` (run first when `start` and not finished)."""
    path = out / "runs" / DEMO_DIR
    if run_status(path).get("state") != "succeeded" and start:
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.iterdir():  # a half-written run starts again from scratch
            if stale.is_file():
                stale.unlink()
        execute_run(spec, RunDirectory(path))
    state = str(run_status(path).get("state") or "")
    if not state:
        return None
    records = read_metrics(path)
    return DemoRun(
        steps=len(records),
        actions=int(last_value(records, "guard_actions_total")),
        broken_steps=sum(bool(r.get("guard_broken_objectives")) for r in records),
        state=state,
    )


def _unsigned(interval: Interval, digits: int) -> str:
    return f"{interval.mean:.{digits}f} [{interval.low:.{digits}f}, {interval.high:.{digits}f}]"


def _per_run(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.mean(values):.1f} ({min(values):.0f} to {max(values):.0f})"


def _paired(runs: Sequence[RunResult], baseline: Sequence[RunResult]) -> str:
    by_seed = {r.seed: final_accuracy(r) for r in baseline}
    shared = [r for r in runs if r.seed in by_seed]
    if not shared:
        return ""
    return Interval.of([final_accuracy(r) - by_seed[r.seed] for r in shared]).format()


def arms_table(results: Mapping[Cell, Sequence[RunResult]]) -> list[str]:
    """Each guard arm without and with the guard (module doc)."""
    stressed = [r for c, rs in results.items() if c.setting in (GUARD_STRESS, GUARDED) for r in rs]
    kl_median = setting_kl_median(stressed)
    healthy = list(results.get(Cell(GRPO, GUARD_STRESS), []))
    baseline = [final_accuracy(r) for r in healthy]
    headers = [
        "arm",
        "guard",
        "runs",
        "collapsed / learned / did not learn",
        "stopped unstable",
        "final held-out accuracy, mean [95% CI]",
        "with minus without the guard, paired [95% CI]",
        "minus GRPO without the guard, paired [95% CI]",
        f"end within GRPO's noise (mean - {NOISE_SDS:g} sd)",
        "rollbacks per run (range)",
        "guard actions per run (range)",
        "responses dropped per run (range)",
    ]
    rows = []
    for method in GUARD_ARMS:
        without = list(results.get(Cell(method, GUARD_STRESS), []))
        for setting, label in ((GUARD_STRESS, "off"), (GUARDED, "rollback")):
            runs = list(results.get(Cell(method, setting), []))
            if not runs:
                continue
            kinds = [outcome(r, kl_median).kind for r in runs]
            counts = [kinds.count(k) for k in (COLLAPSED, LEARNED)]
            counts.append(len(kinds) - sum(counts))
            unstable = sum(stopped_unstable(r.path) for r in runs)
            rows.append(
                [
                    method.label,
                    label,
                    str(len(runs)),
                    " / ".join(map(str, counts)),
                    str(unstable),
                    _unsigned(Interval.of([final_accuracy(r) for r in runs]), 3),
                    _paired(runs, without) if setting is GUARDED else "",
                    _paired(runs, healthy) if method is not GRPO or setting is GUARDED else "",
                    f"{sum(within_noise(final_accuracy(r), baseline) for r in runs)} / {len(runs)}"
                    if baseline
                    else "n/a",
                    _per_run([last_value(r.records, "guard_rollbacks") for r in runs]),
                    _per_run([last_value(r.records, "guard_actions_total") for r in runs]),
                    _per_run([last_value(r.records, "rollouts_rolled_back_total") for r in runs]),
                ]
            )
    return markdown_table(headers, rows)


def bounds_table(results: Mapping[Cell, Sequence[RunResult]]) -> list[str]:
    """Trained tokens/s and final held-out accuracy under each staleness bound, paired by seed
    with the fixed bound of 8 (the loosest)."""
    by_setting = {c.setting: list(rs) for c, rs in results.items() if c.setting in BOUND_SETTINGS}
    loosest = by_setting.get(BOUND_SETTINGS[2], [])
    rate_by_seed = {r.seed: tokens_per_second(r) for r in loosest}
    headers = [
        "bound",
        "runs",
        "trained tokens/s, mean [95% CI]",
        "÷ fixed 8, paired",
        "final held-out accuracy, mean [95% CI]",
        "minus fixed 8's, paired [95% CI]",
        "staleness, mean",
        "bound at the end (range)",
        "bound changes per run (range)",
    ]
    rows = []
    for setting in BOUND_SETTINGS:
        runs = by_setting.get(setting, [])
        if not runs:
            continue
        rates = [tokens_per_second(r) for r in runs]
        ratios = [
            tokens_per_second(r) / rate_by_seed[r.seed] for r in runs if r.seed in rate_by_seed
        ]
        staleness = [v for r in runs for v in values_of(r, "staleness_mean")]
        rows.append(
            [
                setting.label,
                str(len(runs)),
                _unsigned(Interval.of(rates), 0),
                f"{statistics.mean(ratios):.3f}" if ratios else "",
                _unsigned(Interval.of([final_accuracy(r) for r in runs]), 3),
                _paired(runs, loosest) if setting is not BOUND_SETTINGS[2] else "",
                f"{statistics.mean(staleness):.2f}" if staleness else "n/a",
                *_adaptive(runs),
            ]
        )
    return markdown_table(headers, rows)


def _adaptive(runs: Sequence[RunResult]) -> list[str]:
    """The adaptive bound's value at the end and its changes per run ("fixed" for a fixed
    bound, whose records carry neither)."""
    if not any("staleness_bound" in r.records[-1] for r in runs if r.records):
        return ["fixed", "fixed"]
    return [
        _per_run([last_value(r.records, "staleness_bound") for r in runs]),
        _per_run([last_value(r.records, "staleness_bound_changes_total") for r in runs]),
    ]


def demo_line(demo: DemoRun | None) -> str:
    if demo is None:
        return "The demo's configuration has not been run with the guard on."
    return (
        f"The demo's configuration (`examples/demo.yaml`, the guard on with `action: warn`): "
        f"{demo.steps} steps, ended {demo.state}; the guard acted {demo.actions} times; "
        f"{demo.broken_steps} steps had an objective broken, acted on or not."
    )
