"""The stability guard replayed on the study's recorded runs, and its default bounds from them.

    python -m benchmarks.stability_study.guard_replay     # the tables of docs/results.md

Every run of the studies in REPLAYED, each under docs/results/<study>/metrics (one CSV per cell:
a row per seed and step, empty cells absent from the record; evals.csv: held-out evaluations),
becomes the stream of metrics records the guard would have read (services/pipeline/guard.py).
The study evaluated every 10 steps; an evaluation joins the record after its step, as the
pipeline's does (the starting model's at step 0 and the last one have no record to join: the
pipeline makes neither part of its records). This replays recorded metric streams: nothing
acted on the runs.

Each run is classified with the study's own criterion (stability_study.summary.outcome, the KL
median over every run of its setting in its study, as the report does), and grouped:
- healthy: every run of a cell (study, arm, setting) none of whose seeds collapsed, whether it
  learned or not (the stressed arms that drifted down without a symptom included);
- collapsing: the runs the criterion calls collapsed;
- at risk: the other seeds of a cell in which some seed collapsed. The guard may act on them or
  not; they constrain nothing.
The collapse point of a collapsing run is the first evaluation step at which the run, cut
there (its records, its evaluations and its setting's KL median), is already classified
collapsed.

`derive_defaults` sets each objective's bound from the healthy runs alone. The compared
quantity is the guard's own (`check`, with the baseline it keeps on a run where the objective
holds): entropy / its running median, the entropy's relative slope, the clip fraction, the
gradient norm / its running median, the non-finite tokens, the reward's drop below its running
median, held-out accuracy's drop below the best seen, KPO's filtered switch frequency. The
healthy extreme is the most extreme value any healthy run held for `patience` consecutive
evaluations (against a baseline of all its values: the guard's leaves broken values out, so a
bound at the extreme itself may still act on a run, which the margin absorbs). The bound lies
MARGIN (1.25) times that extreme's distance from the neutral value (1 for a ratio to a baseline,
0 otherwise), rounded away from the healthy runs to two significant figures. An objective no
healthy run records keeps the spec's bound.
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# `python -m benchmarks.stability_study.guard_replay` from the repository root: the study's
# modules import each other as `stability_study`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.pipeline.guard import (
    OBJECTIVE_COMPARISONS,
    Check,
    Comparison,
    GuardDecision,
    Objective,
    StabilityGuard,
    Track,
    check,
    number,
)
from services.spec.stability import StabilityConfig, StabilityObjectives
from stability_study.evaluate import Evaluation
from stability_study.grid import ARMS, IN_FLIGHT_ARMS, Cell, Method, setting_named
from stability_study.runner import RunResult
from stability_study.summary import COLLAPSED, Outcome, outcome, setting_kl_median

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
# The studies whose runs are replayed: those made before the guard acted on any run. The guard
# phase's runs (study `guard`) are its own evidence, reported as runs, not replayed.
REPLAYED = ("arms-reduced", "inflight-reduced", "study")
EVAL_KEY = "eval_accuracy_avg_at_k"
MARGIN = 1.25
FIGURES = 2
HEALTHY, COLLAPSING, AT_RISK = "healthy", "collapsing", "at risk"
# Comparisons broken below their bound (the others: above it).
FLOORS = (Comparison.FRACTION_OF_BASELINE, Comparison.SLOPE)
# Comparisons of a ratio to a baseline: neutral at 1 (the others at 0).
RATIOS = (Comparison.FRACTION_OF_BASELINE, Comparison.MULTIPLE_OF_BASELINE)

# The defaults before they were derived here, set from the signals' scales (for comparison).
PROVISIONAL: dict[str, float | None] = {
    "entropy_min_fraction": 0.5,
    "entropy_slope_min": -0.02,
    "clip_fraction_max": 0.4,
    "grad_norm_max_ratio": 5.0,
    "nonfinite_tokens_max": 0.0,
    "reward_drop_max": 0.2,
    "held_out_drop_max": 0.05,
    "switch_frequency_max": 0.2,
    "truncated_fraction_max": None,
    "approx_kl_max": None,
}

Record = dict[str, Any]


@dataclass(frozen=True)
class RecordedRun:
    """One recorded run: its study (the folder under docs/results), its result as the study's
    analysis reads it, the guard's record stream, its outcome, group and collapse point."""

    study: str
    result: RunResult
    records: list[Record]
    outcome: Outcome
    group: str
    collapse_step: int | None

    @property
    def name(self) -> str:
        return f"{self.study} {self.result.cell.key} s{self.result.seed}"


def method_named(key: str) -> Method:
    for method in (*ARMS, *IN_FLIGHT_ARMS):
        if method.key == key:
            return method
    raise ValueError(f"unknown arm {key!r}")


