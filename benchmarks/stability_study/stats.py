"""The study's two tests: a bootstrap interval of a mean over seeds, and Fisher's exact test."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

BOOTSTRAP_SAMPLES = 10_000
BOOTSTRAP_SEED = 0


def bootstrap_interval(
    values: Sequence[float], level: float = 0.95, samples: int = BOOTSTRAP_SAMPLES
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean: seeds resampled with replacement.

    With one value the interval is that value; the resampling is seeded, so a report is
    reproducible from the same runs.
    """
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        raise ValueError("a bootstrap interval needs at least one value")
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    means = data[rng.integers(0, data.size, size=(samples, data.size))].mean(1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided p of Fisher's exact test on the 2x2 table [[a, b], [c, d]].

    The sum of the probabilities of every table with the same margins that is no more likely
    than the observed one (the convention of R's fisher.test and scipy).
    """
    if min(a, b, c, d) < 0:
        raise ValueError(f"counts must be >= 0, got {[a, b, c, d]}")
    row, column, total = a + b, a + c, a + b + c + d

    def probability(x: int) -> float:
        return math.comb(row, x) * math.comb(total - row, column - x) / math.comb(total, column)

    observed = probability(a)
    low, high = max(0, column - (total - row)), min(row, column)
    # A relative tolerance, so that tables tied with the observed one in exact arithmetic count.
    p = sum(q for x in range(low, high + 1) if (q := probability(x)) <= observed * (1 + 1e-9))
    return min(1.0, p)
