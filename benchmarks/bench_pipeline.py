"""Synchronous vs asynchronous pipeline: trained tokens/s and seconds per learner step, one run.

Both modes run the same spec (examples/demo.yaml unless --config) on one local Ray instance,
one after the other; the first --warmup steps of each are left out (actor start-up, first
compilations). Asynchronous mode overlaps generation with the learner step, so on a machine
where each has its own core the ceiling is about 2x; it approaches it when the two take
equally long.

    python benchmarks/bench_pipeline.py [--steps 24] [--warmup 4] [--config FILE] [--set k=v]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import print_table

from kpo_core.config import RunSpec
from services.pipeline.actors import connect_ray
from services.pipeline.launch import execute_run
from services.pipeline.outputs import MetricsRecord, RunDirectory
from services.pipeline.specs import load_run_spec

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"


def measured(records: list[MetricsRecord], warmup: int) -> tuple[float, float]:
    """(trained tokens/s, seconds per step) over the steps after the first `warmup` (>= 1)."""
    if not 1 <= warmup < len(records):
        raise ValueError(f"need 1 <= warmup < steps, got warmup {warmup} of {len(records)}")
    window = records[warmup:]
    seconds = window[-1]["wall_seconds"] - records[warmup - 1]["wall_seconds"]
    tokens = sum(r["tokens_trained"] for r in window)
    return tokens / seconds, seconds / len(window)


def run_mode(base: RunSpec, mode: str, steps: int) -> list[MetricsRecord]:
    data = base.model_dump(mode="json")
    data["pipeline"].update(mode=mode, steps=steps, checkpoint_every=0)
    if mode == "sync":
        data["pipeline"]["max_staleness"] = 0
    spec = RunSpec.model_validate(data)
    with tempfile.TemporaryDirectory() as out:
        run_dir = RunDirectory(Path(out))
        state = execute_run(spec, run_dir)
        if state != "succeeded":
            raise RuntimeError(f"{mode} run ended {state}")
        return run_dir.read_metrics()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    base = load_run_spec(args.config, args.overrides)
    connect_ray(base)
    rows, rates = [], {}
    for mode in ("sync", "async"):
        records = run_mode(base, mode, args.steps)
        rate, per_step = measured(records, args.warmup)
        rates[mode] = rate
        staleness = sum(r["staleness_mean"] for r in records) / len(records)
        rows.append([mode, f"{rate:,.0f}", f"{per_step:.2f}", f"{staleness:.2f}"])
    ray.shutdown()
    print(f"{args.config.name}: {args.steps} steps per mode, first {args.warmup} left out")
    print_table(["mode", "trained tokens/s", "s/step", "mean staleness"], rows)
    print(f"async / sync throughput: {rates['async'] / rates['sync']:.2f}x")


if __name__ == "__main__":
    main()
