"""The stability study: grid, collapse criterion, report block, ratio analysis, and one real run."""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from services.learner.step import ratio_file
from services.pipeline.driver import RATIO_DIR
from services.pipeline.specs import load_run_spec
from services.spec import RunSpec
from stability_study import dynamics, filter_accuracy, report
from stability_study.evaluate import Evaluation
from stability_study.grid import (
    ARMS,
    GENTLE,
    GRPO,
    SETTINGS,
    STRESSES,
    Cell,
    arm_cells,
    cell_spec,
    pilot_cells,
    setting_named,
)
from stability_study.runner import EVALS_FILE, RunResult
from stability_study.stats import bootstrap_interval, fisher_exact
from stability_study.summary import (
    COLLAPSED,
    DID_NOT_LEARN,
    LEARNED,
    Spread,
    outcome,
    paired_difference,
    summarize,
)

ROOT = Path(__file__).resolve().parents[2]
STUDY_CONFIG = ROOT / "examples" / "study.yaml"


def test_the_grid_has_the_pilot_and_every_arm_under_each_setting() -> None:
    assert [c.key for c in pilot_cells()] == [f"grpo__{s.key}" for s in STRESSES]
    keys = [c.key for s in SETTINGS for c in arm_cells(s)]
    assert len(set(keys)) == len(keys) == len(ARMS) * len(SETTINGS)
    names = {m.estimator["name"] for m in ARMS}
    assert names == {"token", "sequence", "cumulative", "geometric", "kalman"}
    # The KPO arms pin the paper's constants, so that a change of defaults cannot move them.
    for method in ARMS:
        if method.estimator["name"] == "kalman":
            assert method.estimator["r"] == 1.0 and "reference_length" in method.estimator
    assert setting_named("gentle-sync") is GENTLE
    with pytest.raises(ValueError, match="unknown setting 'x'; valid settings: lr3e-4-stale-8"):
        setting_named("x")


def test_cell_specs_apply_the_arm_and_the_settings_overrides() -> None:
    base = load_run_spec(STUDY_CONFIG)
    matched = next(m for m in ARMS if m.key == "kpo-matched")
    stressed = cell_spec(base, Cell(matched, STRESSES[0]), seed=2)  # lr 3e-4
    assert stressed.seed == 2 and stressed.learner.lr == 3e-4
    assert (stressed.pipeline.mode, stressed.pipeline.max_staleness) == ("async", 8)
    assert stressed.pipeline.lead_batches == 8
    assert stressed.pipeline.buffer_groups == 9 * base.pipeline.batch_groups
    estimator = stressed.algorithm.estimator
    assert estimator.name == "kalman" and estimator.reference_length == "auto"
    resolved = stressed.algorithm.with_response_length(stressed.generation.max_new_tokens)
    assert resolved.estimator.effective_q == pytest.approx(1e-6 * (4096 / 96) ** 2)  # type: ignore[union-attr]
    gentle = cell_spec(base, Cell(GRPO, GENTLE), seed=0)
    assert (gentle.pipeline.mode, gentle.pipeline.lead_batches, gentle.learner.lr) == (
        "sync",
        0,
        5e-5,
    )
    # What the study never changes comes from the base spec.
    assert gentle.generation == base.generation
    assert stressed.learner.minibatches == base.learner.minibatches
    # Every arm is a valid spec under every setting.
    for setting in SETTINGS:
        for cell in arm_cells(setting):
            assert cell_spec(base, cell, 0).name.startswith(cell.key[:40])


def fake_result(
    accuracy: list[float],
    entropy: list[float] | None = None,
    truncated: float = 0.0,
    kl: float = 0.1,
    seed: int = 0,
) -> RunResult:
    entropy = entropy or [0.2] * 30
    records = [
        {"step": i + 1, "entropy": e, "truncated_fraction": truncated, "reward_mean": 0.2}
        for i, e in enumerate(entropy)
    ]
    evaluations = {
        10 * i: Evaluation(a, truncated, 0.0 if i == 0 else kl) for i, a in enumerate(accuracy)
    }
    return RunResult(Cell(GRPO, STRESSES[0]), seed, Path("."), records, evaluations, 1.0)


