"""`learner.pack_rows`: a step over packed rows is the step over padded rows, in fewer passes.

Packed micro-batches are planned by real tokens (padded ones by rows x the widest row), so the
same budget holds more rows; the loss is normalised by the whole minibatch either way, so the
update is the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.learner.packed_attention import PACKED_ATTENTION
from services.learner.sharding import attention_implementation, pack_rows
from services.messages import ScoredGroup
from services.spec import LearnerConfig
from tests.services.learner.conftest import make_core, sample_groups

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def uneven_groups(tiny_model_dir: Path) -> list[ScoredGroup]:
    """Long and very short responses in one batch: padding would be most of a padded pass."""
    return (
        sample_groups(tiny_model_dir, max_new_tokens=40, seed=5)[:2]
        + sample_groups(tiny_model_dir, max_new_tokens=2, seed=6)[:1]
    )


def test_packed_steps_equal_padded_steps_in_fewer_passes(
    tiny_model_dir: Path, uneven_groups: list[ScoredGroup]
) -> None:
    cores = {
        packed: make_core(tiny_model_dir, pack_rows=packed, micro_batch_tokens=96)
        for packed in (False, True)
    }
    assert cores[True].model.packed and not cores[False].model.packed
    records = {packed: core.train_step(uneven_groups) for packed, core in cores.items()}
    print({packed: record["micro_batches"] for packed, record in records.items()})
    assert records[True]["micro_batches"] < records[False]["micro_batches"]
    for key in ("policy_loss", "grad_norm", "clip_fraction", "approx_kl", "entropy"):
        assert records[True][key] == pytest.approx(records[False][key], abs=TOLERANCE), key
    padded_grads = {n: p.grad for n, p in cores[False].model.policy.named_parameters()}
    for name, weight in cores[True].model.policy.named_parameters():
        assert weight.grad is not None and padded_grads[name] is not None, name
        scale = max(1.0, float(padded_grads[name].abs().max()))
        error = float((weight.grad - padded_grads[name]).abs().max())
        assert error <= TOLERANCE * scale, (name, error)


def test_rows_are_packed_by_default_only_where_a_variable_length_kernel_runs_them() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not pack_rows(LearnerConfig(), cpu)
    assert pack_rows(LearnerConfig(pack_rows=True), cpu)
    bfloat16 = {"device": "cuda", "compute_dtype": "bfloat16"}
    assert pack_rows(LearnerConfig(**bfloat16), cuda)
    assert not pack_rows(LearnerConfig(pack_rows=False, **bfloat16), cuda)
    assert not pack_rows(LearnerConfig(device="cuda"), cuda)  # float32: varlen needs 16 bits
    assert not pack_rows(LearnerConfig(attn_implementation="eager", device="cuda"), cuda)
    assert pack_rows(LearnerConfig(attn_implementation="flash_attention_2"), cpu)
    assert attention_implementation(LearnerConfig(pack_rows=True), True) == PACKED_ATTENTION
    flash = LearnerConfig(attn_implementation="flash_attention_2")
    assert attention_implementation(flash, True) == "flash_attention_2"
    assert attention_implementation(LearnerConfig(), False) == "sdpa"
