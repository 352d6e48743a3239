"""Build the tiny warm-started arithmetic model: `python scripts/build_tiny_model.py --out DIR`.

The logic lives in `services.tasks.tiny_model`; this is only its command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

# Run from a checkout without installing the package: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.tasks import arith
from services.tasks.tiny_model import (
    DEFAULT_MODEL_DIR,
    BuildSettings,
    TinyModelBuildError,
    build_tiny_model,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; defaults reproduce the committed model."""
    defaults = BuildSettings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR, help="model directory")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, data and eval")
    parser.add_argument(
        "--difficulty", type=int, default=defaults.difficulty, choices=sorted(arith.LEVELS)
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=defaults.threads,
        help="torch threads (fixed for bit-identity)",
    )
    parser.add_argument("--max-steps", type=int, default=defaults.warm_start.max_steps)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Build, print a summary, and return the exit status."""
    args = parse_args(argv)
    defaults = BuildSettings()
    settings = dataclasses.replace(
        defaults,
        difficulty=args.difficulty,
        threads=args.threads,
        warm_start=dataclasses.replace(defaults.warm_start, max_steps=args.max_steps),
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
