"""Each estimator's policy loss, forward+backward, relative to `token` (GRPO) in the same run.

Usage: python benchmarks/bench_losses.py [--batch 64] [--length 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import best_seconds, print_table

from kpo_core.losses import policy_loss
from kpo_core.ratios import ESTIMATORS

VARIANTS: list[tuple[str, dict[str, object]]] = [
    ("token", {}),
    ("sequence", {}),
    ("geometric", {}),
    ("kalman", {}),
    ("kalman", {"clipped": False}),
    ("kalman", {"gradient": "through_filter"}),
    ("cumulative", {}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch default")
    args = parser.parse_args()
    if args.threads:
        # On a loaded machine one thread avoids waiting on descheduled sibling threads.
        torch.set_num_threads(args.threads)
    assert {name for name, _ in VARIANTS} == set(ESTIMATORS), "benchmark every estimator"
    torch.manual_seed(0)
    shape = (args.batch, args.length)
    logp = -1.0 + 0.3 * torch.randn(shape)
    ref_logp = logp + 0.05 * torch.randn(shape)
    advantages = torch.randn(args.batch)
    lengths = torch.randint(args.length // 2, args.length + 1, (args.batch,))
    mask = torch.arange(args.length)[None] < lengths[:, None]
    tokens = int(mask.sum())

    def run(name: str, options: dict[str, object]):
        def step() -> None:
            leaf = logp.clone().requires_grad_()
            loss, _ = policy_loss(name, leaf, ref_logp, advantages, mask, **options)  # type: ignore[arg-type]
            loss.backward()

        return step

    times = [
        (name, options, best_seconds(run(name, options), args.repeats))
        for name, options in VARIANTS
    ]
    baseline = times[0][2]
    rows = [
        [
            name + (f" {options}" if options else ""),
            f"{seconds * 1e3:.2f}",
            f"{tokens / seconds / 1e6:.1f}",
            f"{seconds / baseline:.2f}x",
        ]
        for name, options, seconds in times
    ]
    print(f"policy_loss forward+backward, B={args.batch}, T={args.length}, {tokens} valid tokens")
    print_table(["estimator", "ms", "Mtok/s", "time vs token"], rows)


if __name__ == "__main__":
    main()
