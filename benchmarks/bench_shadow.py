"""The cost of shadow estimators (`algorithm.shadow`): a learner step with none against one with
four (token, sequence, geometric, cumulative beside the training estimator, KPO), measured in
the same run.

Two models: the committed tiny model (`tiny-arith`, hidden 128, vocabulary 260: its step is
cheap, so the shadows' own cost shows most), and a random-initialised Qwen2 of Qwen2.5-0.5B's
width (hidden 896, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151936, tied) with
`--layers` decoder layers (2 by default, and a short batch, to take about a minute on 2 CPU
cores: the shadows' cost grows with the tokens, not with the model, whose step grows with
both). The batch is one synthetic group of random token ids with behaviour log-probs of a
uniform policy (bench_learner.py's); every learner takes a short warm-up step first (2 rows of
8 tokens: first-call set-up, AdamW's state). One torch thread by default (`--threads`): when
other processes keep the cores busy, they slow multi-threaded small tensor operations far more
than single-threaded ones, which made the shadows' share noise.

Time: one forked process holds a learner without shadows and one with four and runs their
steps alternately (`--steps` each on the tiny model, `--wide-steps` on the wide one), so that
both meet the same load from other processes; twice, either learner built first (the one built
second ran a few percent faster on the wide model, whichever it was). Reported are each one's
median step, the median of the paired ratios (shadowed step / the baseline step beside it), and
the shadows' own work per step, timed directly: their losses (`LearnerCore._shadow_losses`)
plus the extra time of the step's ratio diagnostics (`RatioLog.diagnostic_sums`), also as a
fraction of the baseline step (steadier than the paired ratio under load). Memory: each setting
in its own forked process, one step after the warm-up step, its peak RSS (VmHWM, reset before
the step) and the peak above the RSS before it (bench_learner.py's measure of a process's
memory).

Usage: python benchmarks/bench_shadow.py [--steps 5] [--wide-steps 3] [--layers 2] [--no-wide]
       [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The repository too: run as a script where the project is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import print_table
from bench_learner import (
    QWEN25_05B,
    WARMUP_TOKENS,
    ModelShape,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    run_forked,
    save_model,
    synthetic_groups,
)
from transformers.utils import logging as hf_logging

from kpo_core.config import AlgorithmConfig
from services.learner.distributed import RankGroup
from services.learner.step import LearnerCore, RatioLog
from services.messages import ScoredGroup
from services.spec import LearnerConfig
from services.tasks.tiny_model import DEFAULT_MODEL_DIR

MiB = 2**20
SHADOWS = ("token", "sequence", "geometric", "cumulative")
LABELS = ("none", "four")  # the two settings: no shadow estimator, the four SHADOWS
TINY_VOCAB = 260  # tiny-arith's vocabulary
PROMPT_TOKENS = 16


@dataclass(frozen=True)
class Case:
    """One model and batch to measure: `rows` responses of `tokens` tokens, `steps` timed
    steps of each setting."""

    name: str
    model_dir: str
    vocab: int
    rows: int
    tokens: int
    steps: int

    def groups(self) -> list[ScoredGroup]:
        return synthetic_groups(self.rows, self.tokens, PROMPT_TOKENS, self.vocab, seed=0)

    def warm_up(self, core: LearnerCore) -> None:
        core.train_step(synthetic_groups(2, WARMUP_TOKENS, 1, self.vocab, seed=1))


class Timed:
    """The seconds a learner spends in its shadow losses and ratio diagnostics, summed."""

    def __init__(self, core: LearnerCore) -> None:
        self.shadow_losses = 0.0
        self.diagnostics = 0.0
        shadow_losses = core._shadow_losses

        def timed_losses(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return shadow_losses(*args)
            finally:
                self.shadow_losses += time.perf_counter() - start

        setattr(core, "_shadow_losses", timed_losses)  # noqa: B010  # this instance's, timed
        self.core = core

    def step(self, groups: list[Any]) -> tuple[float, dict[str, float]]:
        """One learner step: its seconds and record; the diagnostics' share is timed too."""
        diagnostic_sums = RatioLog.diagnostic_sums

        def timed_sums(log: RatioLog, device: Any) -> Any:
            start = time.perf_counter()
            try:
                return diagnostic_sums(log, device)
            finally:
                self.diagnostics += time.perf_counter() - start

        setattr(RatioLog, "diagnostic_sums", timed_sums)  # noqa: B010  # timed for this step
        try:
            start = time.perf_counter()
            record = self.core.train_step(groups)
            return time.perf_counter() - start, record
        finally:
            setattr(RatioLog, "diagnostic_sums", diagnostic_sums)  # noqa: B010


