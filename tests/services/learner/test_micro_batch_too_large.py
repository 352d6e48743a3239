"""A micro-batch that runs out of device memory names the setting that makes the step fit.

On CPU, a forward pre-hook on the first decoder layer stands in for the device: it raises a
real `torch.OutOfMemoryError` whenever a forward carries more than a given number of tokens
(the hidden states' elements over the hidden size: rows x padded width). The learner turns it
into `MicroBatchTooLarge`, whose message gives a `learner.micro_batch_tokens` under which the
same step trains, or, for one row alone, the settings that shrink a row's memory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from services.learner.batch import collate
from services.learner.step import LearnerCore, MicroBatchTooLarge
from services.messages import ScoredGroup
from tests.services.learner.conftest import make_core
from tests.services.learner.test_step import parameters, same_parameters


def fits_in(core: LearnerCore, limit: int) -> list[int]:
    """Make every forward of `core` above `limit` tokens run out of memory; returns the token
    counts of the forwards that reached the first decoder layer (those that fit and those not)."""
    policy: Any = core.model.policy
    hidden_size = policy.config.hidden_size
    seen: list[int] = []

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        tokens = hidden.numel() // hidden_size
        seen.append(tokens)
        if tokens > limit:
            raise torch.OutOfMemoryError(f"{tokens} tokens do not fit in {limit}")

    layer: torch.nn.Module = policy.model.layers[0]
    layer.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.mark.parametrize("reference", ["behaviour", "proximal"])
def test_a_micro_batch_too_large_names_a_budget_that_trains(
    tiny_model_dir: Path, groups: list[ScoredGroup], reference: str
) -> None:
    batch = collate(groups, 0, 0)
    whole = batch.num_rows * (batch.prompt_width + batch.response_width)
    limit = whole // 2
    core = make_core(tiny_model_dir, reference=reference, micro_batch_tokens=0)
    fits_in(core, limit)
    before = parameters(core)
    with pytest.raises(MicroBatchTooLarge) as raised:
        core.train_step(groups)
    message = str(raised.value)
    assert "learner.micro_batch_tokens=0 (no limit)" in message, message
    assert f"{batch.num_rows} rows ({whole} tokens)" in message, message
    found = re.search(r"set learner\.micro_batch_tokens=(\d+)", message)
    assert found is not None, message
    budget = int(found.group(1))
    assert 0 < budget <= limit, (budget, limit)
    # Nothing was applied: the step failed before its optimiser step.
    assert core.version == 0 and same_parameters(core, before)

    retry = make_core(tiny_model_dir, reference=reference, micro_batch_tokens=budget)
    seen = fits_in(retry, limit)
    metrics = retry.train_step(groups)
    assert retry.version == 1 and not same_parameters(retry, before)
    assert metrics["micro_batches"] > 1.0 and metrics["skipped_minibatches"] == 0.0
    assert seen and max(seen) <= budget


def test_one_row_too_large_names_the_settings_that_shrink_a_row(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    # A budget under every row's length: each row is a micro-batch of its own.
    core = make_core(tiny_model_dir, micro_batch_tokens=1)
    fits_in(core, 0)
    with pytest.raises(MicroBatchTooLarge) as raised:
        core.train_step(groups)
    message = str(raised.value)
    assert "a micro-batch of one row" in message, message
    assert "learner.micro_batch_tokens=1" in message, message
    assert "learner.gradient_checkpointing=true" in message, message
    assert "learner.logprob_chunk_tokens" in message, message
    assert core.version == 0
