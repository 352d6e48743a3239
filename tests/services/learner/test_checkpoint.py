"""Checkpoints: a loadable model directory, and a resumed learner continues bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.generation.base import StateDictMismatchError
from services.generation.hf_backend import HFBackend
from services.learner.checkpoint import load_model_weights
from services.messages import ScoredGroup
from tests.services.learner.conftest import make_core

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


def test_a_checkpoint_is_a_loadable_model_directory(
    tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    core = make_core(tiny_model_dir)
    core.train_step(groups)
    path = core.save_checkpoint(tmp_path / "ckpt")
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert {"optimizer.pt", "scheduler.pt", "rng.pt", "learner.json"} <= names
    assert json.loads((path / "learner.json").read_text()) == {"version": 1, "steps": 1}
    loaded = AutoModelForCausalLM.from_pretrained(path)
    published = core.state_dict_for_publish()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, published[name]), name
    backend = HFBackend(path)  # a generation backend serves it as it is
    assert backend.tokenizer("1+2=")["input_ids"] == core.tokenizer("1+2=")["input_ids"]


def test_weights_of_another_model_are_refused_and_leave_the_model_untouched(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    core = make_core(tiny_model_dir)
    before = core.state_dict_for_publish()
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    other.model.norm = torch.nn.Identity()  # drops model.norm.weight from the state dict
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(StateDictMismatchError, match=r"model\.norm\.weight"):
        load_model_weights(tmp_path / "other", core.model)
    after = core.state_dict_for_publish()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_published_weights_are_detached_cpu_copies(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir)
    published = core.state_dict_for_publish()
    live = dict(core.model.named_parameters())
    assert published.keys() == core.model.state_dict().keys()
    for name, tensor in published.items():
        assert tensor.device.type == "cpu" and not tensor.requires_grad
        if name in live:
            assert tensor.data_ptr() != live[name].data_ptr()
            assert torch.equal(tensor, live[name].detach())