def learner(case: Case, shadow: Sequence[str]) -> LearnerCore:
    algorithm = AlgorithmConfig.model_validate({"shadow": list(shadow)})
    settings = LearnerConfig(lr=1e-6, micro_batch_tokens=0)
    return LearnerCore(case.model_dir, settings, algorithm, 1.0, response_length=case.tokens)


def measure_time(group: RankGroup, case: Case, first: str) -> dict[str, Any]:
    """Step times of a learner without shadows and one with four, in this one process, their
    steps alternating (which goes first alternates too): both meet the same load. `first`:
    the one built first ("none" or "four")."""
    groups, steps = case.groups(), case.steps
    order = LABELS if first == "none" else LABELS[::-1]
    timed = {label: Timed(learner(case, SHADOWS if label == "four" else ())) for label in order}
    for one in timed.values():
        case.warm_up(one.core)
        one.shadow_losses = one.diagnostics = 0.0
    seconds: dict[str, list[float]] = {label: [] for label in LABELS}
    keys = 0
    for index in range(steps):
        for label in LABELS if index % 2 == 0 else LABELS[::-1]:
            took, record = timed[label].step(groups)
            seconds[label].append(took)
            keys = max(keys, sum(key.startswith("shadow_") for key in record))
    return {
        "seconds": seconds,
        "shadow_loss_seconds": timed["four"].shadow_losses / steps,
        "diagnostics_seconds": {label: t.diagnostics / steps for label, t in timed.items()},
        "shadow_keys": keys,
    }


