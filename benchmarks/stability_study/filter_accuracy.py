"""Our exact parallel filter vs the paper's official closed form on long sequences.

The inputs are real recorded log-ratios, concatenated and tiled to each length. The reference is
the sequential recursion in float64; both contenders take float32 input as in training.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kpo_core.kalman import kalman_filter
from stability_study.dynamics import RatioSample

LENGTHS = (4096, 16384, 65536, 131072)
Q_VALUES = (1e-6, 1e-4)
ROWS = 2


@dataclass(frozen=True)
class FilterComparison:
    length: int
    q: float
    parallel_error: float  # max |x - reference| over every token
    closed_form_error: float
    parallel_seconds: float
    closed_form_seconds: float


def long_sequences(sample: RatioSample, length: int, rows: int = ROWS) -> Tensor:
    """[rows, length] float32 of the sample's valid log-ratios, concatenated and tiled, each row
    starting at a different offset."""
    stream = sample.log_ratio[sample.mask]
    if stream.numel() == 0:
        raise ValueError("the ratio sample has no valid tokens")
    repeats = -(-(length * rows) // stream.numel()) + 1
    tiled = stream.repeat(repeats)
    return torch.stack([tiled[r * length : (r + 1) * length] for r in range(rows)]).float()


def _best_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def compare(
    sample: RatioSample, lengths: Sequence[int] = LENGTHS, q_values: Sequence[float] = Q_VALUES
) -> list[FilterComparison]:
    rows = []
    for length in lengths:
        z = long_sequences(sample, length)
        mask = torch.ones_like(z, dtype=torch.bool)
        for q in q_values:
            reference = kalman_filter(z.double(), mask, q, 1.0, method="sequential")

            def parallel(z: Tensor = z, mask: Tensor = mask, q: float = q) -> Tensor:
                return kalman_filter(z, mask, q, 1.0)

            def closed(z: Tensor = z, mask: Tensor = mask, q: float = q) -> Tensor:
                return kalman_filter(z, mask, q, 1.0, method="closed_form")

            rows.append(
                FilterComparison(
                    length=length,
                    q=q,
                    parallel_error=float((parallel().double() - reference).abs().max()),
                    closed_form_error=float((closed().double() - reference).abs().max()),
                    parallel_seconds=_best_seconds(parallel),
                    closed_form_seconds=_best_seconds(closed),
                )
            )
    return rows
