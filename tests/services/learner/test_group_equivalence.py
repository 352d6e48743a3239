"""An FSDP2 learner of 2 ranks and micro-batched steps against the plain single learner.

Real torch.distributed (gloo, 2 forked processes), the random tiny model, float32. Sharding,
micro-batching and the global loss normalisation change only the summation order, so the
results agree to float32 rounding (measured: about 1e-7 relative); 1e-5 is the bar.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kpo_core.config import LOSS_AGG_MODES
from services.learner.batch import collate
from services.learner.distributed import RankGroup
from services.learner.micro_batches import pack
from services.messages import ScoredGroup
from tests.services.learner.conftest import make_core
from tests.services.learner.ranks import run_ranks

RTOL = 1e-5
OPTIMISER_STEPS = 4  # the most any test here takes: 2 learner steps of 2 minibatches
# To RTOL: what the issue of sharding names; the ratio statistics of the second step also
# carry the first step's AdamW round-off (see assert_same_parameters), so they get 1e-4.
COMPARED = {"policy_loss": RTOL, "grad_norm": RTOL, "entropy": RTOL}
COMPARED_LOOSELY = {"clip_fraction": 1e-4, "ratio_mean": 1e-4, "approx_kl": 1e-4}


def assert_same_step(actual: dict[str, Any], expected: dict[str, Any], lr: float) -> None:
    for key, tolerance in {**COMPARED, **COMPARED_LOOSELY}.items():
        # The policy loss is a mean of terms -A rho of order 1 (advantages are normalised) that
        # cancel to ~1e-5: it is compared to 1e-5 of its terms' scale.
        margin = RTOL if key == "policy_loss" else 0.0
        value = pytest.approx(expected["metrics"][key], rel=tolerance, abs=margin)
        assert actual["metrics"][key] == value, key
    assert actual["weights"].keys() == expected["weights"].keys()
    assert_same_parameters(actual["weights"], expected["weights"], lr)


def assert_same_parameters(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], lr: float
) -> None:
    """Equal to 1e-5 of each tensor's scale, but for round-off that AdamW amplified.

    AdamW's first steps move each element by about lr * sign(gradient): an element whose
    gradient is at round-off level (k_proj biases have a zero gradient in exact arithmetic: the
    softmax ignores q.b) can step either way under another summation order. Such elements may
    differ by up to 2 lr per optimiser step; they must stay rare: at most 0.2% of the model.
    """
    off = total = 0
    for name, tensor in expected.items():
        scale = float(tensor.float().pow(2).mean().sqrt())
        difference = (actual[name] - tensor).abs()
        assert float(difference.max()) <= 2 * lr * OPTIMISER_STEPS, name
        off += int((difference > RTOL * (scale + tensor.abs())).sum())
        total += tensor.numel()
    assert off <= 0.002 * total, f"{off} of {total} parameters differ"


def two_steps(
    group: RankGroup | None, model_dir: Path, groups: list[ScoredGroup], settings: dict[str, Any]
) -> dict[str, Any]:
    """Two steps on the same batch from the weights on disk: the second step's metrics and the
    weights after it (rank 0's). The second step is the telling one: one version stale, its
    ratios are not 1 and its loss is not the ~0 of -mean(A) on-policy."""
    core = make_core(model_dir, group=group, **settings)
    core.train_step(groups)
    metrics = core.train_step(groups)
    return {"metrics": metrics, "weights": core.state_dict_for_publish()}


@pytest.mark.parametrize("reference", ["behaviour", "proximal"])
@pytest.mark.parametrize("world_size", [2, 1])
def test_fsdp2_ranks_equal_the_single_learner(
    tiny_model_dir: Path, groups: list[ScoredGroup], reference: str, world_size: int
) -> None:
    # Two minibatches: two optimiser steps per learner step.
    settings = {"reference": reference, "minibatches": 2, "weight_decay": 0.01}
    single = two_steps(None, tiny_model_dir, groups, settings)
    ranks = run_ranks(two_steps, world_size, tiny_model_dir, groups, settings)
    assert all(rank["weights"] == {} for rank in ranks[1:])  # rank 0 publishes
    assert ranks[0]["metrics"]["learner_world_size"] == float(world_size)
    assert_same_step(ranks[0], single, 1e-3)
    # The record holds the same keys as a single learner's.
    assert ranks[0]["metrics"].keys() == single["metrics"].keys()


def budget_for(batch_rows: list[tuple[int, int]], parts: int) -> int:
    """The smallest token budget that packs the rows into exactly `parts` micro-batches."""
    prompts, responses = zip(*batch_rows, strict=True)
    rows = range(len(batch_rows))
    for budget in range(1, 100_000):
        if len(pack(rows, prompts, responses, budget)) <= parts:
            assert len(pack(rows, prompts, responses, budget)) == parts
            return budget
    raise AssertionError(f"no budget gives {parts} micro-batches")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_give_the_parameters_of_the_whole_minibatch(
    tiny_model_dir: Path, groups: list[ScoredGroup], mode: str
) -> None:
    batch = collate(groups, 0, 0)
    width_p = batch.prompt_width
    real = batch.attention_mask.bool()
    rows = list(
        zip(real[:, :width_p].sum(-1).tolist(), real[:, width_p:].sum(-1).tolist(), strict=True)
    )
    settings: dict[str, Any] = {"algorithm": {"loss_agg_mode": mode}}
    whole = two_steps(None, tiny_model_dir, groups, settings)
    assert whole["metrics"]["micro_batches"] == 1.0
    for parts in (2, 5):
        budget = budget_for(rows, parts)
        split = two_steps(None, tiny_model_dir, groups, {**settings, "micro_batch_tokens": budget})
        assert split["metrics"]["micro_batches"] == float(parts)
        assert_same_step(split, whole, 1e-3)


def test_two_ranks_with_micro_batches_equal_the_single_learner(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    """Each rank packs its share under the budget; the ranks run equally many passes."""
    settings: dict[str, Any] = {"micro_batch_tokens": 40, "estimator": "token"}
    single = two_steps(None, tiny_model_dir, groups, {"estimator": "token"})
    ranks = run_ranks(two_steps, 2, tiny_model_dir, groups, settings)
    assert ranks[0]["metrics"]["micro_batches"] > 1.0
    assert_same_step(ranks[0], single, 1e-3)


def test_activation_checkpointing_changes_memory_not_the_step(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    plain = two_steps(None, tiny_model_dir, groups, {})
    recomputed = two_steps(None, tiny_model_dir, groups, {"gradient_checkpointing": True})
    assert_same_step(recomputed, plain, 1e-3)
    sharded = run_ranks(two_steps, 2, tiny_model_dir, groups, {"gradient_checkpointing": True})
    assert_same_step(sharded[0], plain, 1e-3)


def bfloat16_step(
    group: RankGroup | None, model_dir: Path, groups: list[ScoredGroup]
) -> dict[str, Any]:
    core = make_core(model_dir, group=group, compute_dtype="bfloat16")
    before = {n: p.detach().clone() for n, p in core.model.named_parameters()}
    metrics = core.train_step(groups)
    masters = dict(core.model.named_parameters())
    return {
        "metrics": metrics,
        "master_dtypes": {p.dtype for p in masters.values()},
        # An update far below bfloat16's resolution at 1: kept only by float32 masters.
        "moved": sum(int((p.detach() != before[n]).sum()) for n, p in masters.items()),
        "published": core.state_dict_for_publish(),
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_bfloat16_compute_keeps_float32_masters_and_publishes_bfloat16(
    tiny_model_dir: Path, groups: list[ScoredGroup], world_size: int
) -> None:
    if world_size == 1:
        result = bfloat16_step(None, tiny_model_dir, groups)
    else:
        result = run_ranks(bfloat16_step, world_size, tiny_model_dir, groups)[0]
    assert result["master_dtypes"] == {torch.float32}
    assert result["moved"] > 0 and result["metrics"]["grad_norm"] > 0
    published = result["published"]
    assert published and {t.dtype for t in published.values()} == {torch.bfloat16}
    # The bfloat16 forward agrees with the float32 one to bfloat16 precision.
    reference = two_steps(None, tiny_model_dir, groups, {})
    assert result["metrics"]["entropy"] == pytest.approx(reference["metrics"]["entropy"], rel=0.05)