def pooled(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The timing processes' steps together: medians, the median paired ratio, and the mean
    work per step."""
    seconds = {label: [t for run in runs for t in run["seconds"][label]] for label in LABELS}
    ratios = [four / none for none, four in zip(seconds["none"], seconds["four"], strict=True)]
    return {
        "seconds": seconds,
        "median_seconds": {label: statistics.median(seconds[label]) for label in LABELS},
        "median_ratio": statistics.median(ratios),
        "shadow_loss_seconds": statistics.mean(run["shadow_loss_seconds"] for run in runs),
        "diagnostics_seconds": {
            label: statistics.mean(run["diagnostics_seconds"][label] for run in runs)
            for label in LABELS
        },
        "shadow_keys": max(run["shadow_keys"] for run in runs),
    }


def measure_memory(group: RankGroup, case: Case, shadow: Sequence[str]) -> dict[str, Any]:
    """The peak RSS of one learner step after a warm-up step, in this (fresh) process, and the
    peak above the RSS before the step."""
    core = learner(case, shadow)
    groups = case.groups()
    case.warm_up(core)
    resident = rss_bytes()
    reset_peak_rss()
    core.train_step(groups)
    peak = peak_rss_bytes()
    return {"peak_rss_bytes": peak, "peak_above_resident_bytes": peak - resident}


def measure_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """The step times of both settings in one process (twice, either built first: the learner
    built second measured a few percent faster on the wide model), then each one's memory in
    its own."""
    timing = pooled(
        [
            run_forked(measure_time, 1, args.threads, args.timeout_s, case, first)[0]
            for first in LABELS
        ]
    )
    memory = {
        label: run_forked(measure_memory, 1, args.threads, args.timeout_s, case, shadow)[0]
        for label, shadow in zip(LABELS, ((), SHADOWS), strict=True)
    }
    none, four = timing["median_seconds"]["none"], timing["median_seconds"]["four"]
    diagnostics = timing["diagnostics_seconds"]
    shadow_work = timing["shadow_loss_seconds"] + diagnostics["four"] - diagnostics["none"]
    return {
        "case": asdict(case),
        "timing": timing,
        "memory": memory,
        "step_seconds": {"none": none, "four": four},
        "step_time_ratio": timing["median_ratio"],
        "shadow_work_seconds": shadow_work,
        "shadow_work_fraction": shadow_work / none,
        "peak_rss_ratio": memory["four"]["peak_rss_bytes"] / memory["none"]["peak_rss_bytes"],
        "extra_peak_bytes": memory["four"]["peak_rss_bytes"] - memory["none"]["peak_rss_bytes"],
    }


def print_report(results: list[dict[str, Any]]) -> None:
    rows = []
    for result in results:
        case, timing, memory = result["case"], result["timing"], result["memory"]
        for label in LABELS:
            base = label == "none"
            rows.append(
                [
                    case["name"],
                    f"{case['rows']} x {case['tokens']}",
                    "none" if base else "+".join(SHADOWS),
                    f"{result['step_seconds'][label] * 1e3:.0f}",
                    "1.00" if base else f"{result['step_time_ratio']:.3f}",
                    "" if base else f"{timing['shadow_loss_seconds'] * 1e3:.1f}",
                    "" if base else f"{result['shadow_work_seconds'] * 1e3:.1f}",
                    "" if base else f"{result['shadow_work_fraction']:.3f}",
                    f"{memory[label]['peak_rss_bytes'] / MiB:.0f}",
                    "1.000" if base else f"{result['peak_rss_ratio']:.3f}",
                    f"{memory[label]['peak_above_resident_bytes'] / MiB:.1f}",
                ]
            )
    print()
    print_table(
        [
            "model",
            "rows x tokens",
            "shadows",
            "step ms",
            "x base (paired)",
            "shadow losses ms",
            "shadow work ms",
            "x base step",
            "peak RSS MiB",
            "x base",
            "step peak over resident MiB",
        ],
        rows,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setting, process")
    parser.add_argument("--tiny-rows", type=int, default=8)
    parser.add_argument("--tiny-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the wide model")
    parser.add_argument("--rows", type=int, default=2, help="responses of the wide model's batch")
    parser.add_argument("--tokens", type=int, default=64, help="their length")
    parser.add_argument("--wide-steps", type=int, default=3, help="--steps of the wide model")
    parser.add_argument("--no-wide", action="store_true", help="the tiny model only")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per process")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    sizes = (args.steps, args.wide_steps, args.tiny_rows, args.tiny_tokens, args.rows, args.tokens)
    if min(sizes) < 1:
        parser.error("--steps, --wide-steps, --*rows and --*tokens must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    begun = time.perf_counter()
    results = []
    tiny = Case(
        "tiny-arith", str(DEFAULT_MODEL_DIR), TINY_VOCAB, args.tiny_rows, args.tiny_tokens,
        args.steps,
    )  # fmt: skip
    results.append(measure_case(tiny, args))
    print(f"[tiny-arith] done ({time.perf_counter() - begun:.0f} s)", flush=True)
    if not args.no_wide:
        shape = ModelShape(
            f"Qwen2.5-0.5B width, {args.layers} layers", QWEN25_05B.hidden, args.layers,
            QWEN25_05B.heads, QWEN25_05B.kv_heads, QWEN25_05B.intermediate, QWEN25_05B.vocab,
            tied=True,
        )  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="bench-shadow-") as model_dir:
            [saved] = run_forked(save_model, 1, args.threads, args.timeout_s, shape, model_dir, 0)
            print(f"[model] {shape.name}: {saved['params'] / 1e6:.0f}M parameters", flush=True)
            wide = Case(shape.name, model_dir, shape.vocab, args.rows, args.tokens, args.wide_steps)
            results.append(measure_case(wide, args))
        print(f"[wide] done ({time.perf_counter() - begun:.0f} s)", flush=True)
    print_report(results)
    print(f"\n{time.perf_counter() - begun:.0f} s in all, {args.threads} torch threads")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
