"""Export a learner checkpoint as a Hugging Face model directory (`kpo export`).

A learner checkpoint (`services.learner.checkpoint`) holds the fp32 master weights as a
torch.distributed.checkpoint (DCP) written by 1 or N ranks, plus the config and tokenizer in
`hf/`. The export, in one process and without a process group:

    1. builds the model from `hf/config.json` on the meta device and materialises it (fp32,
       uninitialised memory: one copy of the model, and the only one);
    2. reads the "model" part of the DCP state straight into that model's tensors (DCP
       reassembles the shards of however many ranks wrote it);
    3. casts it to the learner's compute dtype (`learner.json`);
    4. writes `save_pretrained` (safetensors), the generation config and the tokenizer files
       into a hidden sibling directory, and renames that into place.

Tied embeddings (Qwen2's lm_head is embed_tokens): the checkpoint may hold both names or one;
one tensor is read per group of tied names, from whichever name the checkpoint has.

A LoRA checkpoint (`adapter/adapter_config.json` beside `hf/`) holds the adapters' weights
alone: the export reads the base model from the config's `base_model_name_or_path` (the
learner's `model`), puts the adapters on it (`services.learner.lora`), reads their weights from
the DCP state, writes them with PEFT's `save_pretrained` into an `adapter/` directory beside
`out_dir` (loadable with `PeftModel.from_pretrained` on the base model), and exports the merged
model (`merge_and_unload`) as above.

Left out: non-persistent buffers (RoPE's `inv_freq`) are not part of the state dict, so they
stay as the meta device left them (uninitialised). The exported model is never run here and
`save_pretrained` does not write them; `from_pretrained` computes them afresh.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from services.durable_files import fsync_path, sync_tree
from services.learner.checkpoint import (
    HF_DIR,
    LEARNER_STATE,
    MODEL_KEY,
    STATE_DIR,
    read_learner_state,
    stored_model_entries,
)
from services.learner.lora import (
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    adapter_parameters,
    is_adapter_checkpoint,
)
from services.weights.matching import TensorShape, shapes_of, tied_groups, weights_mismatch

log = logging.getLogger(__name__)

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CONFIG_FILE, GENERATION_CONFIG_FILE = "config.json", "generation_config.json"
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an output directory that must not be replaced."""


def write_hf_files(model: PreTrainedModel, tokenizer: Any, directory: Path) -> None:
    """Write what an export needs besides the weights: config, generation config, tokenizer.

    The learner passes `lambda d: write_hf_files(model, tokenizer, d)` as `save_checkpoint`'s
    `hf_files`. `model` may be wrapped by FSDP2 (`fully_shard` keeps `config` reachable).
    """
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def adapter_dir_of(out_dir: Path) -> Path:
    """Where the export of a LoRA checkpoint to `out_dir` writes the adapter: beside it
    (RUN_DIR/model -> RUN_DIR/adapter)."""
    return Path(out_dir).parent / ADAPTER_DIR


def export_model(learner_dir: Path, out_dir: Path) -> Path:
    """Write the model of the learner checkpoint `learner_dir` to `out_dir`; return `out_dir`.

    `out_dir` is replaced only once the new export is complete; an existing directory that is
    not a model directory (no safetensors weights) is never replaced. A LoRA checkpoint also
    writes its adapter to `adapter_dir_of(out_dir)` (module doc), under the same rule (an
    existing directory there must be an adapter: it holds adapter_config.json).
    """
    learner_dir, out_dir = Path(learner_dir), Path(out_dir)
    dtype = _compute_dtype(learner_dir)
    adapter_out = adapter_dir_of(out_dir) if is_adapter_checkpoint(learner_dir) else None
    for target in (out_dir, adapter_out):
        if target is not None and target.resolve().is_relative_to(learner_dir.resolve()):
            raise ExportError(
                f"{target} is inside the checkpoint {learner_dir}; pick another output"
            )
    _check_replaceable(out_dir, learner_dir)
    if adapter_out is not None:
        _check_replaceable(adapter_out, learner_dir, marker=ADAPTER_CONFIG)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    tmp_adapter = out_dir.parent / f".{ADAPTER_DIR}.tmp-{os.getpid()}"
    for path in (tmp, tmp_adapter):
        shutil.rmtree(path, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        if adapter_out is None:
            model = _load_model(learner_dir)
        else:
            model = _load_merged_model(learner_dir, tmp_adapter)
        model.to(dtype)  # type: ignore[arg-type]
        model.save_pretrained(tmp)
        del model
        _copy_tokenizer_files(learner_dir / HF_DIR, tmp)
        sync_tree(tmp)
        if adapter_out is not None:
            sync_tree(tmp_adapter)
            _replace_dir(tmp_adapter, adapter_out)
            log.info("LoRA adapter of %s written to %s", learner_dir, adapter_out)
        _replace_dir(tmp, out_dir)
    except BaseException:
        for path in (tmp, tmp_adapter):
            shutil.rmtree(path, ignore_errors=True)
        raise
    return out_dir


def _compute_dtype(learner_dir: Path) -> torch.dtype:
    """The dtype the learner computed in, from `learner.json`; names the file when it is bad."""
    try:
        name = read_learner_state(learner_dir).compute_dtype
    except ValueError as error:
        raise ExportError(str(error)) from None
    if name not in COMPUTE_DTYPES:
        raise ExportError(
            f"{learner_dir / LEARNER_STATE}: compute_dtype {name!r} is not one of "
            f"{sorted(COMPUTE_DTYPES)}"
        )
    return COMPUTE_DTYPES[name]


def _load_model(learner_dir: Path) -> PreTrainedModel:
    """The fp32 model of `hf/config.json` holding the checkpoint's weights (one copy)."""
    hf_dir = learner_dir / HF_DIR
    try:
        config = AutoConfig.from_pretrained(hf_dir)
        generation_config = GenerationConfig.from_pretrained(hf_dir)
    except (OSError, ValueError) as error:
        raise ExportError(f"{hf_dir}: not a learner checkpoint's config: {error}") from None
    with torch.device("meta"):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=torch.float32
        )
    # to_empty gives each module a Parameter of its own: tie lm_head to the embedding again.
    model.to_empty(device="cpu")
    model.tie_weights()
    model.generation_config = generation_config
    _read_weights(model, learner_dir / STATE_DIR)
    return model