def read_records(path: Path) -> dict[int, list[Record]]:
    """A cell's CSV: each seed's records in step order (an empty cell: the key is absent)."""
    runs: dict[int, list[Record]] = {}
    with path.open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            seed = int(row.pop("seed"))
            record = {k: int(v) if k == "step" else float(v) for k, v in row.items() if v != ""}
            runs.setdefault(seed, []).append(record)
    return {seed: sorted(records, key=lambda r: int(r["step"])) for seed, records in runs.items()}


def read_evaluations(path: Path) -> dict[tuple[str, int], dict[int, Evaluation]]:
    """evals.csv: each (cell key, seed)'s held-out evaluations by step."""
    found: dict[tuple[str, int], dict[int, Evaluation]] = {}
    with path.open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            evaluation = Evaluation(
                float(row["accuracy"]), float(row["truncated"]), float(row["kl_from_start"])
            )
            found.setdefault((row["cell"], int(row["seed"])), {})[int(row["step"])] = evaluation
    return found


def guard_records(result: RunResult) -> list[Record]:
    """The records the guard reads: the run's, each evaluation after step 0 joining the next."""
    records = [dict(r) for r in result.records]
    by_step = {int(r["step"]): r for r in records}
    for step, evaluation in result.evaluations.items():
        if step > 0 and step + 1 in by_step:
            by_step[step + 1][EVAL_KEY] = evaluation.accuracy
    return records


def cut(result: RunResult, step: int) -> RunResult:
    """`result` as it stood after `step`."""
    records = [r for r in result.records if int(r["step"]) <= step]
    evaluations = {s: e for s, e in result.evaluations.items() if s <= step}
    return replace(result, records=records, evaluations=evaluations)


def collapse_step(result: RunResult, setting: Sequence[RunResult]) -> int | None:
    """The first evaluation step at which `result` cut there is classified collapsed, the KL
    median being that of every run of `setting` cut there too; None if it never is."""
    for step in sorted(s for s in result.evaluations if s > 0):
        median = setting_kl_median([cut(r, step) for r in setting if step in r.evaluations])
        if outcome(cut(result, step), median).kind == COLLAPSED:
            return step
    return None


def load_study(directory: Path) -> list[RecordedRun]:
    """Every run recorded under `directory` (a study's metrics folder), classified."""
    evaluations = read_evaluations(directory / "evals.csv")
    results = [
        RunResult(
            Cell(method_named(arm), setting_named(setting)),
            seed,
            path,
            records,
            evaluations[(path.stem, seed)],
            math.nan,
        )
        for path in sorted(directory.glob("*__*.csv"))
        for arm, setting in [path.stem.split("__")]
        for seed, records in read_records(path).items()
    ]
    by_setting: dict[str, list[RunResult]] = {}
    for result in results:
        by_setting.setdefault(result.cell.setting.key, []).append(result)
    medians = {key: setting_kl_median(runs) for key, runs in by_setting.items()}
    outcomes = [outcome(r, medians[r.cell.setting.key]) for r in results]
    struck = {r.cell.key for r, o in zip(results, outcomes, strict=True) if o.kind == COLLAPSED}
    runs = []
    for result, found in zip(results, outcomes, strict=True):
        collapsed = found.kind == COLLAPSED
        group = COLLAPSING if collapsed else AT_RISK if result.cell.key in struck else HEALTHY
        point = collapse_step(result, by_setting[result.cell.setting.key]) if collapsed else None
        runs.append(
            RecordedRun(directory.parent.name, result, guard_records(result), found, group, point)
        )
    return runs


def load_runs(results: Path = RESULTS) -> list[RecordedRun]:
    """Every recorded run of the studies in REPLAYED under `results`."""
    folders = [results / name / "metrics" for name in REPLAYED]
    return [run for folder in folders if folder.is_dir() for run in load_study(folder)]


def guard_config(bounds: Mapping[str, float | None], **settings: Any) -> StabilityConfig:
    """The guard switched on with these objective bounds (the others at their defaults)."""
    return StabilityConfig.model_validate({"enabled": True, "objectives": bounds, **settings})


def replay(records: Iterable[Mapping[str, Any]], config: StabilityConfig) -> list[GuardDecision]:
    """The guard's decision after each record."""
    guard = StabilityGuard(config)
    return [guard.observe(record) for record in records]


def first_action(decisions: Iterable[GuardDecision]) -> GuardDecision | None:
    return next((d for d in decisions if d.action != "none"), None)


def _compared(comparison: Comparison, result: Check) -> float:
    # The probe bound (1 for a ratio, 0 otherwise) makes the limit the baseline or best itself.
    assert result.limit is not None
    if comparison in RATIOS:
        return result.value / result.limit
    if comparison in (Comparison.DROP_FROM_BASELINE, Comparison.DROP_FROM_BEST):
        return result.limit - result.value
    return result.value


