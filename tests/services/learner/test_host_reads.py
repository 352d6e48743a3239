"""A learner step waits on the device a fixed number of times, however many micro-batches it runs.

Counted with `HostReads` (every `item`/`tolist`/`bool`/`float` of a tensor, copy to the host
and data-dependent shape) around one `train_step`, on CPU: the same code on a GPU makes the same
reads, each of which would stall the host until the device has caught up.

The budget, `MAX_READS` = 3, for one optimiser step (one epoch, one minibatch), none of it
per micro-batch:
- the minibatch permutation, drawn on the CPU generator (`tolist`: it waits on no device);
- the optimiser step's decision, one read of [loss, valid tokens, had tokens, grad norm] (a
  non-finite loss or gradient skips AdamW, which only the host can decide without touching
  AdamW's moments), with the valid token count of each row it trained (the ratio
  diagnostics' shapes depend on them);
- every metric of the step, the ratio diagnostics' sums included, packed into one tensor at
  its end.
Each further optimiser step (minibatches, ppo_epochs) adds a permutation per epoch and a
decision per minibatch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.learner.batch import collate
from services.learner.host_reads import HostReads
from services.learner.micro_batches import plan_minibatch
from services.messages import ScoredGroup
from tests.services.learner.conftest import make_core

MAX_READS = 3


def budget_for(groups: list[ScoredGroup], passes: int) -> int:
    """The largest `micro_batch_tokens` under which one rank plans exactly `passes` passes."""
    batch = collate(groups, 0, 0)
    for budget in range(4096, 0, -1):
        plan = plan_minibatch(batch.prompt_lengths, batch.response_lengths, 1, budget)
        if len(plan[0]) == passes:
            return budget
    raise AssertionError(f"no budget gives {passes} micro-batches")


def count_reads(
    model_dir: Path, groups: list[ScoredGroup], budget: int, **options: Any
) -> tuple[HostReads, dict[str, float]]:
    core = make_core(model_dir, micro_batch_tokens=budget, **options)
    core.train_step(groups)  # builds the caches (gain tables) that every later step reuses
    with HostReads() as reads:
        metrics = core.train_step(groups)
    return reads, metrics


@pytest.mark.parametrize(
    "options",
    [
        {"estimator": "kalman"},
        {"estimator": "token"},
        {"estimator": "kalman", "reference": "proximal"},
    ],
    ids=["kalman", "token", "kalman-proximal"],
)
def test_host_reads_do_not_grow_with_micro_batches(
    tiny_model_dir: Path, groups: list[ScoredGroup], options: dict[str, str]
) -> None:
    one, one_metrics = count_reads(tiny_model_dir, groups, 0, **options)
    eight, eight_metrics = count_reads(tiny_model_dir, groups, budget_for(groups, 8), **options)
    assert one_metrics["micro_batches"] == 1.0 and eight_metrics["micro_batches"] == 8.0
    print(f"{options}: 1 micro-batch {dict(one.by_name)}, 8: {dict(eight.by_name)}")
    assert one.by_name == eight.by_name
    assert one.total <= MAX_READS, dict(one.by_name)
