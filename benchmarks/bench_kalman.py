"""Parallel vs sequential Kalman filter on CPU: forward and forward+backward, B=64, T=4096.

Every figure is relative to a baseline measured in the same run: the sequential recursion, and
one elementwise pass (`exp` forward+backward) over the same tensor.
Usage: python benchmarks/bench_kalman.py [--batch 64] [--length 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import best_seconds, print_table

from kpo_core.kalman import kalman_filter


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
    torch.manual_seed(0)
    shape = (args.batch, args.length)
    z = 0.1 * torch.randn(shape)
    mask = torch.ones(shape, dtype=torch.bool)
    mask[:, -args.length // 4 :] = torch.rand(args.batch, args.length // 4) > 0.5
    upstream = torch.randn(shape)
    tokens = args.batch * args.length

    def forward(method: str):
        return lambda: kalman_filter(z, mask, 1e-6, 1.0, method=method)

    def forward_backward(method: str):
        def run() -> None:
            zg = z.clone().requires_grad_()
            (kalman_filter(zg, mask, 1e-6, 1.0, method=method) * upstream).sum().backward()

        return run

    def exp_forward_backward() -> None:
        zg = z.clone().requires_grad_()
        (zg.exp() * upstream).sum().backward()

    slow = max(1, args.repeats // 3)
    times = {
        ("parallel", "forward"): best_seconds(forward("parallel"), args.repeats),
        ("sequential", "forward"): best_seconds(forward("sequential"), slow),
        ("parallel", "forward+backward"): best_seconds(forward_backward("parallel"), args.repeats),
        ("sequential", "forward+backward"): best_seconds(forward_backward("sequential"), slow),
        ("exp (elementwise)", "forward+backward"): best_seconds(exp_forward_backward, args.repeats),
    }
    elementwise = times[("exp (elementwise)", "forward+backward")]
    rows = []
    for (method, phase), seconds in times.items():
        sequential = times[("sequential", phase)]
        rows.append(
            [
                method,
                phase,
                f"{seconds * 1e3:.2f}",
                f"{tokens / seconds / 1e6:.1f}",
                f"{sequential / seconds:.1f}x",
                f"{seconds / elementwise:.1f}x" if phase == "forward+backward" else "-",
            ]
        )
    threads = torch.get_num_threads()
    print(f"Kalman filter, B={args.batch}, T={args.length}, float32, {threads} threads")
    headers = ["method", "phase", "ms", "Mtok/s", "speed-up vs sequential", "time vs exp f+b"]
    print_table(headers, rows)


if __name__ == "__main__":
    main()