def test_outcomes_split_collapse_from_not_learning() -> None:
    learned = fake_result([0.2, 0.25, 0.24])
    assert outcome(learned, 0.1).kind == LEARNED
    # A fall without a symptom did not learn; the same fall with one collapsed.
    fell = fake_result([0.2, 0.3, 0.2])
    assert outcome(fell, 0.1) == outcome(fell, 0.1)
    assert outcome(fell, 0.1).kind == DID_NOT_LEARN
    assert "fell from 0.300 without a collapse symptom" in outcome(fell, 0.1).reasons
    endless = fake_result([0.2, 0.3, 0.1], truncated=0.8)
    assert outcome(endless, 0.1).reasons == (
        "held-out accuracy 0.100 vs best 0.300",
        "80% of responses truncated",
    )
    blowup = fake_result([0.2, 0.1], entropy=[0.2] * 20 + [0.5] * 10)
    assert outcome(blowup, 0.1).kind == COLLAPSED
    assert outcome(blowup, 0.1).reasons[1] == "entropy 0.500 vs 0.200 at the start"
    drifted = fake_result([0.2, 0.1], kl=0.9)
    assert outcome(drifted, 0.3).kind == DID_NOT_LEARN  # 0.9 < 4 x 0.3
    assert outcome(drifted, 0.2).reasons[1] == "KL from the start 0.900 vs median 0.200"
    flat = fake_result([0.2, 0.21])
    assert outcome(flat, 0.1).kind == DID_NOT_LEARN


def test_cell_summaries_pair_seeds_and_count_outcomes() -> None:
    arm = [fake_result([0.2, 0.3], seed=0), fake_result([0.2, 0.1], truncated=0.9, seed=1)]
    grpo = [fake_result([0.2, 0.25], seed=0), fake_result([0.2, 0.22], seed=1)]
    mine, theirs = summarize(arm, 0.1), summarize(grpo, 0.1)
    assert (mine.count(COLLAPSED), mine.count(LEARNED)) == (1, 1)
    assert mine.gains == pytest.approx({0: 0.1, 1: -0.1})
    difference = paired_difference(mine, theirs)
    assert difference is not None
    assert difference.mean == pytest.approx(((0.1 - 0.05) + (-0.1 - 0.02)) / 2)
    assert difference.low <= difference.mean <= difference.high
    assert report.collapse_test(mine, theirs) == pytest.approx(1.0)


def test_fisher_exact_and_bootstrap_by_hand() -> None:
    # 0/3 vs 2/3 collapsed: p = 0.4 (the tables as or less likely: a = 0 and a = 2).
    assert fisher_exact(0, 3, 2, 1) == pytest.approx(0.4)
    # Fisher's tea tasting, 3 of 4 right: two-sided p = 34/70.
    assert fisher_exact(3, 1, 1, 3) == pytest.approx(34 / 70)
    assert fisher_exact(6, 0, 0, 6) == pytest.approx(2 / 924)
    with pytest.raises(ValueError, match="counts must be >= 0"):
        fisher_exact(-1, 1, 1, 1)
    low, high = bootstrap_interval([0.0, 1.0, 2.0, 3.0])
    assert 0.0 <= low < 1.5 < high <= 3.0
    assert bootstrap_interval([0.5]) == (0.5, 0.5)
    assert bootstrap_interval([0.0, 1.0, 2.0, 3.0]) == (low, high)  # seeded


def test_the_pilot_picks_the_stress_where_grpo_collapses_most() -> None:
    import study

    def summary(setting: int, accuracies: list[list[float]]) -> object:
        runs = [
            RunResult(Cell(GRPO, STRESSES[setting]), seed, Path("."), r.records, r.evaluations, 1.0)
            for seed, r in enumerate(fake_result(a, truncated=0.9) for a in accuracies)
        ]
        return summarize(runs, 0.1)

    collapsing = [[0.2, 0.3, 0.1]] * 2 + [[0.2, 0.21, 0.2]]  # two collapse (truncation, fall)
    mild = [[0.2, 0.3, 0.1]] + [[0.2, 0.21, 0.2]] * 2
    pilot = {STRESSES[0]: summary(0, mild), STRESSES[1]: summary(1, collapsing)}
    choice = study.pick_stress(pilot)  # type: ignore[arg-type]
    assert (choice.setting, choice.collapsed, choice.seeds, choice.collapses) == (
        STRESSES[1],
        2,
        3,
        True,
    )
    pilot = {STRESSES[0]: summary(0, mild), STRESSES[2]: summary(2, mild)}
    choice = study.pick_stress(pilot)  # type: ignore[arg-type]
    assert choice.collapsed == 1 and not choice.collapses


