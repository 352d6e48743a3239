"""`learner.pack_rows`: a step over packed rows is the step over padded rows, in fewer passes.

Packed micro-batches are planned by real tokens (padded ones by rows x the widest row), so the
same budget holds more rows; the loss is normalised by the whole minibatch either way, so the
update is the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.learner import sharding
from services.learner.packed_attention import LEARNER_ATTENTION, varlen_takes_window
from services.learner.sharding import attention_implementation, pack_rows
from services.messages import ScoredGroup
from services.model_layout import ModelLayout
from services.spec import LearnerConfig
from tests.services.generation.tiny_model import build_tokenizer
from tests.services.learner.conftest import make_core, sample_groups
from tests.services.model_families import FAMILIES, family_ids

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


def layout(family: str) -> ModelLayout:
    """The layout of a family's config, as `build_policy` reads it (no model is built)."""
    tokenizer = build_tokenizer()
    return ModelLayout.of(FAMILIES[family].config(len(tokenizer), family_ids(tokenizer)))


@pytest.fixture
def varlen_runs_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict of a probe that ran torch's varlen kernel on the GPU: the probe needs one,
    which this machine may lack (test_varlen_signature.py tests the probe's own decision)."""
    monkeypatch.setattr(sharding, "varlen_problem", lambda device: None)


@pytest.mark.usefixtures("varlen_runs_on_cuda")
def test_rows_are_packed_by_default_only_where_a_variable_length_kernel_runs_them() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    llama = layout("llama")
    assert not pack_rows(LearnerConfig(), cpu, llama)
    assert pack_rows(LearnerConfig(pack_rows=True), cpu, llama)
    bfloat16 = {"device": "cuda", "compute_dtype": "bfloat16"}
    assert pack_rows(LearnerConfig(**bfloat16), cuda, llama)
    assert not pack_rows(LearnerConfig(pack_rows=False, **bfloat16), cuda, llama)
    assert not pack_rows(LearnerConfig(device="cuda"), cuda, llama)  # float32: varlen needs 16 bits
    assert not pack_rows(LearnerConfig(attn_implementation="eager", device="cuda"), cuda, llama)
    assert pack_rows(LearnerConfig(attn_implementation="flash_attention_2"), cpu, llama)
    assert attention_implementation(LearnerConfig(pack_rows=True), True, llama) == LEARNER_ATTENTION
    flash = LearnerConfig(attn_implementation="flash_attention_2")
    assert attention_implementation(flash, True, llama) == "flash_attention_2"
    # Padded under SDPA, through the learner's attention too: it builds no mask of its own.
    assert attention_implementation(LearnerConfig(), False, llama) == LEARNER_ATTENTION
    eager = LearnerConfig(attn_implementation="eager")
    assert attention_implementation(eager, False, llama) == "eager"


@pytest.mark.usefixtures("varlen_runs_on_cuda")
def test_packing_follows_what_the_family_s_layout_allows() -> None:
    """A window packs on CUDA only where torch's varlen kernel takes one; soft-capped
    attention (Gemma 2) and chunks (Llama 4) pack per row on CPU, not on CUDA; sinks (gpt-oss)
    never. `auto` quietly pads; an explicit `pack_rows: true` is refused, saying why."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    bfloat16 = LearnerConfig(device="cuda", compute_dtype="bfloat16")
    packed = LearnerConfig(pack_rows=True, device="cuda", compute_dtype="bfloat16")
    assert pack_rows(bfloat16, cuda, layout("mistral-window")) == varlen_takes_window()
    for family, reason in (
        ("gemma2", "soft-capped"),
        ("llama4", "chunked"),
        ("gpt-oss", "sinks"),
    ):
        assert not pack_rows(bfloat16, cuda, layout(family)), family
        with pytest.raises(ValueError, match=f"learner.pack_rows: .* cannot be packed: .*{reason}"):
            pack_rows(packed, cuda, layout(family))
    assert pack_rows(LearnerConfig(pack_rows=True), cpu, layout("gemma2"))
    assert pack_rows(LearnerConfig(pack_rows=True), cpu, layout("llama4"))
    with pytest.raises(ValueError, match="sinks"):
        pack_rows(LearnerConfig(pack_rows=True), cpu, layout("gpt-oss"))
    # Gemma 2 does not run under SDPA: padded, it is loaded eager, as transformers would.
    assert attention_implementation(LearnerConfig(), False, layout("gemma2")) == "eager"
    assert attention_implementation(LearnerConfig(), False, layout("gemma3")) == LEARNER_ATTENTION
