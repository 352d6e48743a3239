"""Truncated-sampling replay (`algorithm.off_policy.truncated_sampling: replay`), measured in
one run: the bias it removes, what it costs the learner, and what it does to a KPO run.

1. Bias. The demo model (tiny-arith) samples groups of the demo's task at the demo's
   temperature with top-p 0.8, top-p 0.95 and top-k 20, recording each token's kept set. A
   learner with the same weights scores them twice, replayed and with the sets dropped
   (`allow`); its `onpolicy_ratio_mean` / `_std` (every token: proximal log-probs, staleness 0)
   is the mean ratio at zero staleness: 1 with replay (goal: within 0.005), the kept mass S
   without (TRL measured 0.896 at top-p 0.8 on its model, huggingface/trl #7269).
2. Cost. Learner steps with replay against the same steps without, alternately in one process
   (`--steps` each), on the tiny model's groups of part 1 and on a random model of
   Qwen2.5-0.5B's width (`--layers` layers, vocabulary 151,936) with synthetic groups whose
   kept sets hold 1 to `--wide-kept` ids; and each setting's peak RSS above the process's
   before one step, in a forked process of its own (bench_learner.py's measure). Goal: at most
   1.1x the time and memory.
3. Runs. KPO with its defaults on the study's base spec (examples/study.yaml: 50 steps,
   asynchronous) at top-p 1.0, at top-p 0.9 replayed and at top-p 0.9 unreplayed (`allow`),
   `--seeds` shared seeds each, through the stability study's runner: final held-out accuracy
   (512 prompts, sampled untruncated, as the study samples) and paired differences.
   `--no-runs` skips this part (about 25 minutes on 2 cores).

Usage: python benchmarks/bench_replay.py [--groups 16] [--steps 5] [--layers 2]
       [--wide-kept 64] [--seeds 3] [--no-runs] [--out DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

# The repository too: run as a script where the project is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import print_table
from bench_learner import (
    QWEN25_05B,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    run_forked,
    save_model,
    synthetic_groups,
)

from kpo_core.config import AlgorithmConfig
from services.generation.base import SamplingSettings
from services.generation.hf_backend import HFBackend
from services.learner.distributed import RankGroup
from services.learner.step import LearnerCore
from services.messages import Prompt, ScoredGroup, ScoredResponse
from services.pipeline.specs import load_run_spec
from services.spec import LearnerConfig, RunSpec
from services.tasks import generate_prompts
from services.tasks.answers import is_correct
from services.tasks.models import resolve_model

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.yaml"
STUDY = ROOT / "examples" / "study.yaml"
MiB = 2**20
MAX_KEPT = 256  # generation.replay_max_kept's default
TRL_UNREPLAYED = 0.896  # TRL's mean ratio at zero staleness, top-p 0.8, unreplayed (#7269)
BIAS_SETTINGS: dict[str, dict[str, Any]] = {
    "top-p 0.8": {"top_p": 0.8},
    "top-p 0.95": {"top_p": 0.95},
    "top-k 20": {"top_k": 20},
}
TIMED_SETTING = "top-p 0.95"  # the tiny model's cost is measured on these groups


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16, help="prompts sampled per setting")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each setting")
    parser.add_argument("--layers", type=int, default=2, help="layers of the wide model")
    parser.add_argument("--wide-kept", type=int, default=64, help="largest synthetic kept set")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of each run arm")
    parser.add_argument("--no-runs", action="store_true", help="skip part 3 (the runs)")
    parser.add_argument("--out", type=Path, default=None, help="the runs' directory")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    return parser.parse_args()


# --- 1. bias ---------------------------------------------------------------------------------


def sampled_groups(spec: RunSpec, truncation: dict[str, Any], count: int) -> list[ScoredGroup]:
    """`count` groups of the demo's task, sampled by the demo model with `truncation` and the
    kept sets recorded (rewards alternate: the advantages are not what is measured)."""
    gen = spec.generation
    backend = HFBackend(str(resolve_model(spec.model)))
    prompts = generate_prompts(count, seed=7, difficulty=spec.task.difficulty)  # type: ignore[union-attr]
    sampling = SamplingSettings(
        temperature=gen.temperature,
        max_new_tokens=gen.max_new_tokens,
        seed=11,
        replay_max_kept=MAX_KEPT,
        **truncation,
    )
    groups = backend.generate(prompts, gen.group_size, sampling)
    return [
        ScoredGroup(
            p,
            [ScoredResponse(r, float(is_correct(r.text, p.answer)), True) for r in g],
        )
        for p, g in zip(prompts, groups, strict=True)
    ]


def without_sets(groups: list[ScoredGroup]) -> list[ScoredGroup]:
    return [
        ScoredGroup(
            g.prompt, [replace(s, response=replace(s.response, kept_ids=[])) for s in g.responses]
        )
        for g in groups
    ]


def learner(model_dir: str, mode: str, temperature: float, tokens: int) -> LearnerCore:
    """A learner with proximal log-probs (every token at staleness 0 counts on-policy)."""
    algorithm = AlgorithmConfig.model_validate(
        {"reference": "proximal", "off_policy": {"truncated_sampling": mode}}
    )
    settings = LearnerConfig(lr=1e-6, micro_batch_tokens=0)
    return LearnerCore(model_dir, settings, algorithm, temperature, response_length=tokens)


def bias(spec: RunSpec, groups: dict[str, list[ScoredGroup]]) -> list[dict[str, Any]]:
    model_dir = str(resolve_model(spec.model))
    gen = spec.generation
    rows = []
    for name, sampled in groups.items():
        row: dict[str, Any] = {"setting": name}
        for mode, given in (("replay", sampled), ("allow", without_sets(sampled))):
            core = learner(model_dir, mode, gen.temperature, gen.max_new_tokens)
            record = core.train_step(given)
            row[mode] = {
                key: record[key]
                for key in ("onpolicy_ratio_mean", "onpolicy_ratio_std", "onpolicy_tokens")
            }
            if mode == "replay":
                row["kept_mean"], row["kept_p99"] = (
                    record["replay_kept_mean"],
                    record["replay_kept_p99"],
                )
        rows.append(row)
    return rows


# --- 2. cost ---------------------------------------------------------------------------------


def with_synthetic_sets(groups: list[ScoredGroup], vocab: int, largest: int) -> list[ScoredGroup]:
    """`groups` with a kept set for every token: the token and 0 to largest - 1 other ids."""
    rng = random.Random(5)
    out = []
    for group in groups:
        scored = []
        for s in group.responses:
            sets = []
            for token in s.response.response_token_ids:
                others = rng.sample(range(vocab), rng.randrange(largest))
                sets.append(sorted({token, *others}))
            scored.append(replace(s, response=replace(s.response, kept_ids=sets)))
        out.append(ScoredGroup(group.prompt, scored))
    return out


def time_steps(
    group: RankGroup, model_dir: str, groups: list[ScoredGroup], tokens: int, steps: int
) -> dict[str, Any]:
    """Seconds of `steps` alternate steps of a replaying learner and one without the sets."""
    cores = {mode: learner(model_dir, mode, 1.0, tokens) for mode in ("replay", "allow")}
    given = {"replay": groups, "allow": without_sets(groups)}
    for mode, core in cores.items():
        core.train_step(given[mode])  # warm-up: first-call set-up, AdamW's state
    seconds: dict[str, list[float]] = {"replay": [], "allow": []}
    for _ in range(steps):
        for mode, core in cores.items():
            start = time.perf_counter()
            core.train_step(given[mode])
            seconds[mode].append(time.perf_counter() - start)
    return seconds


def peak_memory(
    group: RankGroup, model_dir: str, groups: list[ScoredGroup], tokens: int, mode: str
) -> dict[str, Any]:
    core = learner(model_dir, mode, 1.0, tokens)
    given = groups if mode == "replay" else without_sets(groups)
    core.train_step(given)
    before = rss_bytes()
    reset_peak_rss()
    core.train_step(given)
    return {"peak_above_bytes": peak_rss_bytes() - before, "peak_bytes": peak_rss_bytes()}


def cost(
    name: str, model_dir: str, groups: list[ScoredGroup], tokens: int, steps: int
) -> dict[str, Any]:
    [seconds] = run_forked(time_steps, 1, 1, 3600, model_dir, groups, tokens, steps)
    memory = {
        mode: run_forked(peak_memory, 1, 1, 3600, model_dir, groups, tokens, mode)[0]
        for mode in ("replay", "allow")
    }
    ratios = [r / a for r, a in zip(seconds["replay"], seconds["allow"], strict=True)]
    return {
        "case": name,
        "replay_s": statistics.median(seconds["replay"]),
        "allow_s": statistics.median(seconds["allow"]),
        "time_ratio": statistics.median(ratios),
        "replay_peak_mib": memory["replay"]["peak_above_bytes"] / MiB,
        "allow_peak_mib": memory["allow"]["peak_above_bytes"] / MiB,
        "memory_ratio": memory["replay"]["peak_bytes"] / memory["allow"]["peak_bytes"],
    }


def wide_case(layers: int, largest: int, tmp: str) -> tuple[str, list[ScoredGroup], int]:
    shape = replace(QWEN25_05B, layers=layers, name=f"{QWEN25_05B.name} x{layers}")
    run_forked(save_model, 1, 1, 600, shape, tmp, 0)
    rows, tokens = 8, 256
    groups = synthetic_groups(rows, tokens, 16, shape.vocab, seed=0)
    return tmp, with_synthetic_sets(groups, shape.vocab, largest), tokens


# --- 3. runs ---------------------------------------------------------------------------------


def run_arms() -> dict[str, Any]:
    """The runs' arms by label: KPO with its defaults (the cells' method, keyed `kpo`) at top-p
    1.0 and at top-p 0.9 replayed, and at top-p 0.9 declared unreplayed (`allow`)."""
    from stability_study.grid import BOUND_ARM, Cell, Method, Setting

    def top_p(value: float) -> Setting:
        return Setting(f"top-p-{value}", f"top-p {value}", {"generation": {"top_p": value}})

    unreplayed = Method(
        "kpo-allow", "KPO, truncation unreplayed", {"name": "kalman"},
        off_policy={"truncated_sampling": "allow"},
    )  # fmt: skip
    return {
        "top-p 1.0": Cell(BOUND_ARM, top_p(1.0)),
        "top-p 0.9 replayed": Cell(BOUND_ARM, top_p(0.9)),
        "top-p 0.9 unreplayed": Cell(unreplayed, top_p(0.9)),
    }


OWN_SAMPLING_FILE = "own_sampling.json"  # a run's held-out accuracy at its own top-p, by step


def own_sampling_accuracy(prompts: list[Prompt], spec: RunSpec, top_p: float, model: Path) -> float:
    """Held-out accuracy sampled as the run sampled its training rollouts (its temperature and
    top-p), with the study's prompts and sampling seed."""
    from stability_study.evaluate import EVAL_SAMPLING_SEED

    gen = spec.generation
    sampling = SamplingSettings(
        temperature=gen.temperature,
        top_p=top_p,
        max_new_tokens=gen.max_new_tokens,
        seed=EVAL_SAMPLING_SEED,
    )
    groups = HFBackend(str(model)).generate(prompts, 1, sampling)
    return statistics.fmean(
        float(is_correct(g[0].text, p.answer)) for g, p in zip(groups, prompts, strict=True)
    )