def test_spread_is_mean_and_sample_deviation() -> None:
    spread = Spread.of([1.0, 2.0, 3.0, math.nan])
    assert (spread.mean, spread.std) == (2.0, 1.0)
    assert Spread.of([5.0]).std == 0.0
    assert Spread.of([]).format() == "n/a"


def test_report_blocks_are_replaced_and_the_reading_kept(tmp_path: Path) -> None:
    document = tmp_path / "results.md"
    report.replace_block(document, "main", ["first"], "Stability study")
    assert document.read_text().startswith("# Stability study")
    end = report.markers("main")[1]
    text = document.read_text().replace(end, end + "\n\nMy reading.")
    document.write_text("Intro.\n" + text)
    report.replace_block(document, "other", ["other study"], "ignored")
    report.replace_block(document, "main", ["second"], "ignored")
    final = document.read_text()
    assert "second" in final and "first" not in final
    assert final.startswith("Intro.") and "My reading." in final
    # Another study's block is appended once and left alone by the first study's rewrite.
    assert final.count("other study") == 1
    assert final.index("My reading.") < final.index("other study")


def write_ratio_files(run_dir: Path, rows: int = 6, width: int = 120) -> None:
    """Two steps' ratio files in the learner's format: noisy log-ratios around a drift."""
    generator = torch.Generator().manual_seed(0)
    for version in (0, 1):
        z = 0.02 + 0.1 * torch.randn(rows, width - version * 20, generator=generator)
        mask = torch.ones_like(z, dtype=torch.bool)
        mask[0, -30:] = False
        record = {
            "log_ratio": torch.where(mask, z, 0.0),
            "mask": mask,
            "row": torch.arange(rows),
            "staleness": torch.full((rows,), version),
            "advantage": torch.ones(rows),
            "minibatch": torch.zeros(rows, dtype=torch.long),
            "version": torch.tensor(version),
        }
        path = ratio_file(run_dir / RATIO_DIR, version)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(record, path)


def test_ratio_files_are_pooled_and_filtering_smooths_them(tmp_path: Path) -> None:
    write_ratio_files(tmp_path / "a")
    write_ratio_files(tmp_path / "b")
    sample = dynamics.load_ratios([tmp_path / "a", tmp_path / "b"])
    assert sample.responses == 2 * 2 * 6 and sample.log_ratio.shape[1] == 120
    assert bool((sample.log_ratio[~sample.mask] == 0).all())
    table = dynamics.diagnostics_table(sample)
    assert set(table) == {"raw", "q/r=1e-06", "q/r=0.0001", "q/r=0.01"}
    raw, smooth = table["raw"], table["q/r=0.0001"]
    assert raw["switch_frequency"] > 0.3 > 0.1 > smooth["switch_frequency"]
    assert smooth["low_frequency_ratio"] > raw["low_frequency_ratio"]
    assert smooth["global_variance"] < 0.01 * raw["global_variance"]
    with pytest.raises(ValueError, match="no ratio files"):
        dynamics.load_ratios([tmp_path / "missing"])


def test_filter_comparison_shows_the_closed_form_drifting(tmp_path: Path) -> None:
    write_ratio_files(tmp_path)
    sample = dynamics.load_ratios([tmp_path])
    rows = filter_accuracy.compare(sample, lengths=(2048, 32768), q_values=(1e-4,))
    assert [r.length for r in rows] == [2048, 32768]
    assert all(r.parallel_error < 1e-6 for r in rows)
    # With Q/R = 1e-4 the gains are ~1e-2, the product of (1 - K) passes 1e-30 within ~7k
    # tokens, and the clamped closed form loses the state.
    assert rows[-1].closed_form_error > 1e-3
    assert rows[-1].parallel_seconds > 0 and rows[-1].closed_form_seconds > 0


