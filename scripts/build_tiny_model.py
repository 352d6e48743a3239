"""Build a tiny warm-started model: `python scripts/build_tiny_model.py [--task T] --out DIR`.

`--task arith` (the default) builds tiny-arith; `--task arith-tool` builds tiny-arith-tool, the
model that calls a Python tool. The logic lives in `services.tasks.tiny_model`; this is only its
command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

# Run from a checkout without installing the package: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.tasks import arith, arith_tool
from services.tasks.tiny_model import (
    DEFAULT_MODEL_DIR,
    TOOL_MODEL_DIR,
    TinyModelBuildError,
    build_tiny_model,
    default_settings,
)

# The tasks a tiny model is built for, and where each one's model is committed.
COMMITTED = {arith.TASK_NAME: DEFAULT_MODEL_DIR, arith_tool.TASK_NAME: TOOL_MODEL_DIR}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; defaults (per task) reproduce the committed model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default=arith.TASK_NAME, choices=sorted(COMMITTED))
    parser.add_argument(
        "--out", type=Path, default=None, help="model directory (default: the committed one)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, data and eval")
    parser.add_argument(
        "--difficulty",
        type=int,
        default=None,
        choices=sorted(arith.LEVELS),
        help="of the eval prompts (default: the task's)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (fixed for bit-identity)"
    )
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = COMMITTED[args.task]
    return args


def main(argv: list[str] | None = None) -> int:
    """Build, print a summary, and return the exit status."""
    args = parse_args(argv)
    defaults = default_settings(args.task)
    settings = dataclasses.replace(
        defaults,
        difficulty=defaults.difficulty if args.difficulty is None else args.difficulty,
        threads=defaults.threads if args.threads is None else args.threads,
        warm_start=dataclasses.replace(
            defaults.warm_start,
            max_steps=(defaults.warm_start.max_steps if args.max_steps is None else args.max_steps),
        ),
    )
    started = time.perf_counter()
    try:
        info = build_tiny_model(
            args.out, seed=args.seed, settings=settings, progress=not args.quiet
        )
    except TinyModelBuildError as err:
        print(f"build failed: {err}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(
        f"built {args.out}: {info.parameters} parameters, {size / 1e6:.2f} MB, "
        f"{info.steps} steps, sampled accuracy {info.eval_accuracy:.3f}, "
        f"{info.build_seconds:.1f} s in the builder, {time.perf_counter() - started:.1f} s total"
    )
    for key, value in info.eval_details.items():
        print(f"  {key}: {value:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
