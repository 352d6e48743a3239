"""LoRA in the learner: adapters alone train and are checkpointed, generation gets merged
weights under the base model's names, and the export writes the merged model and the adapter."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from pydantic import ValidationError
from torch.distributed.checkpoint.filesystem import FileSystemReader
from transformers import AutoModelForCausalLM

from kpo_core.config import describe_validation_error
from services.learner.checkpoint import MODEL_KEY, STATE_DIR
from services.learner.export import export_model
from services.learner.lora import ADAPTER_CONFIG, ADAPTER_DIR, adapter_parameters
from services.learner.step import LearnerCore
from services.messages import ScoredGroup
from services.spec import RunSpec
from services.tasks.models import resolve_model
from services.weights.loading import load_buckets_into
from tests.services.learner.conftest import make_core

LORA: dict[str, Any] = {"rank": 4, "alpha": 8.0}
# A rate at which three steps visibly move the adapters (LoRA usually wants more than full
# fine-tuning); two minibatches, warm-up and weight decay make every piece of state matter.
SETTINGS: dict[str, Any] = {
    "lr": 1e-2,
    "minibatches": 2,
    "warmup_steps": 3,
    "weight_decay": 0.01,
    "lora": LORA,
}
SEQUENCE = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]])  # token ids of the tiny vocabulary


def lora_core(model_dir: Path, seed: int = 0, **settings: Any) -> LearnerCore:
    return make_core(model_dir, seed=seed, **{**SETTINGS, **settings})


def clones(core: LearnerCore) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in core.model.policy.named_parameters()}


def perturb_adapters(core: LearnerCore, seed: int = 5) -> None:
    """Random B matrices (PEFT starts them at zero), so that the merge is far from the base."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in adapter_parameters(core.model.policy).values():
            parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))


