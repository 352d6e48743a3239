"""Stability study: where does GRPO collapse, and does KPO in any form hold there?

    make study                                   # pilot, main, gentle and in-flight phases;
                                                 # finished runs are reused
    python benchmarks/study.py --phase pilot     # one phase at a time
    python benchmarks/study.py --report-only     # rewrite docs/results.md from finished runs
    python benchmarks/study.py --set model=/models/qwen --set generation.backend=vllm ...
                                                 # GPU scale: any RunSpec override or file

Phases (stability_study.grid): the pilot runs GRPO under each stress setting and picks the one
where GRPO collapses most (`pick_stress`); the main phase runs every arm there with shared seeds
(PHASE_SEEDS); the gentle phase runs every arm synchronously at a small step size; the in-flight
phase runs KPO length-matched with each `version_switch` under in-flight weight updates over the
collective transport, each paired with the same filter with the switch off. Every run is
the base spec (examples/study.yaml unless --config) with its cell's settings; runs go to
runs/NAME (NAME: the config's stem unless --name) and are reused when the study is started again.
The study's block of docs/results.md, its figures and its per-step CSV files under
docs/results/NAME/ are rewritten from all its finished runs.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ray
import torch

from kpo_core.config import KalmanEstimator
from services.pipeline.actors import connect_ray
from services.pipeline.specs import load_run_spec
from services.spec import RunSpec
from stability_study import dynamics, filter_accuracy, guard_phase, plots, report
from stability_study.evaluate import HeldOutEvaluator
from stability_study.grid import (
    ARMS,
    BOUND_SETTINGS,
    GENTLE,
    GRPO,
    GUARDED,
    IN_FLIGHT,
    IN_FLIGHT_ARMS,
    PHASES,
    STRESSES,
    Cell,
    Setting,
    arm_cells,
    cell_spec,
    guard_cells,
    in_flight_cells,
    pilot_cells,
)
from stability_study.runner import RunResult, load_result, run_one
from stability_study.summary import COLLAPSED, CellSummary, setting_kl_median, summarize

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "examples" / "study.yaml"
# Seeds per phase, shared by every arm (seed n of one arm and of another start alike).
PHASE_SEEDS = {"pilot": 3, "main": 6, "gentle": 3, "in-flight": 6, "guard": 6}
BOUND_SEEDS = 3
# The healthy configuration whose run with the guard on counts the guard's false alarms.
DEMO_CONFIG = ROOT / "examples" / "demo.yaml"
# The pilot's bar: GRPO collapses in at least this share of its seeds.
PILOT_COLLAPSE_SHARE = 2 / 3


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="base run spec")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    parser.add_argument(
        "--phase", choices=(*PHASES, "all"), default="all", help="which phase to run"
    )
    parser.add_argument(
        "--seeds", type=int, default=None, help="seeds of every phase (default: PHASE_SEEDS)"
    )
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
    if args.seeds is not None and args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    return args


def seeds_of(phase: str, args: argparse.Namespace) -> int:
    return args.seeds if args.seeds is not None else PHASE_SEEDS[phase]


@dataclass(frozen=True)
class StressChoice:
    """The pilot's pick: the setting where GRPO collapsed most (then gained least)."""

    setting: Setting
    collapsed: int
    seeds: int

    @property
    def collapses(self) -> bool:
        """Whether GRPO collapsed in enough seeds there for the claim to be testable."""
        return self.collapsed >= math.ceil(PILOT_COLLAPSE_SHARE * self.seeds - 1e-9)


def pick_stress(pilot: Mapping[Setting, CellSummary]) -> StressChoice:
    summary = max(
        pilot.values(),
        key=lambda s: (s.count(COLLAPSED), -s.gain.mean, -STRESSES.index(s.cell.setting)),
    )
    return StressChoice(summary.cell.setting, summary.count(COLLAPSED), len(summary.outcomes))


