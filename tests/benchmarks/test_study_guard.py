"""The stability study's guard phase: its cells, its tables, and one real guarded run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kpo_core.config import KalmanEstimator
from services.pipeline.outputs import STATUS_FILE
from services.pipeline.specs import load_run_spec
from stability_study import guard_phase
from stability_study.evaluate import Evaluation
from stability_study.grid import (
    BOUND_ARM,
    BOUND_SETTINGS,
    GRPO,
    GUARD_ARMS,
    GUARD_STRESS,
    GUARDED,
    Cell,
    cell_spec,
    guard_cells,
)
from stability_study.runner import RunResult
from tests.benchmarks.test_study import STUDY_CONFIG, run_tiny_study


def test_the_guard_cells_are_each_arm_with_and_without_the_guard_and_the_bounds() -> None:
    base = load_run_spec(STUDY_CONFIG)
    cells = guard_cells()
    assert {m.key for m in GUARD_ARMS} == {"grpo", "kpo-matched-unclipped", "kpo-q0"}
    assert len(cells) == 2 * len(GUARD_ARMS) + len(BOUND_SETTINGS)
    for method in GUARD_ARMS:
        off = cell_spec(base, Cell(method, GUARD_STRESS), seed=2)
        on = cell_spec(base, Cell(method, GUARDED), seed=2)
        assert not off.stability.enabled and on.stability.enabled
        assert on.stability.action == "rollback" and on.stability.max_rollbacks == 3
        remedy = on.remedied(1).algorithm.estimator
        assert isinstance(remedy, KalmanEstimator) and on.stability.remedy.lr_scale == 0.5
        assert (remedy.p0, remedy.clip_mode, remedy.clipped) == ("diffuse", "posterior", True)
        # The guard is the only difference: same stress, same arm.
        assert on.model_dump(exclude={"stability", "name"}) == off.model_dump(
            exclude={"stability", "name"}
        )
        assert off.learner.lr == 3e-4 and off.pipeline.max_staleness == 8
    bounds = [cell_spec(base, Cell(BOUND_ARM, s), seed=0).pipeline for s in BOUND_SETTINGS]
    assert [p.max_staleness for p in bounds[:3]] == [1, 4, 8]
    auto = bounds[3]
    assert auto.staleness_auto is not None
    assert (auto.staleness_auto.min, auto.staleness_auto.max) == (1, 8)
    assert all(p.lead_batches == 0 and p.mode == "async" for p in bounds)


def result(cell: Cell, seed: int, final: float, path: Path = Path("."), **last: float) -> RunResult:
    """A run of `cell` ending at held-out accuracy `final`, its last record carrying `last`."""
    records: list[dict[str, float]] = [
        {"step": step, "entropy": 0.2, "truncated_fraction": 0.0} for step in range(1, 11)
    ]
    records[-1].update(last)
    evaluations = {0: Evaluation(0.2, 0.0, 0.0), 10: Evaluation(final, 0.0, 0.1)}
    return RunResult(cell, seed, path, records, evaluations, 1.0)  # type: ignore[arg-type]


def table_row(lines: list[str], *cells: str) -> list[str]:
    """The row of a markdown table whose first cells are `cells`, split into cells."""
    prefix = "| " + " | ".join(cells) + " |"
    (row,) = [line for line in lines if line.startswith(prefix)]
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_the_arms_table_pairs_by_seed_counts_rollbacks_and_the_runs_within_noise(
    tmp_path: Path,
) -> None:
    q0 = next(m for m in GUARD_ARMS if m.key == "kpo-q0")
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / STATUS_FILE).write_text(
        json.dumps({"state": "failed", "guard": {"action": "stop_unstable"}})
    )
    healthy = [0.30, 0.32, 0.34]  # GRPO without the guard: mean 0.32, sd 0.02
    results = {
        Cell(GRPO, GUARD_STRESS): [
            result(Cell(GRPO, GUARD_STRESS), s, a) for s, a in enumerate(healthy)
        ],
        Cell(q0, GUARD_STRESS): [result(Cell(q0, GUARD_STRESS), s, 0.05) for s in range(3)],
        Cell(q0, GUARDED): [
            result(Cell(q0, GUARDED), 0, 0.31, guard_rollbacks=1, rollouts_rolled_back_total=64),
            result(Cell(q0, GUARDED), 1, 0.29, guard_rollbacks=2, rollouts_rolled_back_total=128),
            result(Cell(q0, GUARDED), 2, 0.20, stopped, guard_rollbacks=3),
        ],
    }
    lines = guard_phase.arms_table(results)
    row = table_row(lines, q0.label, "rollback")
    assert row[2] == "3" and row[4] == "1"  # runs; stopped unstable
    # With minus without, by seed: 0.26, 0.24, 0.15 (mean 0.2167).
    assert row[6].startswith("+0.217 [")
    # Minus GRPO's, by seed: +0.01, -0.03, -0.14 (mean -0.0533).
    assert row[7].startswith("-0.053 [")
    # GRPO's noise floor: 0.32 - 2 x 0.02 = 0.28: seeds 0 and 1 end within it.
    assert row[8] == "2 / 3"
    assert row[9] == "2.0 (1 to 3)" and row[11] == "64.0 (0 to 128)"
    off = table_row(lines, q0.label, "off")
    assert off[4] == "0" and off[6] == "" and off[8] == "0 / 3" and off[9] == "0.0 (0 to 0)"
    assert table_row(lines, GRPO.label, "off")[7] == ""  # the baseline is not paired with itself


def test_the_bounds_table_gives_throughput_paired_with_the_fixed_bound_of_8() -> None:
    results = {}
    for setting, rate in zip(BOUND_SETTINGS, (50.0, 80.0, 100.0, 120.0), strict=True):
        cell = Cell(BOUND_ARM, setting)
        results[cell] = [
            result(
                cell,
                seed,
                0.3,
                tokens_trained_total=rate * 10 * (seed + 1),
                wall_seconds=10.0 * (seed + 1),
                staleness_bound=3.0,
            )
            for seed in range(2)
        ]
    lines = guard_phase.bounds_table(results)
    assert table_row(lines, "max_staleness 1")[3] == "0.500"
    assert table_row(lines, "max_staleness auto (1 to 8)")[3] == "1.200"
    assert table_row(lines, "max_staleness auto (1 to 8)")[2].startswith("120 [")
    assert table_row(lines, "max_staleness 8")[5] == ""  # the reference is not paired with itself


@pytest.mark.timeout(900)
def test_the_guard_phase_runs_a_guarded_arm_to_its_last_rollback_and_reports_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KL bound every step breaks makes the guard roll back at each step's first check,
    3 times, then stop the run as unstable: the study evaluates it and reports it."""
    out, docs, _ = run_tiny_study(
        tmp_path,
        monkeypatch,
        "guard",
        f"^kpo-q0__{GUARDED.key}$",
        ratios_every=0,
        extra=[
            "--set",
            "stability.warmup_steps=0",
            "--set",
            "stability.patience=1",
            "--set",
            "stability.objectives.approx_kl_max=1e-12",
        ],
    )
    run = out / "runs" / f"kpo-q0__{GUARDED.key}" / "seed-0"
    status = json.loads((run / STATUS_FILE).read_text())
    assert status["state"] == "failed" and status["guard"]["action"] == "stop_unstable"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["guard_rollbacks"] == 3
    evals = json.loads((run / "evals.json").read_text())
    assert "0" in evals["evaluations"]
    document = (docs / "results.md").read_text()
    assert f"### The guard phase: {GUARDED.label}" in document
    row = table_row(document.splitlines(), "control: KPO with q = 0 (REINFORCE)", "rollback")
    assert row[4] == "1" and row[9] == "3.0 (3 to 3)"
    assert "The demo's configuration has not been run with the guard on." in document