def test_three_steps_train_the_adapters_alone(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    core = lora_core(tiny_model_dir)
    adapters = adapter_parameters(core.model.policy)
    assert adapters and all("lora_" in name for name in adapters)
    before = clones(core)
    for _ in range(3):
        metrics = core.train_step(groups)
        assert metrics["skipped_minibatches"] == 0
    after = clones(core)
    for name, value in before.items():
        if name in adapters:
            assert not torch.equal(value, after[name]), f"adapter {name} did not train"
        else:
            assert torch.equal(value, after[name]), f"base weight {name} changed"
    # The optimiser holds the adapters alone, and so does its state.
    optimised = [p for group in core.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimised} == {id(p) for p in adapters.values()}
    assert len(core.optimizer.state) == len(adapters)
    for parameter, state in core.optimizer.state.items():
        assert state["exp_avg"].shape == parameter.shape


def test_a_resumed_lora_learner_continues_exactly_like_the_original(
    tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    original = lora_core(tiny_model_dir)
    original.train_step(groups)
    path = original.save_checkpoint(tmp_path / "ckpt")
    # The checkpoint's weights are the adapters' alone, with the config the export needs.
    stored = FileSystemReader(path / STATE_DIR).read_metadata().state_dict_metadata
    weights = {key for key in stored if key.startswith(f"{MODEL_KEY}.")}
    expected = {f"{MODEL_KEY}.{name}" for name in adapter_parameters(original.model.policy)}
    assert weights == expected
    assert (path / ADAPTER_DIR / ADAPTER_CONFIG).is_file()

    # Another seed and other initial adapters (PEFT draws A from torch's RNG): only the
    # checkpoint can make this learner match.
    torch.manual_seed(1234)
    resumed = lora_core(tiny_model_dir, seed=99)
    assert resumed.load_checkpoint(path) == 1
    for (name, a), b in zip(
        original.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    assert original.train_step(groups) == resumed.train_step(groups)
    for (name, a), b in zip(
        original.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_full_checkpoint_does_not_load_into_a_lora_learner(
    tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    full = make_core(tiny_model_dir)
    full.train_step(groups)
    path = full.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="another model"):
        lora_core(tiny_model_dir).load_checkpoint(path)


def test_generation_receives_the_merged_weights_under_the_base_models_names(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    core = lora_core(tiny_model_dir)
    perturb_adapters(core)
    core.train_step(groups)
    published = core.state_dict_for_publish()
    policy = core.model.policy
    assert isinstance(policy, PeftModel)
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert published.keys() == merged.keys() == base.state_dict().keys()
    changed = 0
    for name, tensor in published.items():
        torch.testing.assert_close(tensor, merged[name], rtol=1e-6, atol=1e-6, msg=name)
        changed += not torch.equal(tensor, base.state_dict()[name])
    assert changed >= 2 * 7  # every projection of both layers carries its adapter

    manifest = core.weights_manifest(bucket_bytes=16 * 1024)
    names = [spec.name for bucket in manifest.buckets for spec in bucket]
    assert not [name for name in names if "lora_" in name or "base_model" in name]
    # A generation worker loads the buckets into the base model unchanged.
    load_buckets_into(base, core.weight_buckets(manifest), manifest)
    for name, tensor in base.state_dict().items():
        assert torch.equal(tensor, published[name]), name


def test_the_export_writes_the_merged_model_and_the_adapter(
    tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    core = lora_core(tiny_model_dir)
    perturb_adapters(core)
    core.train_step(groups)
    checkpoint = core.save_checkpoint(tmp_path / "ckpt")
    run_dir = tmp_path / "run"
    out = export_model(checkpoint, run_dir / "model")

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, run_dir / "adapter")
    for name, tensor in merged.state_dict().items():
        assert torch.equal(tensor, core.state_dict_for_publish()[name]), name
    with torch.no_grad():
        merged_logits = merged(SEQUENCE).logits
        adapted_logits = adapted(SEQUENCE).logits
        with adapted.disable_adapter():
            base_logits = adapted(SEQUENCE).logits
    torch.testing.assert_close(merged_logits, adapted_logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(merged_logits, base_logits, atol=1e-3)  # the adapter matters

    # A second export replaces both directories.
    assert export_model(checkpoint, run_dir / "model") == out
    assert {p.name for p in run_dir.iterdir()} == {"model", "adapter"}


def test_a_model_with_tied_embeddings_checkpoints_and_exports_its_adapters_alone(
    groups: list[ScoredGroup], tmp_path: Path
) -> None:
    model_dir = resolve_model("tiny-arith")  # its output head is its input embedding
    core = lora_core(model_dir)
    perturb_adapters(core)
    core.train_step(groups)
    assert core.weights_manifest(bucket_bytes=16 * 1024).aliases == {
        "lm_head.weight": "model.embed_tokens.weight"
    }
    checkpoint = core.save_checkpoint(tmp_path / "ckpt")
    stored = FileSystemReader(checkpoint / STATE_DIR).read_metadata().state_dict_metadata
    weights = {key.removeprefix(f"{MODEL_KEY}.") for key in stored if key.startswith(MODEL_KEY)}
    assert weights == set(adapter_parameters(core.model.policy))
    out = export_model(checkpoint, tmp_path / "run" / "model")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    published = core.state_dict_for_publish()
    for name, tensor in merged.state_dict().items():
        assert torch.equal(tensor, published[name]), name


def test_an_export_never_replaces_a_foreign_adapter_directory(
    tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    core = lora_core(tiny_model_dir)
    checkpoint = core.save_checkpoint(tmp_path / "ckpt")
    (tmp_path / "run" / "adapter").mkdir(parents=True)
    (tmp_path / "run" / "adapter" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an adapter directory"):
        export_model(checkpoint, tmp_path / "run" / "model")
    assert (tmp_path / "run" / "adapter" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "run" / "model").exists()


def test_adapter_dropout_applies_to_training_forwards_only(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    core = lora_core(tiny_model_dir, lora={**LORA, "dropout": 0.5})
    perturb_adapters(core)
    policy = core.model.policy
    with torch.no_grad():
        first, second = policy(SEQUENCE).logits, policy(SEQUENCE).logits
    assert torch.equal(first, second)  # no dropout: the proximal log-probs are deterministic
    training = policy(SEQUENCE).logits
    assert not torch.allclose(training, first)


@pytest.mark.parametrize(
    ("learner", "message"),
    [
        ({"lora": {"rank": 0}}, "learner.lora.rank"),
        ({"lora": {"target_modules": []}}, "learner.lora.target_modules"),
        ({"lora": {"alpha": 0}}, "learner.lora.alpha"),
        ({"lora": {"dropout": 1.0}}, "learner.lora.dropout"),
        ({"lora": {}, "strategy": "fsdp2", "world_size": 2}, "learner.strategy"),
    ],
)
def test_bad_lora_settings_are_validation_errors_naming_the_key(
    learner: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        RunSpec.model_validate({"learner": learner})
    assert message in describe_validation_error(caught.value, "run.yaml")


def test_lora_defaults_target_the_attention_and_mlp_projections() -> None:
    lora = RunSpec.model_validate({"learner": {"lora": {}}}).learner.lora
    assert lora is not None and (lora.rank, lora.alpha, lora.dropout) == (16, 32.0, 0.0)
    assert set(lora.target_modules) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
