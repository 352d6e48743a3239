"""Synchronous vs asynchronous pipeline, batch vs streaming generation, with and without in-flight
weight updates: trained tokens/s, seconds per learner step and mean staleness, in one run.

Every mode runs the same spec (examples/demo.yaml unless --config) on one local Ray instance,
one after the other; the first --warmup steps of each are left out (actor start-up, first
compilations). Modes:

    sync             generation pauses while the learner trains (the baseline of every ratio)
    async-batch      asynchronous; a worker gets new prompts only when its whole batch ended
    async-stream     asynchronous; groups return as they end and the engine is refilled at once
    async-stream-sequential-publish
                     async-stream with each publish before the next learner step
                     (`overlap_publish: false`; the other async modes overlap it)
    async-inflight   async-stream, and new weights load between decoding steps

Beside throughput, each mode gives the learner's idle time per step: its own
`learner_idle_seconds`, from the end of one step to the start of the next (waiting for a batch,
or for a publish or checkpoint before the step), the mean over the measured steps.

With --long-tail the prompts mix difficulties 1-5 (responses of about 30 to 180 tokens), where
a batch waits for its longest response: that is what streaming removes. On a machine where
generation and the learner each have a core the ceiling of async over sync is about 2x.

With --worker-loss, one more run (two serving workers, one warm standby) has both serving
workers killed at once: the time from the death to the next group of that worker's place, when
a standby took it vs when a new actor replaced it (benchmarks/worker_loss.py), with the ratio.

Then, on long-tailed prompts with a slow verifier, a fixed pool of one generation worker
against an elastic pool (`generation.actors`, 1 to 3 workers) started at one: trained tokens/s
of each and their ratio (benchmarks/elastic_pool.py; --no-pools leaves it out, --pools-only
runs it alone).

    python benchmarks/bench_pipeline.py [--long-tail] [--steps 24] [--warmup 4] [--modes ...]
        [--worker-loss] [--no-pools | --pools-only]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import print_table
from checkpoint_hold import checkpoint_hold
from elastic_pool import add_to_actor_path, compare_pools
from worker_loss import worker_loss_recovery, worker_loss_spec

from services.observers import MetricsRecord
from services.pipeline.actors import connect_ray
from services.pipeline.launch import execute_run
from services.pipeline.outputs import RunDirectory
from services.pipeline.specs import load_run_spec
from services.spec import RunSpec

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"

# mode -> (pipeline settings, generation settings)
MODES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "sync": ({"mode": "sync", "max_staleness": 0}, {"streaming": False}),
    "async-batch": ({"mode": "async"}, {"streaming": False}),
    "async-stream": ({"mode": "async"}, {"streaming": True}),
    "async-stream-sequential-publish": (
        {"mode": "async", "overlap_publish": False},
        {"streaming": True},
    ),
    "async-inflight": ({"mode": "async", "in_flight_updates": True}, {"streaming": True}),
}
LONG_TAIL = {"task": {"name": "arith", "difficulty": 1, "difficulty_max": 5}}
LONG_TAIL_MAX_NEW_TOKENS = 192  # above the longest level-5 response


def measured(records: list[MetricsRecord], warmup: int) -> tuple[float, float, float]:
    """(trained tokens/s, seconds per step, learner idle seconds per step) over the steps after
    the first `warmup` (>= 1)."""
    if not 1 <= warmup < len(records):
        raise ValueError(f"need 1 <= warmup < steps, got warmup {warmup} of {len(records)}")
    window = records[warmup:]
    seconds = window[-1]["wall_seconds"] - records[warmup - 1]["wall_seconds"]
    tokens = sum(r["tokens_trained"] for r in window)
    idle = sum(r["learner_idle_seconds"] for r in window) / len(window)
    return tokens / seconds, seconds / len(window), idle


def mode_spec(base: RunSpec, mode: str, steps: int, long_tail: bool) -> RunSpec:
    """`base` set up for `mode`, `steps` steps, no checkpoints; long-tailed prompts if asked."""
    pipeline, generation = MODES[mode]
    data = base.model_dump(mode="json")
    data["pipeline"].update(pipeline, steps=steps, checkpoint_every=0)
    data["generation"].update(generation)
    if long_tail:
        data.update(LONG_TAIL)
        data["generation"]["max_new_tokens"] = LONG_TAIL_MAX_NEW_TOKENS
    return RunSpec.model_validate(data)


def run_mode(spec: RunSpec) -> list[MetricsRecord]:
    with tempfile.TemporaryDirectory() as out:
        run_dir = RunDirectory(Path(out))
        state = execute_run(spec, run_dir)
        if state != "succeeded":
            raise RuntimeError(f"the {spec.pipeline.mode} run ended {state}")
        return run_dir.read_metrics()


def run_modes(base: RunSpec, args: argparse.Namespace) -> dict[str, float]:
    """Each of `args.modes` in turn; the table, and each mode's rate over sync's."""
    rows, rates = [], {}
    for mode in args.modes:
        records = run_mode(mode_spec(base, mode, args.steps, args.long_tail))
        rate, per_step, idle = measured(records, args.warmup)
        rates[mode] = rate
        staleness = sum(r["staleness_mean"] for r in records) / len(records)
        span = max(r["version_span_max"] for r in records)
        print(
            f"{mode}: {rate:,.0f} trained tokens/s, {per_step:.2f} s/step, learner idle "
            f"{idle:.3f} s/step",
            flush=True,
        )
        rows.append(
            [
                mode,
                f"{rate:,.0f}",
                f"{per_step:.2f}",
                f"{idle:.3f}",
                f"{staleness:.2f}",
                f"{span:.0f}",
            ]
        )
    tail = ", long-tailed prompts (difficulty 1-5)" if args.long_tail else ""
    print(f"{args.config.name}: {args.steps} steps per mode, first {args.warmup} left out{tail}")
    for row in rows:
        row.append(f"{rates[row[0]] / rates['sync']:.2f}x")
    header = [
        "mode", "trained tokens/s", "s/step", "learner idle s/step", "mean staleness",
        "max version span",
    ]  # fmt: skip
    print_table([*header, "vs sync"], rows)
    return {mode: rate / rates["sync"] for mode, rate in rates.items()}


def run_pools(base: RunSpec, args: argparse.Namespace) -> None:
    """The fixed and the elastic pool on long-tailed prompts with a slow verifier."""
    long_tail = mode_spec(base, "async-stream", args.steps, long_tail=True)
    rows = compare_pools(long_tail, args.warmup, run_mode, measured)
    print(
        f"{args.config.name}: {args.steps} steps per pool, first {args.warmup} left out, "
        "long-tailed prompts (difficulty 1-5), slow verifier"
    )
    header = [
        "pool", "trained tokens/s", "s/step", "learner idle s/step", "workers at the end",
        "grows", "shrinks", "vs fixed",
    ]  # fmt: skip
    print_table(header, rows)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--long-tail", action="store_true", help="difficulties 1-5 mixed")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument(
        "--checkpoints", type=int, default=0, help="also time the learner held per checkpoint"
    )
    parser.add_argument(
        "--worker-loss",
        action="store_true",
        help="also time a lost worker's place: standby vs replacement, in one run",
    )
    pools = parser.add_mutually_exclusive_group()
    pools.add_argument("--no-pools", action="store_true", help="leave out fixed vs elastic")
    pools.add_argument("--pools-only", action="store_true", help="only fixed vs elastic")
    args = parser.parse_args(argv)
    if "sync" not in args.modes and not args.pools_only:
        parser.error("--modes must include sync: every ratio is against it")
    base = load_run_spec(args.config, args.overrides)
    if args.checkpoints:
        checkpoint_hold(base, args.checkpoints)
    add_to_actor_path()  # before Ray starts: the slow verifier's module, for the actors
    loss_spec = worker_loss_spec(base)
    # The worker-loss run reserves the most (three workers): a local instance sized for it
    # holds every mode's run too.
    connect_ray(loss_spec if args.worker_loss else base)
    if args.worker_loss:
        worker_loss_recovery(loss_spec)
    ratios = {} if args.pools_only else run_modes(base, args)
    if not args.no_pools:
        run_pools(base, args)
    ray.shutdown()
    return ratios


if __name__ == "__main__":
    main()
