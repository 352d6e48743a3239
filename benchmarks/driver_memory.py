"""Where a run's driver grows: its Python heap, traced allocation by allocation, against its RSS.

The soak (benchmarks/soak.py) measures the driver's resident memory from outside. This runs the
same demo with the driver in this very process, under `tracemalloc`, and at every --every learner
steps records the resident memory (VmRSS, less tracemalloc's own bookkeeping, which grows with
the number of live allocations it traces) and the memory Python has allocated and not freed. At
the end it prints both as MiB per 1,000 steps (least-squares slopes over the samples after the
warm-up) and the allocation sites whose live memory grew most between the first sample after the
warm-up and the last. When the traced heap grows as the RSS does, the top sites are the cause;
when it stays flat, the growth is in native memory (a library's buffers, freed memory the
allocator keeps), which no Python object holds. That is how the driver's own growth was found:
native, in steps of about 8 MiB at every checkpoint, when the curves were drawn (matplotlib)
in the driver itself; services/pipeline/curves.py now draws them in a child process.

tracemalloc slows every allocation (here about 1.3-2x the step time), so the figures are per
step, not per minute.

    python benchmarks/driver_memory.py [--steps 600] [--every 50] [--warmup 100] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from soak import read_rss_mib, slope

from services.observers import RunState
from services.pipeline.launch import execute_run
from services.pipeline.outputs import RunDirectory
from services.pipeline.specs import load_run_spec

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.yaml"
MIB = 1024 * 1024
TOP_SITES = 15
FRAMES = 8  # of each allocation's traceback, so that a site is told by its caller too


def own_rss_mib() -> float:
    rss = read_rss_mib(os.getpid())
    assert rss is not None  # this very process
    return rss


@dataclass(frozen=True)
class Sample:
    step: int
    rss_mib: float
    traced_mib: float
    tracemalloc_mib: float  # tracemalloc's own bookkeeping, part of the RSS, not of the heap

    @property
    def run_rss_mib(self) -> float:
        """The RSS less what tracing itself holds: what the driver would hold untraced."""
        return self.rss_mib - self.tracemalloc_mib


def per_1000_steps(samples: list[Sample], field: str) -> float:
    """The least-squares slope of `field` in MiB per 1,000 steps."""
    return 1000 * slope([(s.step, float(getattr(s, field))) for s in samples])


class MemoryProbe:
    """An observer of the run: samples memory at every `every` steps from `warmup` on, and
    snapshots the heap at the first sample and at step `last`. Only then: a snapshot is tens of
    MiB of Python objects, and taking one at every sample would grow the RSS it measures."""

    def __init__(self, every: int, warmup: int, last: int) -> None:
        self.every, self.warmup, self.last_step = every, warmup, last
        self.samples: list[Sample] = []
        self.first: tracemalloc.Snapshot | None = None
        self.last: tracemalloc.Snapshot | None = None

    def on_status(self, state: RunState, error: str | None = None, **details: Any) -> None:
        return None

    def on_metrics(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        if step < self.warmup or step % self.every:
            return
        traced, _ = tracemalloc.get_traced_memory()
        own = tracemalloc.get_tracemalloc_memory() / MIB
        self.samples.append(Sample(step, own_rss_mib(), traced / MIB, own))
        print(
            f"step {step}: RSS less tracing {self.samples[-1].run_rss_mib:.1f} MiB, Python heap "
            f"{self.samples[-1].traced_mib:.1f} MiB",
            flush=True,
        )
        if self.first is None or step == self.last_step:
            snapshot = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)]
            )
            if self.first is None:
                self.first = snapshot
            else:
                self.last = snapshot


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "driver-memory")
    args = parser.parse_args()
    overrides = [
        "name=driver-memory",
        f"pipeline.steps={args.steps}",
        # No checkpoint but the last: a checkpoint's own allocations are not what grows per step.
        f"pipeline.checkpoint_every={args.steps}",
    ]
    spec = load_run_spec(DEMO, overrides)
    probe = MemoryProbe(args.every, args.warmup, last=args.steps // args.every * args.every)
    tracemalloc.start(FRAMES)
    state = execute_run(spec, RunDirectory(args.out / "run"), [probe])
    if state != "succeeded" or probe.first is None or probe.last is None or len(probe.samples) < 3:
        print(f"the run ended {state} with {len(probe.samples)} samples", file=sys.stderr)
        return 1

    grown = probe.last.compare_to(probe.first, "traceback")
    steps = probe.samples[-1].step - probe.samples[0].step
    sites: list[dict[str, Any]] = []
    for stat in grown[:TOP_SITES]:
        sites.append(
            {
                "kib_per_1000_steps": stat.size_diff / 1024 * 1000 / steps,
                "blocks_grown": stat.count_diff,
                "traceback": [f"{frame.filename}:{frame.lineno}" for frame in stat.traceback],
            }
        )
    summary: dict[str, Any] = {
        "steps_sampled": [probe.samples[0].step, probe.samples[-1].step],
        "rss_mib_per_1000_steps": per_1000_steps(probe.samples, "run_rss_mib"),
        "python_heap_mib_per_1000_steps": per_1000_steps(probe.samples, "traced_mib"),
        "samples": [asdict(s) for s in probe.samples],
        "top_growing_sites": sites,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"\nsteps {probe.samples[0].step}-{probe.samples[-1].step}: RSS less tracing "
        f"{summary['rss_mib_per_1000_steps']:+.1f} MiB per 1,000 steps, Python heap "
        f"{summary['python_heap_mib_per_1000_steps']:+.1f} MiB per 1,000 steps"
    )
    print(f"the {TOP_SITES} allocation sites that grew most (KiB per 1,000 steps):")
    for site in sites:
        print(f"  {site['kib_per_1000_steps']:+9.1f}  {site['traceback'][-1]}")
        for frame in reversed(site["traceback"][:-1]):
            print(f"               {frame}")
    print(f"figures: {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