def recording(
    evaluator: Any, spec: RunSpec, top_p: float
) -> tuple[Callable[[Path], Any], list[float]]:
    """The study's evaluation of a checkpoint, which also appends its accuracy at `top_p` (where
    that truncates) to the list returned with it."""
    own: list[float] = []

    def evaluate(model: Path) -> Any:
        if top_p < 1.0:
            own.append(own_sampling_accuracy(evaluator.prompts, spec, top_p, model))
        return evaluator.evaluate(model)

    return evaluate, own


def run_arm(
    label: str, cell: Any, seeds: int, out: Path, connect: Callable[[], None]
) -> dict[str, list[float]]:
    """One arm's runs (run, or reused under `out`): per seed its final held-out accuracy
    sampled untruncated (the study's evaluator) and as it trained (its top-p; the same for
    top-p 1), and its mean on-policy ratio."""
    from stability_study.evaluate import HeldOutEvaluator
    from stability_study.runner import load_result, run_one, run_path

    base = load_run_spec(STUDY)
    evaluator = HeldOutEvaluator(base, 512)
    top_p = float(cell.setting.overrides["generation"]["top_p"])
    arm: dict[str, list[float]] = {"final": [], "own": [], "onpolicy": []}
    for seed in range(seeds):
        result = load_result(out, cell, seed)
        if result is None:
            connect()
            evaluate, own = recording(evaluator, base, top_p)
            result = run_one(base, cell, seed, out, evaluator.initial, evaluate)
            (run_path(out, cell, seed) / OWN_SAMPLING_FILE).write_text(json.dumps(own))
        final = result.evaluations[max(result.evaluations)].accuracy
        arm["final"].append(final)
        if top_p < 1.0:
            own_path = run_path(out, cell, seed) / OWN_SAMPLING_FILE
            recorded = json.loads(own_path.read_text()) if own_path.exists() else []
            arm["own"].append(recorded[-1] if recorded else math.nan)
        else:
            arm["own"].append(final)
        ratios = [r["onpolicy_ratio_mean"] for r in result.records if "onpolicy_ratio_mean" in r]
        arm["onpolicy"].append(statistics.fmean(ratios) if ratios else math.nan)
        print(
            f"  {label} seed {seed}: held-out {final:.3f}, at its top-p {arm['own'][-1]:.3f}",
            flush=True,
        )
    return arm