class Study:
    """The phases' runs, started or reused, and their summaries."""

    def __init__(self, base: RunSpec, args: argparse.Namespace) -> None:
        self.base, self.args = base, args
        self.pattern = re.compile(args.only)
        self.evaluator = HeldOutEvaluator(base, args.eval_prompts, args.eval_device)
        self.results: dict[Cell, list[RunResult]] = {}
        self._ray_started = False

    def run(self, cells: Sequence[Cell], seeds: int, start: bool) -> dict[Cell, list[RunResult]]:
        """Every (cell, seed) of `cells` matching --only: reused, or run when `start`."""
        jobs = [(c, s) for c in cells if self.pattern.search(c.key) for s in range(seeds)]
        found: dict[Cell, list[RunResult]] = {}
        for index, (cell, seed) in enumerate(jobs, 1):
            result = load_result(self.args.out, cell, seed)
            if result is None and start:
                self.connect()
                result = run_one(
                    self.base, cell, seed, self.args.out, self.evaluator.initial,
                    self.evaluator.evaluate,
                )  # fmt: skip
                print(_progress_line(index, len(jobs), result), flush=True)
            if result is not None:
                found.setdefault(cell, []).append(result)
        for cell, runs in found.items():
            self.results.setdefault(cell, [])
            known = {r.seed for r in self.results[cell]}
            self.results[cell] += [r for r in runs if r.seed not in known]
        return found

    def connect(self) -> None:
        if not self._ray_started and not ray.is_initialized():
            connect_ray(self.base)
            self._ray_started = True
            print(f"starting model: {self.evaluator.initial}", flush=True)

    def close(self) -> None:
        if self._ray_started:
            ray.shutdown()


def _progress_line(index: int, total: int, result: RunResult) -> str:
    last = result.records[-1]
    path = " -> ".join(f"{a:.3f}" for _, a in sorted(result.accuracy.items()))
    return (
        f"[{index}/{total}] {result.cell.key} seed {result.seed}: {len(result.records)} steps "
        f"in {result.seconds:.0f} s, reward {last['reward_mean']:.3f}, held-out accuracy "
        f"{path}, KL to behaviour {last.get('approx_kl', float('nan')):.3g}"
    )


