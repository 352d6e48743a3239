"""Checkpoints: sharded state that resumes on any number of ranks, bit for bit on the same one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from services.generation.hf_backend import HFBackend
from services.learner.checkpoint import (
    HF_DIR,
    LEARNER_STATE,
    RNG_DIR,
    STATE_DIR,
    CheckpointMismatchError,
    read_learner_state,
)
from services.learner.distributed import RankGroup
from services.learner.export import export_model
from services.messages import ScoredGroup
from tests.services.learner.conftest import make_core
from tests.services.learner.ranks import run_ranks

# Two minibatches (the permutation comes from the learner's generator), warm-up (the schedule's
# position matters) and weight decay: every piece of state shows up in the next step.
SETTINGS: dict[str, Any] = {"minibatches": 2, "warmup_steps": 3, "weight_decay": 0.01}


def test_a_resumed_learner_continues_exactly_like_the_original(
    tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    original = make_core(tiny_model_dir, **SETTINGS)
    original.train_step(groups)
    original.save_checkpoint(tmp_path / "ckpt")
    # A different seed: the permutations may only match if the generator state is restored.
    resumed = make_core(tiny_model_dir, seed=99, **SETTINGS)
    assert resumed.load_checkpoint(tmp_path / "ckpt") == 1 and resumed.version == 1

    expected = original.train_step(groups)
    actual = resumed.train_step(groups)
    assert actual == expected  # bitwise: same floats in the same order
    for (name, a), b in zip(
        original.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    assert resumed.version == original.version == 2


def test_a_resumed_learner_trains_at_its_own_rate_from_the_checkpoints_schedule(
    tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    # A rollback's remedy (or a resume's patch) changes learner.lr: the schedule's position
    # comes from the checkpoint, its base rate from the learner's own settings.
    original = make_core(tiny_model_dir, **SETTINGS)
    original.train_step(groups)
    original.save_checkpoint(tmp_path / "ckpt")
    resumed = make_core(tiny_model_dir, **{**SETTINGS, "lr": 2.5e-4})
    resumed.load_checkpoint(tmp_path / "ckpt")
    # Warm-up of 3 steps, one taken: both at 2/3 of their base rate.
    assert original.scheduler.get_last_lr() == pytest.approx([1e-3 * 2 / 3])
    assert resumed.scheduler.get_last_lr() == pytest.approx([2.5e-4 * 2 / 3])
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-4 * 2 / 3)
    expected = original.train_step(groups)["lr"]
    assert resumed.train_step(groups)["lr"] == pytest.approx(expected / 4)
    assert resumed.scheduler.get_last_lr() == pytest.approx([2.5e-4])  # warm-up over


def test_a_checkpoint_holds_sharded_state_and_what_an_export_needs(
    tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    core = make_core(tiny_model_dir)
    core.train_step(groups)
    path = core.save_checkpoint(tmp_path / "ckpt")
    assert {p.name for p in path.iterdir()} == {HF_DIR, STATE_DIR, RNG_DIR, LEARNER_STATE}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in (path / HF_DIR).iterdir()
    }
    assert (path / STATE_DIR / ".metadata").is_file()
    assert json.loads((path / LEARNER_STATE).read_text()) == {
        "version": 1,
        "steps": 1,
        "world_size": 1,
        "compute_dtype": "float32",
    }
    exported = AutoModelForCausalLM.from_pretrained(export_model(path, tmp_path / "model"))
    published = core.state_dict_for_publish()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, published[name]), name
    backend = HFBackend(tmp_path / "model")  # a generation backend serves the export as it is
    assert backend.tokenizer("1+2=")["input_ids"] == core.tokenizer("1+2=")["input_ids"]


def test_a_checkpoint_of_another_model_is_refused(
    tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    core = make_core(tiny_model_dir)
    core.save_checkpoint(tmp_path / "ckpt")
    config = AutoConfig.from_pretrained(
        tiny_model_dir, num_hidden_layers=1, layer_types=["full_attention"]
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "other")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "other")
    shallower = make_core(tmp_path / "other")
    with pytest.raises(CheckpointMismatchError, match=r"unexpected \['model\.layers\.1\."):
        shallower.load_checkpoint(tmp_path / "ckpt")


def continue_from(
    group: RankGroup | None, model_dir: Path, groups: list[ScoredGroup], checkpoint: Path | None
) -> dict[str, Any]:
    """Resume from `checkpoint` (or train the first step and save it there): the version after
    one more step, its metrics and the weights (rank 0's)."""
    core = make_core(model_dir, group=group, **SETTINGS)
    if checkpoint is None or not checkpoint.exists():
        core.train_step(groups)
        assert checkpoint is not None
        core.save_checkpoint(checkpoint)
    else:
        assert core.load_checkpoint(checkpoint) == 1
    metrics = core.train_step(groups)
    return {"version": core.version, "metrics": metrics, "weights": core.state_dict_for_publish()}


def test_a_checkpoint_of_two_ranks_resumes_on_one_and_on_two(
    tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    written = run_ranks(continue_from, 2, tiny_model_dir, groups, path)[0]
    assert read_learner_state(path).world_size == 2
    assert len(list((path / STATE_DIR).glob("*.distcp"))) == 2  # one file per rank
    on_one = continue_from(None, tiny_model_dir, groups, path)
    on_two = run_ranks(continue_from, 2, tiny_model_dir, groups, path)[0]
    for resumed in (on_one, on_two):
        assert resumed["version"] == written["version"] == 2
        assert resumed["metrics"]["lr"] == written["metrics"]["lr"]  # the schedule's position
        assert resumed["metrics"]["grad_norm"] == pytest.approx(
            written["metrics"]["grad_norm"], rel=1e-5
        )
        for name, tensor in written["weights"].items():
            torch.testing.assert_close(resumed["weights"][name], tensor, rtol=1e-5, atol=1e-6)


def test_published_weights_are_detached_cpu_copies(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir)
    published = core.state_dict_for_publish()
    live = dict(core.model.policy.named_parameters())
    assert published.keys() == core.model.policy.state_dict().keys()
    for name, tensor in published.items():
        assert tensor.device.type == "cpu" and not tensor.requires_grad
        if name in live:
            assert tensor.data_ptr() != live[name].data_ptr()
            assert torch.equal(tensor, live[name].detach())