def runs(seeds: int, out: Path) -> dict[str, Any]:
    """Each of `run_arms`, `seeds` shared seeds (`run_arm`), and the paired differences of
    their final held-out accuracies, sampled untruncated and as each arm trained, with
    bootstrap intervals."""
    import ray

    from services.pipeline.actors import connect_ray
    from stability_study.stats import bootstrap_interval

    connected: list[bool] = []

    def connect() -> None:
        if not connected:
            connect_ray(load_run_spec(STUDY))
            connected.append(True)

    try:
        arms = {
            label: run_arm(label, cell, seeds, out, connect) for label, cell in run_arms().items()
        }
    finally:
        if connected:
            ray.shutdown()
    pairs = {
        "replayed - top-p 1.0": ("top-p 0.9 replayed", "top-p 1.0"),
        "unreplayed - top-p 1.0": ("top-p 0.9 unreplayed", "top-p 1.0"),
        "replayed - unreplayed": ("top-p 0.9 replayed", "top-p 0.9 unreplayed"),
    }
    differences: dict[str, dict[str, Any]] = {}
    for name, (a, b) in pairs.items():
        for sampled in ("final", "own"):
            paired = [x - y for x, y in zip(arms[a][sampled], arms[b][sampled], strict=True)]
            differences[f"{name} ({sampled})"] = {
                "mean": statistics.fmean(paired),
                "interval": bootstrap_interval(paired),
            }
    return {"arms": arms, "differences": differences}