def summaries_of(
    results: Mapping[Cell, Sequence[RunResult]], seeds: int
) -> dict[Cell, CellSummary]:
    """Each cell's summary over its first `seeds` seeds, with the KL median of its setting."""
    kept = {c: [r for r in runs if r.seed < seeds] for c, runs in results.items()}
    by_setting: dict[Setting, list[RunResult]] = {}
    for cell, runs in kept.items():
        by_setting.setdefault(cell.setting, []).extend(runs)
    medians = {s: setting_kl_median(runs) for s, runs in by_setting.items()}
    return {c: summarize(runs, medians[c.setting]) for c, runs in kept.items() if runs}


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
    study: Study,
    pilot: Mapping[Cell, CellSummary],
    choice: StressChoice | None,
    phases: Mapping[Setting, Mapping[Cell, CellSummary]],
    in_flight: Mapping[Cell, CellSummary],
    guard: GuardPhase,
    seconds: float,
) -> Path:
    """The study's block of docs/results.md from every finished run, with figures and CSVs.

    `pilot`: GRPO's summaries under each stress; `phases`: the arms' summaries under the
    chosen stress and the gentle setting (either may be empty); `in_flight`: the
    `version_switch` arms' summaries under in-flight weight updates (may be empty).
    """
    args = study.args
    docs = args.docs
    # Figures and data of each study in a folder of its own, linked relative to results.md.
    link = f"results/{args.name}"
    assets = docs / link
    results = study.results
    settings = [s for s in (*STRESSES, GENTLE, IN_FLIGHT) if any(c.setting is s for c in results)]
    methods = [m for m in (*ARMS, *IN_FLIGHT_ARMS) if any(c.method is m for c in results)]
    runs = [r for rs in results.values() for r in rs]
    block = [
        f"## Study `{args.name}`: {_relative(args.config)}",
        "",
        "### How these numbers were made",
        "",
        f"- Command: `python {' '.join(shlex.quote(a) for a in _run_command())}`",
        f"- Seeds: {', '.join(f'{p} {seeds_of(p, args)}' for p in PHASES)}, shared by every "
        f"arm; {base.pipeline.steps} learner steps per run; held-out accuracy, truncation and "
        f"KL from the starting model on {args.eval_prompts} unseen prompts every "
        f"{base.pipeline.checkpoint_every} steps.",
        f"- Base spec: `{_relative(args.config)}` with the cell's estimator and setting"
        f"{'; overrides: ' + ', '.join(args.overrides) if args.overrides else ''}.",
        f"- Machine: {machine_line()}.",
        f"- Time: {sum(r.seconds for r in runs) / 60:.1f} min of runs and evaluations in all "
        f"({len(runs)} runs); the invocation that wrote this report took {seconds / 60:.1f} min "
        "(finished runs are reused).",
        f"- Raw per-step metrics of every run: `{_relative(assets / 'metrics')}/<cell>.csv`; "
        "held-out evaluations: `evals.csv` there.",
        "",
        *report.settings_table(methods, settings),
        "",
        *report.outcome_rules(),
        "",
    ]
    figures: list[Path] = []
    if pilot:
        block += [
            "### Pilot: GRPO under each stress",
            "",
            *report.pilot_table(list(pilot.values())),
            "",
        ]
    if choice is not None:
        verdict = (
            f"GRPO collapsed in {choice.collapsed} of {choice.seeds} seeds under "
            f"{choice.setting.label}: the main phase runs there."
            if choice.collapses
            else f"GRPO collapsed in {_at_most(choice)} under any stress; the main phase runs "
            f"where it {'collapsed most' if choice.collapsed else 'gained least'} "
            f"({choice.setting.label}). The claim that KPO holds where GRPO collapses cannot "
            "be tested at this scale."
        )
        block += [verdict, ""]
    for setting, summaries in phases.items():
        if not summaries:
            continue
        cells = list(summaries)
        baseline = next((summaries[c] for c in cells if c.method is GRPO), None)
        name = setting.key
        shown = {c: results[c] for c in cells}
        figures += [
            plots.plot_accuracy(shown, [setting], assets / f"accuracy-{name}.png"),
            plots.plot_training_curves(shown, [setting], assets / f"curves-{name}.png"),
        ]
        block += [
            f"### Every arm under {setting.label}",
            "",
            *report.arms_table(list(summaries.values()), baseline),
            "",
            f"![held-out accuracy]({link}/accuracy-{name}.png)",
            "",
            f"![training curves]({link}/curves-{name}.png)",
            "",
            f"Ratio diagnostics per arm under {setting.label}: raw -> the estimator's ratio "
            "(the learner's per-step `raw_*` and `filtered_*` metrics, averaged over steps "
            "and then over seeds), beside the paper's raw -> KPO-filtered figures.",
            "",
            *report.arm_dynamics_table(list(summaries.values())),
            "",
        ]
    if in_flight:
        tracking = {
            cell: dynamics.switch_tracking_error(sample, _resolved_estimator(base, cell))
            for cell, sample in _ratio_samples(results, in_flight).items()
        }
        block += [
            f"### In-flight weight updates: `version_switch` under {IN_FLIGHT.label}",
            "",
            "Gains paired on shared seeds against the same filter with `version_switch: off`; "
            f"tracking error: mean |filtered - segment-mean raw log-ratio| over the first "
            f"{dynamics.SWITCH_HORIZON} tokens from each switch, on the recorded log-ratios.",
            "",
            *report.in_flight_table(in_flight, tracking),
            "",
            *report.arm_dynamics_table(list(in_flight.values())),
            "",
        ]
    if guard.results or guard.demo is not None:
        block += _guard_section(guard)
    if sum(bool(s) for s in phases.values()) > 1:
        by_setting = {s: list(v.values()) for s, v in phases.items() if v}
        block += [
            "### Collapses pooled across settings",
            "",
            *report.pooled_table(by_setting, methods, GRPO),
            "",
        ]
    in_phases = [*(s for v in phases.values() for s in v.values()), *in_flight.values()]
    # GRPO's pilot runs under the chosen stress are listed with the main phase's.
    every = [*(s for c, s in pilot.items() if not any(c in v for v in phases.values())), *in_phases]
    if every:
        block += ["### Runs that did not learn or collapsed", "", *report.outcome_notes(every), ""]
        block += _dynamics_section(results, assets, link, figures, args.filter_lengths)
    report.write_metrics_csv(results, assets / "metrics")
    document = docs / "results.md"
    report.replace_block(document, args.name, block, "Stability study")
    print(f"report: {document}; figures: {', '.join(str(f) for f in figures)}")
    return Path(document)