def compared_values(
    records: Iterable[Mapping[str, Any]], name: str, config: StabilityConfig
) -> list[float]:
    """What objective `name` compares with its bound at each evaluation of `records`, with the
    baselines the guard keeps on a run where that objective holds (every value joins them), the
    guard's warm-up and window from `config`. Values that are not finite are left out: they
    break the objective whatever its bound."""
    key, comparison, requires = OBJECTIVE_COMPARISONS[name]
    probe = Objective(name, key, comparison, 1.0 if comparison in RATIOS else 0.0, requires)
    track = Track(config.baseline_window)
    min_baseline = max(1, min(config.warmup_steps, config.baseline_window))
    found = []
    for seen, record in enumerate(records, start=1):
        value = number(record.get(key))
        if value is None or not math.isfinite(value) or (requires and requires not in record):
            continue
        if comparison is Comparison.SLOPE:
            track.history.append(value)
        result = None if seen <= config.warmup_steps else check(probe, track, value, min_baseline)
        if comparison.uses_baseline:
            track.baseline.append(value)
        if comparison is Comparison.DROP_FROM_BEST:
            track.best = value if track.best is None else max(track.best, value)
        if result is not None:
            found.append(_compared(comparison, result))
    return found


def held_extreme(values: Sequence[float], patience: int, floor: bool) -> float | None:
    """The most extreme value held for `patience` consecutive evaluations: the lowest of the
    windows' highest values for a floor, the highest of their lowest for a ceiling."""
    windows = [values[i : i + patience] for i in range(len(values) - patience + 1)]
    if not windows:
        return None
    return min(max(w) for w in windows) if floor else max(min(w) for w in windows)


def round_away(neutral: float, distance: float) -> float:
    """neutral + distance, |distance| rounded up to FIGURES significant figures."""
    if distance == 0:
        return neutral
    step = 10.0 ** (math.floor(math.log10(abs(distance))) - FIGURES + 1)
    size = math.ceil(round(abs(distance) / step, 9)) * step
    return round(neutral + math.copysign(size, distance), 12)


@dataclass(frozen=True)
class Derivation:
    """One objective's bound from the healthy runs. extreme: their extreme held for `patience`
    evaluations (None: no healthy run carries the key), from `run`; bound: the rule's."""

    objective: str
    extreme: float | None
    run: str | None
    bound: float | None


def derive_defaults(
    healthy_runs: Sequence[RecordedRun], config: StabilityConfig | None = None
) -> dict[str, Derivation]:
    """Each objective's bound from `healthy_runs` (module doc), for the guard's patience,
    warm-up and window in `config` (the spec's defaults: its bounds play no part)."""
    config = config or StabilityConfig()
    derived = {}
    for name, (_, comparison, _) in OBJECTIVE_COMPARISONS.items():
        floor = comparison in FLOORS
        extremes = []
        for run in healthy_runs:
            values = compared_values(run.records, name, config)
            value = held_extreme(values, config.patience, floor)
            if value is not None:
                extremes.append((value, run.name))
        if not extremes:
            derived[name] = Derivation(name, None, None, None)
            continue
        extreme, source = min(extremes) if floor else max(extremes)
        neutral = 1.0 if comparison in RATIOS else 0.0
        bound = round_away(neutral, MARGIN * (extreme - neutral))
        derived[name] = Derivation(name, extreme, source, bound)
    return derived


def only(bounds: Mapping[str, float | None], name: str) -> dict[str, float | None]:
    """`bounds` with every objective but `name` off."""
    return {n: bound if n == name else None for n, bound in bounds.items()}


def derived_bounds(derived: Mapping[str, Derivation]) -> dict[str, float | None]:
    """The derived bounds, the spec's default where there was nothing to derive from."""
    defaults = StabilityObjectives().model_dump()
    return {n: defaults[n] if d.bound is None else d.bound for n, d in derived.items()}


# --- the report -----------------------------------------------------------------------------------

QUANTITY = {
    "entropy_min_fraction": "entropy / its running median",
    "entropy_slope_min": "entropy's slope / its running median",
    "clip_fraction_max": "clip fraction",
    "grad_norm_max_ratio": "gradient norm / its running median",
    "nonfinite_tokens_max": "non-finite tokens",
    "reward_drop_max": "running median of the reward - reward",
    "held_out_drop_max": "best held-out accuracy - held-out accuracy",
    "switch_frequency_max": "filtered switch frequency (KPO)",
    "truncated_fraction_max": "fraction of responses truncated",
    "approx_kl_max": "KL to the behaviour policy",
}


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.4g}"


def _spread(values: Sequence[int]) -> str:
    if not values:
        return "–"
    return f"{statistics.median(values):g} ({min(values)} to {max(values)})"


def _step(decision: GuardDecision | None, why: bool = False) -> str:
    if decision is None:
        return "–"
    return (
        f"{decision.step} ({decision.reason} since {decision.since})" if why else str(decision.step)
    )


