"""Export of learner checkpoints (DCP, 1 or N ranks) as Hugging Face model directories."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from services.learner.checkpoint import (
    HF_DIR,
    LEARNER_STATE,
    MODEL_KEY,
    STATE_DIR,
    LearnerState,
    TrainingState,
    save_checkpoint,
)
from services.learner.distributed import RankGroup
from services.learner.export import ExportError, export_model, write_hf_files
from services.pipeline.checkpoints import LEARNER_DIR, checkpoint_name, write_checkpoint
from services.pipeline.outputs import CHECKPOINTS_DIR
from services.pipeline.run_export import export_run
from services.tasks.models import resolve_model
from tests.services.learner.ranks import run_ranks

SEED = 7
# The checkpoints are written without a process group, as DCP warns: on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
TIED = ("model.embed_tokens.weight", "lm_head.weight")


def tiny_model(seed: int = SEED) -> tuple[PreTrainedModel, Any]:
    """The project's tiny model (fp32) with seeded noise on every weight, and its tokenizer.

    The noise makes the weights differ from the files on disk (so only the checkpoint can
    supply them) and leaves them with bits below bf16's precision (so the cast shows).
    """
    directory = resolve_model("tiny-arith")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():  # a tied weight is yielded once
            parameter.add_(0.01 * torch.randn(parameter.shape, generator=generator))
    return model, AutoTokenizer.from_pretrained(directory)


def save_learner_checkpoint(
    path: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    compute_dtype: str = "float32",
    world_size: int = 1,
) -> Path:
    """A learner checkpoint of `model` (possibly FSDP2-sharded), written as the learner does."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = TrainingState(optimizer, scheduler, torch.Generator().manual_seed(0))
    learner = LearnerState(version=3, steps=3, world_size=world_size, compute_dtype=compute_dtype)
    hf_model: Any = model
    return save_checkpoint(
        path, model, lambda d: write_hf_files(hf_model, tokenizer, d), state, learner
    )


def write_run(run_dir: Path, steps: dict[int, Path]) -> Path:
    """A run directory whose checkpoints hold the given learner checkpoints, by step."""
    root = run_dir / CHECKPOINTS_DIR
    for step, learner in steps.items():
        write_checkpoint(root, step, {"step": step}, partial(shutil.copytree, learner))
    return run_dir