def _load_merged_model(learner_dir: Path, adapter_out: Path) -> PreTrainedModel:
    """The base model with the checkpoint's LoRA adapters merged in (fp32); the adapter itself
    is written to `adapter_out` first (PEFT's `save_pretrained`). PEFT is imported here, for
    adapter checkpoints only (services.learner.lora)."""
    from peft import LoraConfig, get_peft_model

    config_dir = learner_dir / ADAPTER_DIR
    try:
        config = LoraConfig.from_pretrained(str(config_dir))
    except (OSError, ValueError, TypeError) as error:
        raise ExportError(f"{config_dir}: not a LoRA adapter config: {error}") from None
    base_path = config.base_model_name_or_path
    try:
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    except (OSError, ValueError) as error:
        raise ExportError(
            f"{config_dir / ADAPTER_CONFIG}: cannot load the base model {base_path!r} the "
            f"adapters were trained on: {error}"
        ) from None
    base.generation_config = GenerationConfig.from_pretrained(learner_dir / HF_DIR)
    peft_model = get_peft_model(base, config)
    state = peft_model.state_dict()
    adapters = {name: state[name] for name in adapter_parameters(peft_model)}
    _read_weights(adapters, learner_dir / STATE_DIR)
    peft_model.save_pretrained(str(adapter_out))
    merged: PreTrainedModel = peft_model.merge_and_unload()
    return merged


def _read_weights(model: torch.nn.Module | dict[str, torch.Tensor], state_dir: Path) -> None:
    """Read the "model" part of the DCP checkpoint `state_dir` into `model`'s tensors, in place
    (a dict of tensors: into those, which must be all the checkpoint holds).

    One name per group of tied tensors is read (the first the checkpoint has); a name of the
    model with no value in the checkpoint, a name of the checkpoint the model lacks, or a
    shape that differs is an ExportError naming them.
    """
    try:
        metadata = FileSystemReader(state_dir).read_metadata()
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        raise ExportError(f"{state_dir}: not a readable DCP checkpoint: {error}") from None
    stored = {
        name: entry
        for name, entry in stored_model_entries(metadata).items()
        if isinstance(entry, TensorStorageMetadata)
    }
    tensors = model if isinstance(model, dict) else model.state_dict()
    groups = tied_groups(tensors)
    stored_shapes = {name: TensorShape(tuple(entry.size)) for name, entry in stored.items()}
    problem = weights_mismatch(shapes_of(tensors), stored_shapes, tied=groups)
    if problem:
        raise ExportError(f"{state_dir} does not fit the model of its config: {problem}")
    wanted: dict[str, torch.Tensor] = {}
    for names in groups:
        present = next(name for name in names if name in stored)
        wanted[present] = tensors[present]
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp_load({MODEL_KEY: wanted}, checkpoint_id=state_dir, no_dist=True)
    except CheckpointException as error:  # a BaseException: wraps what went wrong reading
        raise ExportError(f"{state_dir}: cannot read the weights: {error}") from None


def _copy_tokenizer_files(hf_dir: Path, out_dir: Path) -> None:
    """Copy hf/'s tokenizer files (and any other) as they are; config files and weights are
    the export's own (`save_pretrained` wrote the config with the export's dtype)."""
    for path in sorted(hf_dir.iterdir()):
        own = path.name in (CONFIG_FILE, GENERATION_CONFIG_FILE) or path.name.endswith(
            _WEIGHT_SUFFIXES
        )
        if path.is_file() and not own:
            shutil.copy2(path, out_dir / path.name)


def _check_replaceable(out_dir: Path, learner_dir: Path, marker: str | None = None) -> None:
    """Refuse an `out_dir` whose replacement would delete something else than an export: a
    model directory (safetensors weights), or with `marker` one holding that file."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ExportError(f"{out_dir} exists and is not a directory")
    if learner_dir.resolve().is_relative_to(out_dir.resolve()):
        raise ExportError(f"{out_dir} holds the checkpoint {learner_dir}; pick another output")
    entries = list(out_dir.iterdir())
    if marker is not None:
        if entries and not (out_dir / marker).is_file():
            raise ExportError(
                f"{out_dir} exists and is not an adapter directory (no {marker}); "
                "refusing to replace it: pick another output"
            )
        return
    if entries and not any(path.name.endswith(_WEIGHT_SUFFIXES) for path in entries):
        raise ExportError(
            f"{out_dir} exists and is not a model directory (no safetensors weights); "
            "refusing to replace it: pick another output"
        )


def _replace_dir(new: Path, final: Path) -> None:
    """Move the complete directory `new` to `final`, replacing an earlier one only now."""
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(new, final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)
