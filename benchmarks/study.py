"""Stability study: every estimator on fresh and stale batches, several seeds, one report.

    python benchmarks/study.py                    # the reduced grid (< 60 min on 2 CPU cores)
    python benchmarks/study.py --full             # every extra cell at every staleness
    python benchmarks/study.py --config examples/study-gentle.yaml   # a second step size
    python benchmarks/study.py --set model=/models/qwen --set generation.backend=vllm ...
                                                  # GPU scale: any RunSpec override or file

The grid (stability_study.grid): GRPO, GSPO, GMPO, KPO clipped and unclipped, CTPO, each
synchronous and at max_staleness 2 and 8 (generation held that many versions ahead), plus KPO
against proximal log-probs and KPO with token-mean aggregation. Every run is the base
spec (examples/study.yaml unless --config) with the cell's settings; runs go to runs/NAME
(NAME: the config's stem unless --name) and are reused when the study is started again. The
study's block of docs/results.md, its figures and its per-step CSV files under
docs/results/NAME/ are rewritten from all its finished runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ray
import torch

from services.pipeline.actors import connect_ray
from services.pipeline.specs import load_run_spec
from services.spec import RunSpec
from stability_study import dynamics, filter_accuracy, plots, report
from stability_study.evaluate import HeldOutEvaluator
from stability_study.grid import STALENESS, Cell, grid
from stability_study.runner import RunResult, load_result, run_one
from stability_study.summary import summarize

ROOT = Path(__file__).resolve().parents[1]
# The report's section for each group of cells beyond the baselines (grid.Cell.group).
GROUP_SECTIONS = {"ablation": "KPO with token-mean aggregation"}
DEFAULT_CONFIG = ROOT / "examples" / "study.yaml"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="base run spec")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    parser.add_argument("--full", action="store_true", help="the full grid")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=None, help="where runs are kept (default: runs/NAME)"
    )
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="where results.md goes")
    parser.add_argument("--eval-prompts", type=int, default=512)
    parser.add_argument("--eval-device", default="cpu")
    parser.add_argument(
        "--only", default="", help="run only cells whose key matches this regular expression"
    )
    parser.add_argument(
        "--name", default="", help="the study's name in the report (default: the config's stem)"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="no new runs: report the finished ones"
    )
    parser.add_argument(
        "--filter-lengths",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        default=filter_accuracy.LENGTHS,
        help="comma-separated sequence lengths of the filter comparison",
    )
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    return args


def run_grid(
    base: RunSpec, cells: Sequence[Cell], args: argparse.Namespace
) -> dict[Cell, list[RunResult]]:
    """Every (cell, seed) run, reusing finished ones; a line per run as it finishes."""
    jobs = [(cell, seed) for cell in cells for seed in range(args.seeds)]
    results: dict[Cell, list[RunResult]] = {cell: [] for cell in cells}
    missing = [(c, s) for c, s in jobs if load_result(args.out, c, s) is None]
    evaluator = HeldOutEvaluator(base, args.eval_prompts, args.eval_device)
    started_ray = bool(missing) and not args.report_only and not ray.is_initialized()
    if missing and not args.report_only:
        connect_ray(base)
        print(f"starting model: held-out accuracy {evaluator.initial_accuracy:.3f}", flush=True)
    try:
        for index, (cell, seed) in enumerate(jobs, 1):
            result = load_result(args.out, cell, seed)
            if result is None and not args.report_only:
                result = run_one(
                    base, cell, seed, args.out, evaluator.initial_accuracy, evaluator.accuracy
                )
                print(_progress_line(index, len(jobs), result), flush=True)
            if result is not None:
                results[cell].append(result)
    finally:
        if started_ray:
            ray.shutdown()
    return {cell: runs for cell, runs in results.items() if runs}


def _progress_line(index: int, total: int, result: RunResult) -> str:
    last = result.records[-1]
    steps = sorted(result.accuracy)
    return (
        f"[{index}/{total}] {result.cell.key} seed {result.seed}: {len(result.records)} steps "
        f"in {result.seconds:.0f} s, reward {last['reward_mean']:.3f}, held-out accuracy "
        f"{result.accuracy[steps[0]]:.3f} -> {result.accuracy[steps[-1]]:.3f}, "
        f"KL {last.get('approx_kl', float('nan')):.3g}"
    )


def machine_line() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores "
        f"({model or 'unknown CPU'}), torch {torch.__version__}, "
        f"CUDA {'available' if torch.cuda.is_available() else 'not used'}"
    )


def write_report(
    base: RunSpec,
    results: dict[Cell, list[RunResult]],
    args: argparse.Namespace,
    seconds: float,
) -> Path:
    docs = args.docs
    # Figures and data of each study in a folder of its own, linked relative to results.md.
    link = f"results/{args.name}"
    assets = docs / link
    summaries = {cell: summarize(runs) for cell, runs in results.items()}
    columns = [s for s in STALENESS if any(c.staleness == s for c in results)]
    baseline = {c: r for c, r in results.items() if c.group == "baseline"}
    # The variants' figure: KPO variants with GRPO and plain KPO for reference.
    extended = {c.staleness for c in results if c.group != "baseline"}
    beyond = {
        c: r
        for c, r in results.items()
        if c.staleness in extended and (c.group != "baseline" or c.method.key in ("grpo", "kpo"))
    }
    figures = [
        plots.plot_training_curves(baseline, columns, assets / "curves.png"),
        plots.plot_accuracy(baseline, columns, assets / "accuracy.png"),
    ]
    beyond_columns = [s for s in columns if s in extended]
    if beyond_columns:
        figures.append(plots.plot_training_curves(beyond, beyond_columns, assets / "variants.png"))
    block = [
        f"## Study `{args.name}`: {_relative(args.config)}",
        "",
        "### How these numbers were made",
        "",
        f"- Command: `python {' '.join(shlex.quote(a) for a in _run_command())}`",
        f"- Grid: {'full' if args.full else 'reduced'}; {args.seeds} seeds per cell; "
        f"{base.pipeline.steps} learner steps per run; held-out accuracy on "
        f"{args.eval_prompts} unseen prompts at each checkpoint.",
        f"- Base spec: `{_relative(args.config)}` with the cell's estimator and staleness "
        f"setting{'; overrides: ' + ', '.join(args.overrides) if args.overrides else ''}.",
        f"- Machine: {machine_line()}.",
        f"- Time: {sum(r.seconds for runs in results.values() for r in runs) / 60:.1f} min of "
        "runs and evaluations in all; the invocation that wrote this report took "
        f"{seconds / 60:.1f} min (finished runs are reused).",
        f"- Raw per-step metrics of every run: `{_relative(assets / 'metrics')}/<cell>.csv`; "
        "held-out accuracy: `evals.csv` there.",
        "",
        *report.settings_table(list(results)),
        "",
        "### Estimators on fresh and stale batches",
        "",
        *report.outcome_table([summaries[c] for c in baseline]),
        "",
        f"![training curves]({link}/curves.png)",
        "",
        f"![held-out accuracy]({link}/accuracy.png)",
        "",
    ]
    anchor_cells = [c for c in baseline if c.method.key in ("grpo", "kpo")]
    for group, title in GROUP_SECTIONS.items():
        cells = [c for c in results if c.group == group]
        if not cells:
            continue
        # Each section with plain KPO and GRPO at the same staleness settings, for reference.
        shown = {c.staleness for c in cells}
        rows = [c for c in anchor_cells if c.staleness in shown] + cells
        block += [f"### {title}", "", *report.outcome_table([summaries[c] for c in rows]), ""]
    if beyond_columns:
        block += [f"![KPO variants]({link}/variants.png)", ""]
    pairs = [
        (summaries[b], summaries[p])
        for p in results
        if p.group == "reference"
        for b in results
        if b.method.key == "kpo" and b.staleness == p.staleness
    ]
    if pairs:
        block += [
            "### KPO against behaviour vs proximal log-probs",
            "",
            *report.reference_table(pairs),
            "",
        ]
    block += ["### Collapses", "", *report.collapse_notes(list(summaries.values())), ""]
    block += _dynamics_section(results, assets, link, figures, args.filter_lengths)
    report.write_metrics_csv(results, assets / "metrics")
    document = docs / "results.md"
    report.replace_block(document, args.name, block, "Stability study")
    print(f"report: {document}; figures: {', '.join(str(f) for f in figures)}")
    return Path(document)


def _dynamics_section(
    results: dict[Cell, list[RunResult]],
    assets: Path,
    link: str,
    figures: list[Path],
    lengths: Sequence[int],
) -> list[str]:
    """Ratio diagnostics of the recorded GRPO log-ratios per staleness, and the long-sequence
    filter comparison on the stalest of them."""
    tables, sizes, examples = {}, {}, {}
    sample = None
    for cell, runs in results.items():
        if cell.method.key != "grpo":
            continue
        try:
            sample = dynamics.load_ratios([r.path for r in runs])
        except ValueError:
            continue
        name = cell.staleness.label
        tables[name] = dynamics.diagnostics_table(sample)
        sizes[name] = (sample.responses, sample.tokens)
        examples[name] = dynamics.example_sequence(sample)
    if sample is None:
        return []
    figures.append(plots.plot_ratio_dynamics(examples, tables, assets / "ratio_dynamics.png"))
    comparison = filter_accuracy.compare(sample, lengths)
    figures.append(plots.plot_filter_accuracy(comparison, assets / "filter_accuracy.png"))
    return [
        "### Ratio dynamics: raw vs filtered",
        "",
        "Recorded token log-ratios of the GRPO runs (every recorded step, all minibatches, "
        "against the behaviour log-probs), filtered offline at each q/r (R = 1).",
        "",
        *report.dynamics_table(tables, sizes),
        "",
        f"![ratio dynamics]({link}/ratio_dynamics.png)",
        "",
        "### Exact parallel filter vs the official closed form",
        "",
        "Recorded log-ratios tiled to each length (2 rows, float32 input); error against the "
        "sequential recursion in float64; forward time, best of 5, on this machine.",
        "",
        *report.filter_table(comparison),
        "",
        f"![filter accuracy]({link}/filter_accuracy.png)",
        "",
    ]


def _run_command() -> list[str]:
    """This invocation's command line without --report-only: the command that makes the runs."""
    return [a for a in sys.argv if a != "--report-only"]


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: Sequence[str] | None = None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    try:
        base = load_run_spec(args.config, args.overrides)
        HeldOutEvaluator(base, args.eval_prompts, args.eval_device)
    except ValueError as error:  # SpecError names the file and key
        raise SystemExit(f"error: {error}") from None
    try:
        pattern = re.compile(args.only)
    except re.error as error:
        raise SystemExit(f"error: --only {args.only!r}: {error}") from None
    cells = [c for c in grid(args.full) if pattern.search(c.key)]
    if not cells:
        raise SystemExit(f"error: no cell key matches {args.only!r}")
    args.name = args.name or args.config.stem
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.name):
        raise SystemExit(f"error: --name {args.name!r}: use letters, digits, '.', '_', '-'")
    args.out = args.out or ROOT / "runs" / args.name
    print(f"{len(cells)} cells x {args.seeds} seeds, {base.pipeline.steps} steps per run")
    results = run_grid(base, cells, args)
    if not results:
        raise SystemExit(f"no finished runs under {args.out}")
    write_report(base, results, args, time.perf_counter() - started)


if __name__ == "__main__":
    main()
