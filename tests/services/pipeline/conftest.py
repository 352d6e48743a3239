"""Fixtures of the pipeline's integration tests: one local Ray instance, small run specs."""

from __future__ import annotations

import os
from typing import Any

from services.pipeline.specs import apply_overrides
from services.spec import RunSpec

# Small enough for about a second per step on 2 cores. Difficulty 3 is the one the tiny model was
# warm-started on (it gets a quarter of it right, and next to nothing of the others).
TINY_RUN: dict[str, Any] = {
    "name": "tiny",
    "seed": 0,
    "model": "tiny-arith",
    "task": {"name": "arith", "difficulty": 3},
    "generation": {"prompts_per_batch": 4, "group_size": 4, "max_new_tokens": 80},
    "reward": {"num_cpus": 0},
    "learner": {"lr": 5e-4},
    "pipeline": {"batch_groups": 4, "steps": 4, "checkpoint_every": 2},
}


def tiny_spec(*overrides: str) -> RunSpec:
    """TINY_RUN with `key=value` overrides, validated."""
    return RunSpec.model_validate(apply_overrides(TINY_RUN, overrides))


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