@pytest.mark.slow
def run_tiny_study(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    phase: str,
    only: str,
    ratios_every: int,
    extra: Sequence[str] = (),
) -> tuple[Path, Path, list[str]]:
    """benchmarks/study.py on one seed of the cells matching `only`, 4 steps each, evaluated
    on 16 prompts, with `extra` arguments: (runs folder, docs folder, the arguments it ran
    with)."""
    import study  # benchmarks/study.py

    out, docs = tmp_path / "out", tmp_path / "docs"
    argv = [
        "--phase", phase, "--only", only, "--seeds", "1", "--eval-prompts", "16",
        "--name", "tiny", "--set", "pipeline.steps=4", "--set", "pipeline.checkpoint_every=2",
        "--set", f"learner.record_ratios_every={ratios_every}",
        "--out", str(out), "--docs", str(docs), "--filter-lengths", "1024", *extra,
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["study.py", *argv])
    study.main(argv)
    return out, docs, argv


@pytest.mark.timeout(900)
def test_the_study_runs_two_arms_end_to_end_and_reports_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import study  # benchmarks/study.py

    out, docs, argv = run_tiny_study(
        tmp_path, monkeypatch, "gentle", "^(grpo|kpo-matched)__gentle-sync$", ratios_every=2
    )
    run = out / "runs" / "kpo-matched__gentle-sync" / "seed-0"
    evals = json.loads((run / EVALS_FILE).read_text())
    assert sorted(int(s) for s in evals["evaluations"]) == [0, 2, 4]
    assert set(evals["evaluations"]["4"]) == {"accuracy", "truncated", "kl_from_start"}
    assert evals["evaluations"]["0"]["kl_from_start"] == 0.0
    assert evals["evaluations"]["4"]["kl_from_start"] > 0.0  # it trained away from the start
    assert not (run / "checkpoints").exists()  # evaluated, then removed
    assert sorted(p.name for p in (run / RATIO_DIR).iterdir()) == [
        "step-000002.pt",
        "step-000004.pt",
    ]
    document = (docs / "results.md").read_text()
    assert "### Every arm under lr 5e-5, synchronous" in document
    assert "| KPO, length-matched |" in document and "| GRPO (token) |" in document
    assert "### Ratio dynamics: raw vs filtered" in document
    assert "## Study `tiny`" in document and "](results/tiny/accuracy-gentle-sync.png)" in document
    for figure in ("curves-gentle-sync.png", "accuracy-gentle-sync.png", "ratio_dynamics.png"):
        assert (docs / "results" / "tiny" / figure).stat().st_size > 10_000
    with (docs / "results" / "tiny" / "metrics" / "kpo-matched__gentle-sync.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert all(float(r["staleness_mean"]) == 0.0 for r in rows)
    # Length-matched at 96 tokens, the filter has moved well off its prior (W >> 0.002).
    assert all(float(r["kalman_shrinkage_mean"]) > 0.3 for r in rows)

    # A second invocation reuses the finished runs and rewrites only the generated block.
    stamp = (run / EVALS_FILE).stat().st_mtime_ns
    (docs / "results.md").write_text(document + "\nHand-written reading.\n")
    study.main([*argv, "--report-only"])
    assert (run / EVALS_FILE).stat().st_mtime_ns == stamp
    assert (docs / "results.md").read_text().rstrip().endswith("Hand-written reading.")


def test_bad_study_arguments_are_messages_naming_the_problem(tmp_path: Path) -> None:
    import study

    with pytest.raises(SystemExit, match="no cell key matches 'nothing'"):
        study.main(["--only", "nothing", "--report-only"])
    with pytest.raises(SystemExit, match=r"--only '\(': "):
        study.main(["--only", "(", "--report-only"])
    with pytest.raises(SystemExit, match="the main phase needs the whole pilot"):
        study.main(["--phase", "main", "--out", str(tmp_path / "empty")])

    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  lr: -1\n")
    with pytest.raises(SystemExit, match=r"learner\.lr"):
        study.main(["--config", str(bad)])
    jsonl = tmp_path / "jsonl.yaml"
    jsonl.write_text(f"task:\n  name: jsonl\n  path: {tmp_path / 'p.jsonl'}\n")
    with pytest.raises(SystemExit, match="held-out accuracy needs the built-in arith task"):
        study.main(["--config", str(jsonl)])
    assert isinstance(load_run_spec(STUDY_CONFIG), RunSpec)
