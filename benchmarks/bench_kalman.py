"""Kalman filter on CPU: parallel vs the official closed form, forward and forward+backward.

B=64, T=4096, float32, Q/R = 1e-6. Every figure is relative to baselines measured in the same
run, interleaved round by round (the best time of each is kept): the paper's official closed
form (`method="closed_form"`, autograd through it for the backward), the sequential recursion,
and one elementwise pass (`exp` forward+backward) over the same tensor.

The mask gives each row a random valid length, right-padded (`--mask lengths`, the common case,
which takes the parallel method's prefix path); `--mask holes` instead drops random tokens from
the last quarter (interior holes: the general path). Threads default to 2, the setting the
closed-form comparison is quoted at; `--threads 0` keeps torch's default.

Last, one right-padded batch of `--accuracy-length` tokens (float32) is filtered by the parallel
method and the closed form, and their largest error against the float64 recursion is printed.

Usage: python benchmarks/bench_kalman.py [--batch 64] [--length 4096] [--repeats 20]
    [--rounds 5] [--threads 2] [--mask lengths|holes] [--q 1e-6] [--accuracy-length 131072]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import best_seconds, print_table

from kpo_core.kalman import FilterMethod, kalman_filter

FORWARD, BOTH = "forward", "forward+backward"


def make_mask(kind: str, batch: int, length: int) -> torch.Tensor:
    if kind == "lengths":  # each row a random valid length, padded on the right
        lengths = torch.randint(1, length + 1, (batch,))
        return torch.arange(length) < lengths[:, None]
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[:, -length // 4 :] = torch.rand(batch, length // 4) > 0.5
    return mask


def recursion_error(length: int, q: float) -> dict[str, float]:
    """Largest |x - reference| of each method on two right-padded rows of `length` tokens."""
    z = 0.5 * torch.randn(2, length, generator=torch.Generator().manual_seed(7))
    lengths = [length, length - length // 4]
    mask = torch.arange(length) < torch.tensor(lengths)[:, None]
    reference = torch.empty(2, length, dtype=torch.float64)
    for row, valid in enumerate(lengths):  # the textbook recursion in Python floats
        x, p, out = 0.0, 0.0, []
        for zt in z[row, :valid].double().tolist():
            p_prior = p + q
            k = p_prior / (p_prior + 1.0)
            x, p = x + k * (zt - x), (1.0 - k) * p_prior
            out.append(x)
        reference[row] = torch.tensor(out + [x] * (length - valid), dtype=torch.float64)
    errors: dict[str, float] = {}
    methods: tuple[FilterMethod, ...] = ("parallel", "closed_form")
    for method in methods:
        filtered = kalman_filter(z, mask, q, 1.0, method=method).double()
        errors[method] = (filtered - reference)[mask].abs().max().item()
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; best kept")
    parser.add_argument("--threads", type=int, default=2, help="torch threads; 0 = torch default")
    parser.add_argument("--mask", choices=["lengths", "holes"], default="lengths")
    parser.add_argument("--q", type=float, default=1e-6, help="Q/R (R = 1)")
    parser.add_argument("--accuracy-length", type=int, default=131_072, help="0 skips it")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = (args.batch, args.length)
    z = 0.1 * torch.randn(shape)
    mask = make_mask(args.mask, *shape)
    upstream = torch.randn(shape)
    tokens = args.batch * args.length

    def forward(method: FilterMethod) -> Callable[[], object]:
        return lambda: kalman_filter(z, mask, args.q, 1.0, method=method)

    def forward_backward(method: FilterMethod) -> Callable[[], object]:
        def run() -> None:
            zg = z.clone().requires_grad_()
            x = kalman_filter(zg, mask, args.q, 1.0, method=method)
            (x * upstream).sum().backward()  # type: ignore[no-untyped-call]

        return run

    def exp_forward_backward() -> None:
        zg = z.clone().requires_grad_()
        (zg.exp() * upstream).sum().backward()  # type: ignore[no-untyped-call]

    cases: dict[tuple[str, str], Callable[[], object]] = {}
    methods: tuple[FilterMethod, ...] = ("parallel", "closed_form", "sequential")
    for method in methods:
        cases[(method, FORWARD)] = forward(method)
        cases[(method, BOTH)] = forward_backward(method)
    cases[("exp (elementwise)", BOTH)] = exp_forward_backward
    times = dict.fromkeys(cases, float("inf"))
    for round_ in range(args.rounds):
        for case, fn in cases.items():
            if case[0] != "sequential":
                times[case] = min(times[case], best_seconds(fn, args.repeats))
            elif round_ == 0:  # the recursion is slow: one call, in the first round only
                times[case] = best_seconds(fn, 1, warmup=0)

    elementwise = times[("exp (elementwise)", BOTH)]
    rows = []
    for (name, phase), seconds in times.items():
        closed = times[("closed_form", phase)]
        sequential = times[("sequential", phase)]
        rows.append(
            [
                name,
                phase,
                f"{seconds * 1e3:.2f}",
                f"{tokens / seconds / 1e6:.1f}",
                f"{seconds / closed:.2f}x",
                f"{sequential / seconds:.1f}x",
                f"{seconds / elementwise:.1f}x" if phase == BOTH else "-",
            ]
        )
    threads = torch.get_num_threads()
    print(
        f"Kalman filter, B={args.batch}, T={args.length}, float32, Q/R={args.q:g}, "
        f"mask={args.mask}, {threads} threads, best of {args.rounds} x {args.repeats}"
    )
    headers = [
        "method",
        "phase",
        "ms",
        "Mtok/s",
        "time vs closed form",
        "speed-up vs sequential",
        "time vs exp f+b",
    ]
    print_table(headers, rows)
    ratios = [
        f"{phase} {times[('parallel', phase)] / times[('closed_form', phase)]:.2f}x"
        for phase in (FORWARD, BOTH)
    ]
    print(f"parallel / closed form: {', '.join(ratios)}")
    if args.accuracy_length:
        errors = recursion_error(args.accuracy_length, args.q)
        print(
            f"max |x - float64 recursion| at {args.accuracy_length:,} tokens (float32, "
            f"right-padded): parallel {errors['parallel']:.1e}, "
            f"closed form {errors['closed_form']:.1e}"
        )


if __name__ == "__main__":
    main()
