"""The stability study: grid, collapse criterion, report block, ratio analysis, and one real run."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from services.learner.step import ratio_file
from services.pipeline.driver import RATIO_DIR
from services.pipeline.specs import load_run_spec
from services.spec import RunSpec
from stability_study import dynamics, filter_accuracy, report
from stability_study.grid import (
    BASELINES,
    PROXIMAL,
    STALE_8,
    SYNC,
    TOKEN_MEAN,
    Cell,
    cell_spec,
    grid,
)
from stability_study.runner import EVALS_FILE, RunResult
from stability_study.summary import Spread, collapse_reasons, summarize

ROOT = Path(__file__).resolve().parents[2]
STUDY_CONFIG = ROOT / "examples" / "study.yaml"


def test_grid_covers_every_estimator_and_staleness() -> None:
    reduced, full = grid(full=False), grid(full=True)
    assert len({c.key for c in reduced}) == len(reduced) == 6 * 3 + 1 + 2
    assert len({c.key for c in full}) == len(full) == 6 * 3 + 2 + 3
    names = {c.method.estimator["name"] for c in reduced}
    assert names == {"token", "sequence", "geometric", "kalman", "cumulative"}
    assert {c.staleness.key for c in reduced} == {"sync", "stale-2", "stale-8"}
    # The proximal reference only where batches are stale.
    assert all(c.staleness.key != "sync" for c in full if c.group == "reference")
    assert {c.staleness.key for c in reduced if c.group == "ablation"} == {"sync", "stale-8"}


def test_cell_specs_apply_estimator_reference_and_staleness() -> None:
    base = load_run_spec(STUDY_CONFIG)
    stale = cell_spec(base, Cell(PROXIMAL, STALE_8, "reference"), seed=2)
    assert stale.seed == 2
    assert stale.algorithm.reference == "proximal"
    assert stale.algorithm.off_policy.tis_cap == 2.0
    assert (stale.pipeline.mode, stale.pipeline.max_staleness) == ("async", 8)
    assert stale.pipeline.lead_batches == 8
    assert stale.pipeline.buffer_groups == 9 * base.pipeline.batch_groups
    sync = cell_spec(base, Cell(BASELINES[0], SYNC, "baseline"), seed=0)
    assert (sync.pipeline.mode, sync.pipeline.max_staleness, sync.pipeline.lead_batches) == (
        "sync",
        0,
        0,
    )
    assert sync.algorithm.estimator.name == "token"
    assert sync.algorithm.loss_agg_mode is None  # the estimator's own default
    token_mean = cell_spec(base, Cell(TOKEN_MEAN, SYNC, "ablation"), seed=0)
    assert token_mean.algorithm.resolved_loss_agg_mode == "token-mean"
    # What the study never changes comes from the base spec.
    assert stale.learner == base.learner and stale.generation == base.generation


def fake_result(
    entropy: list[float], truncated: list[float], accuracy: dict[int, float], seed: int = 0
) -> RunResult:
    records = [
        {"step": i + 1, "entropy": e, "truncated_fraction": t, "reward_mean": 0.2}
        for i, (e, t) in enumerate(zip(entropy, truncated, strict=True))
    ]
    cell = Cell(BASELINES[0], SYNC, "baseline")
    return RunResult(cell, seed, Path("."), records, accuracy, 1.0)


def test_collapse_criterion_names_each_failure_and_spares_a_healthy_run() -> None:
    steady = [0.2] * 30
    healthy = fake_result(steady, [0.0] * 30, {0: 0.2, 25: 0.25, 50: 0.23})
    assert collapse_reasons(healthy) == []
    forgot = fake_result(steady, [0.0] * 30, {0: 0.2, 25: 0.3, 50: 0.2})
    assert collapse_reasons(forgot) == ["held-out accuracy 0.200 vs best 0.300"]
    entropy = fake_result([0.2] * 20 + [0.05] * 10, [0.0] * 30, {0: 0.2, 50: 0.2})
    assert collapse_reasons(entropy)[0].startswith("entropy 0.050")
    endless = fake_result(steady, [0.0] * 20 + [0.8] * 10, {0: 0.2, 50: 0.2})
    assert collapse_reasons(endless) == ["80% of responses truncated"]
    summary = summarize([healthy, forgot])
    assert summary.collapsed == 1 and summary.reasons == (
        "seed 0: held-out accuracy 0.200 vs best 0.300",
    )
    assert summary.accuracy_gain.mean == pytest.approx(0.015)


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
@pytest.mark.timeout(600)
def test_the_study_runs_a_cell_end_to_end_and_reports_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import study  # benchmarks/study.py

    out, docs = tmp_path / "out", tmp_path / "docs"
    argv = [
        "--only", "^grpo__sync$", "--seeds", "1", "--eval-prompts", "16", "--name", "tiny",
        "--set", "pipeline.steps=4", "--set", "pipeline.checkpoint_every=2",
        "--set", "learner.record_ratios_every=2",
        "--out", str(out), "--docs", str(docs), "--filter-lengths", "1024",
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["study.py", *argv])
    study.main(argv)
    run = out / "runs" / "grpo__sync" / "seed-0"
    evals = json.loads((run / EVALS_FILE).read_text())
    assert sorted(int(s) for s in evals["accuracy"]) == [0, 2, 4]
    assert not (run / "checkpoints").exists()  # evaluated, then removed
    assert sorted(p.name for p in (run / RATIO_DIR).iterdir()) == [
        "step-000002.pt",
        "step-000004.pt",
    ]
    document = (docs / "results.md").read_text()
    assert "| GRPO (token) | synchronous |" in document
    assert "## Ratio dynamics: raw vs filtered" in document
    assert "## Study `tiny`" in document and "](results/tiny/curves.png)" in document
    for figure in ("curves.png", "accuracy.png", "ratio_dynamics.png", "filter_accuracy.png"):
        assert (docs / "results" / "tiny" / figure).stat().st_size > 10_000
    with (docs / "results" / "tiny" / "metrics" / "grpo__sync.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert all(float(r["staleness_mean"]) == 0.0 for r in rows)

    # A second invocation reuses the finished run and rewrites only the generated block.
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

    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  lr: -1\n")
    with pytest.raises(SystemExit, match=r"learner\.lr"):
        study.main(["--config", str(bad)])
    jsonl = tmp_path / "jsonl.yaml"
    jsonl.write_text(f"task:\n  name: jsonl\n  path: {tmp_path / 'p.jsonl'}\n")
    with pytest.raises(SystemExit, match="held-out accuracy needs the built-in arith task"):
        study.main(["--config", str(jsonl)])
    assert isinstance(load_run_spec(STUDY_CONFIG), RunSpec)