Decisions = dict[str, list[GuardDecision]]  # each run's decisions, by run name


def objectives_table(
    derived: Mapping[str, Derivation], alone: Mapping[str, Decisions], collapsing: int
) -> list[str]:
    """Each objective: the healthy runs' extreme, the bounds, the collapsing runs it acts on."""
    patience = StabilityConfig().patience
    headers = [
        "objective",
        "compared quantity",
        f"healthy extreme, held {patience} evaluations",
        "from run",
        "derived bound",
        "provisional bound",
        "collapsing runs it acts on alone",
    ]
    rows = [
        [
            f"`{name}`",
            QUANTITY[name],
            _number(d.extreme),
            d.run or "no run records it",
            _number(d.bound) if d.bound is not None else f"{_number(PROVISIONAL[name])} (kept)",
            _number(PROVISIONAL[name]),
            f"{sum(first_action(x) is not None for x in alone[name].values())} / {collapsing}",
        ]
        for name, d in derived.items()
    ]
    return _table(headers, rows)


def collapsing_table(
    collapsing: Sequence[RecordedRun],
    alone: Mapping[str, Decisions],
    replays: Mapping[str, Decisions],
) -> list[str]:
    """Each collapsing run: its collapse point, each objective's first action alone, and the
    guard's with every objective on."""
    headers = [
        "collapsing run",
        "collapse point",
        *(f"`{n}` alone" for n in alone),
        *(f"guard, {label}" for label in replays),
    ]
    rows = [
        [
            r.name,
            str(r.collapse_step),
            *(_step(first_action(by_run[r.name])) for by_run in alone.values()),
            *(_step(first_action(by_run[r.name]), why=True) for by_run in replays.values()),
        ]
        for r in collapsing
    ]
    return _table(headers, rows)


def _count(acted: Mapping[str, GuardDecision | None], runs: Sequence[RecordedRun]) -> str:
    return f"{sum(acted[r.name] is not None for r in runs)} / {len(runs)}"


def defaults_table(runs: Sequence[RecordedRun], replays: Mapping[str, Decisions]) -> list[str]:
    """Each set of defaults: the runs it acts on, and how soon."""
    group = {kind: [r for r in runs if r.group == kind] for kind in (HEALTHY, AT_RISK, COLLAPSING)}
    headers = [
        "defaults",
        "healthy runs acted on",
        "healthy runs with a broken evaluation",
        "at-risk runs acted on",
        "collapsing runs caught",
        "steps from the first broken evaluation to the action",
        "steps from the collapse point to the action",
    ]
    rows = []
    for label, by_run in replays.items():
        acted = {name: first_action(decisions) for name, decisions in by_run.items()}
        caught = [(r, d) for r in group[COLLAPSING] if (d := acted[r.name]) is not None]
        warned = sum(any(d.broken for d in by_run[r.name]) for r in group[HEALTHY])
        rows.append(
            [
                label,
                _count(acted, group[HEALTHY]),
                f"{warned} / {len(group[HEALTHY])}",
                _count(acted, group[AT_RISK]),
                _count(acted, group[COLLAPSING]),
                _spread([d.step - d.since for _, d in caught if d.since is not None]),
                _spread(
                    [d.step - r.collapse_step for r, d in caught if r.collapse_step is not None]
                ),
            ]
        )
    return _table(headers, rows)


def report(runs: Sequence[RecordedRun]) -> list[str]:
    """The replay's tables: the derivation, each collapsing run, both sets of defaults."""
    healthy = [r for r in runs if r.group == HEALTHY]
    collapsing = [r for r in runs if r.group == COLLAPSING]
    derived = derive_defaults(healthy)
    bounds = {"provisional": PROVISIONAL, "derived": derived_bounds(derived)}
    replays = {
        label: {r.name: replay(r.records, guard_config(b)) for r in runs}
        for label, b in bounds.items()
    }
    # Each objective alone (the others off) at its derived bound, on the collapsing runs.
    alone = {
        name: {
            r.name: replay(r.records, guard_config(only(bounds["derived"], name)))
            for r in collapsing
        }
        for name in OBJECTIVE_COMPARISONS
    }
    counts = Counter(r.group for r in runs)
    summary = ", ".join(f"{counts[kind]} {kind}" for kind in (HEALTHY, COLLAPSING, AT_RISK))
    return [
        f"{len(runs)} recorded runs: {summary}; patience {StabilityConfig().patience}, "
        f"margin {MARGIN}.",
        "",
        *objectives_table(derived, alone, len(collapsing)),
        "",
        *collapsing_table(collapsing, alone, replays),
        "",
        *defaults_table(runs, replays),
    ]


def main() -> None:
    print("\n".join(report(load_runs())))


if __name__ == "__main__":
    main()
