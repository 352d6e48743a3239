"""Shared timing helpers for the benchmarks: best-of-N wall time of a callable."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Minimum wall time over `repeats` calls: the least disturbed by other processes."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