def _guard_section(guard: GuardPhase) -> list[str]:
    return [
        f"### The guard phase: {GUARDED.label}",
        "",
        "Each arm under the stress without the guard and with `stability.action: rollback` "
        "(the default objectives; remedy: KPO with the diffuse prior and the posterior-sd clip "
        "at half the learning rate; at most 3 rollbacks, then the run stops as unstable), on "
        "shared seeds. The healthy "
        "baseline is GRPO without the guard. Outcomes by the rules above, with the KL median "
        "of every run under the stress.",
        "",
        *guard_phase.arms_table(guard.results),
        "",
        guard_phase.demo_line(guard.demo),
        "",
        f"The staleness bound, fixed or adaptive (KPO with its defaults, lr 1.5e-4, no forced "
        f"lead: generation runs ahead until the buffer is full; {BOUND_SEEDS} seeds); trained "
        "tokens per second of the run's wall time, ratios and differences paired by seed with "
        "the fixed bound 8.",
        "",
        *guard_phase.bounds_table(guard.results),
        "",
    ]


def _ratio_samples(
    results: Mapping[Cell, Sequence[RunResult]], cells: Iterable[Cell]
) -> dict[Cell, dynamics.RatioSample]:
    """The recorded log-ratios of each cell's runs (cells with none are left out)."""
    samples = {}
    for cell in cells:
        try:
            samples[cell] = dynamics.load_ratios([r.path for r in results.get(cell, [])])
        except ValueError:
            continue
    return samples


def _resolved_estimator(base: RunSpec, cell: Cell) -> KalmanEstimator:
    """The cell's KPO config as its learner ran it (`reference_length: auto` resolved)."""
    spec = cell_spec(base, cell, 0)
    estimator = spec.algorithm.with_response_length(spec.generation.max_new_tokens).estimator
    if not isinstance(estimator, KalmanEstimator):
        raise ValueError(f"{cell.key}: the tracking error is KPO's; this arm is {estimator.name}")
    return estimator


def _dynamics_section(
    results: dict[Cell, list[RunResult]],
    assets: Path,
    link: str,
    figures: list[Path],
    lengths: Sequence[int],
) -> list[str]:
    """Ratio diagnostics of the recorded GRPO log-ratios per setting, and the long-sequence
    filter comparison on the last of them."""
    tables, sizes, examples = {}, {}, {}
    sample = None
    for cell, runs in results.items():
        if cell.method.key != "grpo" or cell.setting not in (*STRESSES, GENTLE, IN_FLIGHT):
            continue  # the guard phase's GRPO runs repeat the stress's
        try:
            sample = dynamics.load_ratios([r.path for r in runs])
        except ValueError:
            continue
        name = cell.setting.label
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