def _print_runs(figures: dict[str, Any]) -> None:
    rows = [
        [
            label,
            f"{statistics.fmean(arm['final']):.3f}",
            " ".join(f"{v:.3f}" for v in arm["final"]),
            f"{statistics.fmean(arm['own']):.3f}",
            " ".join(f"{v:.3f}" for v in arm["own"]),
            f"{statistics.fmean(arm['onpolicy']):.4f}",
        ]
        for label, arm in figures["arms"].items()
    ]
    headers = ["arm", "final held-out", "by seed", "at its top-p", "by seed", "on-policy ratio"]
    print_table(headers, rows)
    for name, diff in figures["differences"].items():
        low, high = diff["interval"]
        print(f"  {name}, paired: {diff['mean']:+.3f} [{low:+.3f}, {high:+.3f}]")


def _bias_row(row: dict[str, Any]) -> list[str]:
    """A bias table row: each mode's on-policy ratio as mean (sd)."""
    replayed, plain = row["replay"], row["allow"]
    return [
        row["setting"],
        f"{row['kept_mean']:.1f} / {row['kept_p99']:.0f}",
        f"{replayed['onpolicy_ratio_mean']:.5f} ({replayed['onpolicy_ratio_std']:.1e})",
        f"{plain['onpolicy_ratio_mean']:.4f} ({plain['onpolicy_ratio_std']:.3f})",
        f"{replayed['onpolicy_tokens']:.0f}",
    ]


def main() -> None:
    args = parse_args()
    spec = load_run_spec(DEMO)
    print(
        f"1. bias: {args.groups} groups of {spec.generation.group_size} per setting, demo model",
        flush=True,
    )
    groups = {name: sampled_groups(spec, t, args.groups) for name, t in BIAS_SETTINGS.items()}
    figures: dict[str, Any] = {"bias": bias(spec, groups)}
    print_table(
        ["setting", "kept mean / p99", "ratio, replayed", "ratio, unreplayed", "tokens"],
        [_bias_row(row) for row in figures["bias"]],
    )
    print(f"(TRL, its model, top-p 0.8 unreplayed: {TRL_UNREPLAYED})")
    print(
        f"2. cost: {args.steps} alternate steps each; peak memory in a process of its own",
        flush=True,
    )
    tiny = str(resolve_model(spec.model))
    figures["cost"] = [
        cost("tiny-arith", tiny, groups[TIMED_SETTING], spec.generation.max_new_tokens, args.steps)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, wide, tokens = wide_case(args.layers, args.wide_kept, tmp)
        name = f"Qwen2.5-0.5B width x{args.layers} layers, sets of 1-{args.wide_kept}"
        figures["cost"].append(cost(name, model_dir, wide, tokens, args.steps))
    print_table(
        ["case", "step s replay / without", "ratio", "peak MiB replay / without", "peak RSS ratio"],
        [
            [
                c["case"],
                f"{c['replay_s']:.3f} / {c['allow_s']:.3f}",
                f"{c['time_ratio']:.3f}x",
                f"{c['replay_peak_mib']:.0f} / {c['allow_peak_mib']:.0f}",
                f"{c['memory_ratio']:.3f}x",
            ]
            for c in figures["cost"]
        ],
    )
    if not args.no_runs:
        out = args.out or Path(tempfile.mkdtemp(prefix="bench-replay-"))
        print(f"3. runs: KPO, {args.seeds} seeds, in {out}", flush=True)
        figures["runs"] = runs(args.seeds, out)
        _print_runs(figures["runs"])
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