def _save_sharded(group: RankGroup, path: str) -> None:
    """One rank of an FSDP2 learner (gloo): shard every decoder layer and the root, save."""
    model, tokenizer = tiny_model()
    mesh = init_device_mesh("cpu", (group.world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    save_learner_checkpoint(Path(path), model, tokenizer, world_size=group.world_size)


@pytest.fixture(scope="module")
def saved() -> dict[str, torch.Tensor]:
    """The weights every checkpoint of this module holds (fp32 clones)."""
    model, _ = tiny_model()
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A learner checkpoint written by one rank, compute dtype float32."""
    model, tokenizer = tiny_model()
    return save_learner_checkpoint(tmp_path_factory.mktemp("ckpt") / "learner", model, tokenizer)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tokenizer = tiny_model()
    path = tmp_path_factory.mktemp("ckpt-bf16") / "learner"
    return save_learner_checkpoint(path, model, tokenizer, compute_dtype="bfloat16")


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights, written by 2 FSDP2 ranks (2 forked processes, gloo)."""
    path = tmp_path_factory.mktemp("ckpt-2-ranks") / "learner"
    run_ranks(_save_sharded, 2, str(path))
    return path


def test_float32_export_holds_the_saved_weights_exactly(
    checkpoint: Path, saved: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    out = export_model(checkpoint, tmp_path / "model")
    assert out == tmp_path / "model"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary directory left
    assert {"config.json", "generation_config.json", "model.safetensors"} <= {
        p.name for p in out.iterdir()
    }
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == ["Qwen2ForCausalLM"]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    state = loaded.state_dict()
    assert state.keys() == saved.keys()
    for name, tensor in saved.items():
        assert state[name].dtype == torch.float32, name
        assert torch.equal(state[name], tensor), name
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied again on load


def test_bfloat16_export_holds_the_saved_weights_rounded_to_bfloat16(
    bf16_checkpoint: Path, saved: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    out = export_model(bf16_checkpoint, tmp_path / "model")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(out / "model.safetensors")
    assert weights and all(t.dtype == torch.bfloat16 for t in weights.values())
    state = AutoModelForCausalLM.from_pretrained(out, dtype="auto").state_dict()
    for name, tensor in saved.items():
        # Round to nearest: the bf16 value is the fp32 value rounded, nothing else.
        assert torch.equal(state[name], tensor.to(torch.bfloat16)), name
    # The noise left bits below bf16's 8-bit mantissa: the rounding did change values.
    assert not torch.equal(weights[TIED[0]].float(), saved[TIED[0]])


def test_exported_model_generates_like_the_saved_one(checkpoint: Path, tmp_path: Path) -> None:
    out = export_model(checkpoint, tmp_path / "model")
    original, _ = tiny_model()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    inputs = tokenizer("12+7=", return_tensors="pt")
    with torch.no_grad():
        expected = original.eval()(**inputs).logits
        actual = loaded(**inputs).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)
    tokens = loaded.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert tokens.shape == (1, inputs["input_ids"].shape[1] + 6)


def test_export_is_the_same_from_one_rank_and_from_two_fsdp2_ranks(
    checkpoint: Path, sharded_checkpoint: Path, tmp_path: Path
) -> None:
    metadata = json.loads((sharded_checkpoint / LEARNER_STATE).read_text())
    assert metadata["world_size"] == 2
    assert len(list((sharded_checkpoint / STATE_DIR).glob("*.distcp"))) == 2  # one per rank
    # Every weight was a DTensor sharded over both ranks: dim 0 in two chunks.
    stored = FileSystemReader(sharded_checkpoint / STATE_DIR).read_metadata().state_dict_metadata
    embedding = stored[f"{MODEL_KEY}.{TIED[0]}"]
    assert isinstance(embedding, TensorStorageMetadata)
    assert [chunk.offsets[0] for chunk in embedding.chunks] == [0, embedding.size[0] // 2]
    one = load_file(export_model(checkpoint, tmp_path / "one") / "model.safetensors")
    two = load_file(export_model(sharded_checkpoint, tmp_path / "two") / "model.safetensors")
    assert one.keys() == two.keys()
    for name, tensor in one.items():
        assert torch.equal(two[name], tensor), name


def test_a_checkpoint_holding_one_tied_name_exports_both(
    checkpoint: Path, saved: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    for kept, dropped in (TIED, TIED[::-1]):
        learner = tmp_path / f"without-{dropped}"
        shutil.copytree(checkpoint, learner, ignore=shutil.ignore_patterns(STATE_DIR))
        model_state = {k: v for k, v in saved.items() if k != dropped}
        dcp_save({MODEL_KEY: model_state}, checkpoint_id=learner / STATE_DIR, no_dist=True)
        state = AutoModelForCausalLM.from_pretrained(
            export_model(learner, tmp_path / f"out-{dropped}")
        ).state_dict()
        assert torch.equal(state[dropped], saved[kept])
        assert torch.equal(state[kept], saved[kept])


def test_a_checkpoint_of_another_model_is_refused_with_the_names(
    checkpoint: Path, saved: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    learner = tmp_path / "learner"
    shutil.copytree(checkpoint, learner, ignore=shutil.ignore_patterns(STATE_DIR))
    model_state = {k: v for k, v in saved.items() if k != "model.norm.weight"}
    model_state["model.extra.weight"] = torch.zeros(2)
    dcp_save({MODEL_KEY: model_state}, checkpoint_id=learner / STATE_DIR, no_dist=True)
    with pytest.raises(
        ExportError,
        match=r"missing \['model\.norm\.weight'\]; unexpected \['model\.extra\.weight'\]",
    ):
        export_model(learner, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_damaged_weights_are_an_export_error_naming_the_state(
    checkpoint: Path, tmp_path: Path
) -> None:
    learner = tmp_path / "learner"
    shutil.copytree(checkpoint, learner)
    (shard,) = (learner / STATE_DIR).glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ExportError, match=f"{learner / STATE_DIR}: cannot read the weights"):
        export_model(learner, tmp_path / "model")
    (learner / STATE_DIR / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(ExportError, match="not a readable DCP checkpoint"):
        export_model(learner, tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["learner"]


def test_a_directory_without_learner_json_is_not_a_learner_checkpoint(
    checkpoint: Path, tmp_path: Path
) -> None:
    learner = tmp_path / "learner"
    shutil.copytree(checkpoint, learner)
    (learner / LEARNER_STATE).unlink()
    with pytest.raises(ExportError, match=str(learner / LEARNER_STATE)):
        export_model(learner, tmp_path / "model")
    shutil.rmtree(learner / HF_DIR)
    (learner / LEARNER_STATE).write_text(json.dumps({"version": 1, "steps": 1}))
    with pytest.raises(ExportError, match=str(learner / HF_DIR)):
        export_model(learner, tmp_path / "model")


def test_an_earlier_export_is_replaced_only_by_a_complete_one(
    checkpoint: Path,
    bf16_checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = export_model(bf16_checkpoint, tmp_path / "model")
    before = (out / "model.safetensors").read_bytes()

    def interrupted(self: PreTrainedModel, directory: Path, **_: Any) -> None:
        Path(directory).mkdir()
        (Path(directory) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedModel, "save_pretrained", interrupted)
        with pytest.raises(KeyboardInterrupt):
            export_model(checkpoint, out)
    assert (out / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # the partial one is gone
    export_model(checkpoint, out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_directory_that_is_not_an_export_is_never_replaced(
    checkpoint: Path, tmp_path: Path
) -> None:
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "config.json").write_text("{}")  # a run directory has a config.json too
    with pytest.raises(ExportError, match="not a model directory"):
        export_model(checkpoint, precious)
    assert [p.name for p in precious.iterdir()] == ["config.json"]
    with pytest.raises(ExportError, match="holds the checkpoint"):
        export_model(checkpoint, checkpoint.parent)
    with pytest.raises(ExportError, match="is inside the checkpoint"):
        export_model(checkpoint, checkpoint / HF_DIR / "model")


def test_export_run_picks_the_newest_intact_checkpoint_or_the_step_asked_for(
    checkpoint: Path, bf16_checkpoint: Path, tmp_path: Path
) -> None:
    run = write_run(tmp_path / "run", {10: checkpoint, 20: bf16_checkpoint})
    newest = export_run(run)
    assert newest == run / "model"
    assert json.loads((newest / "config.json").read_text())["dtype"] == "bfloat16"
    older = export_run(run, tmp_path / "older", step=10)
    assert json.loads((older / "config.json").read_text())["dtype"] == "float32"
    # Step 20 damaged: the newest intact one is step 10; asking for 20 names the damage.
    damaged = run / CHECKPOINTS_DIR / checkpoint_name(20) / LEARNER_DIR / LEARNER_STATE
    damaged.write_text(damaged.read_text() + " ")
    fallback = export_run(run, tmp_path / "fallback")
    assert json.loads((fallback / "config.json").read_text())["dtype"] == "float32"
    with pytest.raises(ExportError, match="is damaged: files differ"):
        export_run(run, tmp_path / "x", step=20)
    with pytest.raises(ExportError, match="is inside the checkpoints of"):
        export_run(run, run / CHECKPOINTS_DIR / "model")


def test_export_run_errors_name_the_run_the_step_and_the_steps_available(
    checkpoint: Path, tmp_path: Path
) -> None:
    with pytest.raises(ExportError, match=f"{tmp_path / 'nope'}: no such run directory"):
        export_run(tmp_path / "nope")
    run = write_run(tmp_path / "run", {10: checkpoint, 30: checkpoint})
    with pytest.raises(ExportError, match=rf"{run} has no checkpoint of step 20 \(steps: 10, 30\)"):
        export_run(run, step=20)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ExportError, match=r"has no complete checkpoint .*: none"):
        export_run(empty)
    with pytest.raises(ExportError, match=r"no checkpoint of step 1 \(steps: none\)"):
        export_run(empty, step=1)