def _at_most(choice: StressChoice) -> str:
    if choice.collapsed == 0:
        return f"none of its {choice.seeds} seeds"
    return f"at most {choice.collapsed} of {choice.seeds} seeds"


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
    every_cell = [
        *pilot_cells(),
        *(c for s in (*STRESSES, GENTLE) for c in arm_cells(s)),
        *in_flight_cells(),
        *guard_cells(),
    ]
    if not any(pattern.search(c.key) for c in every_cell):
        raise SystemExit(f"error: no cell key matches {args.only!r}")
    args.name = args.name or args.config.stem
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.name):
        raise SystemExit(f"error: --name {args.name!r}: use letters, digits, '.', '_', '-'")
    args.out = args.out or ROOT / "runs" / args.name
    wanted = PHASES if args.phase == "all" else (args.phase,)
    start = not args.report_only
    study = Study(base, args)
    try:
        pilot_seeds = seeds_of("pilot", args)
        print(f"pilot: GRPO under {len(STRESSES)} stresses x {pilot_seeds} seeds", flush=True)
        pilot_runs = study.run(pilot_cells(), pilot_seeds, start and "pilot" in wanted)
        pilot = summaries_of(pilot_runs, pilot_seeds)
        complete = len(pilot) == len(STRESSES) and all(
            len(s.outcomes) == pilot_seeds for s in pilot.values()
        )
        choice = pick_stress({c.setting: s for c, s in pilot.items()}) if complete else None
        if "main" in wanted and choice is None and start:
            raise SystemExit("error: the main phase needs the whole pilot: run --phase pilot")
        phases: dict[Setting, dict[Cell, CellSummary]] = {}
        for phase, setting in (("main", choice.setting if choice else None), ("gentle", GENTLE)):
            if setting is None:
                continue
            seeds = seeds_of(phase, args)
            print(f"{phase}: {len(ARMS)} arms under {setting.label} x {seeds} seeds", flush=True)
            found = study.run(arm_cells(setting), seeds, start and phase in wanted)
            # GRPO's pilot runs under the chosen stress are its first seeds here.
            phases[setting] = summaries_of({c: study.results[c] for c in found}, seeds)
        seeds = seeds_of("in-flight", args)
        cells = in_flight_cells()
        print(f"in-flight: {len(cells)} arms under {IN_FLIGHT.label} x {seeds} seeds", flush=True)
        found = study.run(cells, seeds, start and "in-flight" in wanted)
        in_flight = summaries_of({c: study.results[c] for c in found}, seeds)
        guard = _guard_phase(study, start and "guard" in wanted)
        if wanted == ("guard",):
            # GRPO's runs under the stress are the guard phase's baseline, not a pilot.
            pilot, choice = {}, None
    finally:
        study.close()
    if not study.results:
        raise SystemExit(f"no finished runs under {args.out}")
    write_report(
        base, study, pilot, choice, phases, in_flight, guard, time.perf_counter() - started
    )


@dataclass(frozen=True)
class GuardPhase:
    """The guard phase's finished runs by cell, and the demo's run with the guard on."""

    results: dict[Cell, list[RunResult]]
    demo: guard_phase.DemoRun | None


def _guard_phase(study: Study, start: bool) -> GuardPhase:
    seeds = seeds_of("guard", study.args)
    # The staleness bounds compare throughput, paired by seed: fewer seeds than the arms.
    bound_seeds = min(seeds, BOUND_SEEDS)
    cells = guard_cells()
    arms = [c for c in cells if c.setting not in BOUND_SETTINGS]
    bounds = [c for c in cells if c.setting in BOUND_SETTINGS]
    print(
        f"guard: {len(arms)} cells x {seeds} seeds, {len(bounds)} staleness bounds x "
        f"{bound_seeds} seeds, then the demo with the guard",
        flush=True,
    )
    found = {**study.run(arms, seeds, start), **study.run(bounds, bound_seeds, start)}
    results = {c: [r for r in runs if r.seed < seeds] for c, runs in found.items()}
    demo = None
    if not study.args.only or study.pattern.search(guard_phase.DEMO_DIR):
        if start:
            study.connect()
        demo = guard_phase.run_demo(load_run_spec(DEMO_CONFIG, []), study.args.out, start)
    return GuardPhase(results, demo)


if __name__ == "__main__":
    main()
