"""Metrics records as the driver emits them, with the gaps and non-finite values real runs have."""

from __future__ import annotations

import math

from services.observers import MetricsRecord

START = 1_800_000_000.0  # the records' wall-clock `time`


def records() -> list[MetricsRecord]:
    """Three steps: step 2 has no entropy (None) and a NaN clip fraction; a list value (the
    durations of a histogram) and a bool come along as they may in a record."""
    return [
        {
            "step": step,
            "time": START + step,
            "reward_mean": 0.25 * step,
            "entropy": None if step == 2 else 1.5 / step,
            "clip_fraction": math.nan if step == 2 else 0.125 * step,
            "learner_restarts": 0,
            "generation_batch_seconds": [0.5, 0.25],
        }
        for step in (1, 2, 3)
    ]


# What each tracker must hold per key: step -> value (steps without the key left out).
EXPECTED_FINITE = {
    "reward_mean": {1: 0.25, 2: 0.5, 3: 0.75},
    "entropy": {1: 1.5, 3: 0.5},
    "clip_fraction": {1: 0.125, 3: 0.375},
    "learner_restarts": {1: 0.0, 2: 0.0, 3: 0.0},
}
