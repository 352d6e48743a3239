"""Learner checkpoints: sharded model and optimiser state (torch.distributed.checkpoint).

Layout of a learner checkpoint directory (`checkpoints/step-N/learner/` of a run):

    hf/                   config.json, generation_config.json, tokenizer files (rank 0): what an
                          export needs besides the weights (`services.learner.export`)
    state/                a torch.distributed.checkpoint directory: {"model": ..., "optim": ...}
                          with the Hugging Face parameter names and fp32 master values, written
                          by every rank in parallel (one file per rank plus `.metadata`)
    rng/rank-00000.pt     torch CPU RNG of each rank, plus the learner's minibatch generator
    learner.json          {"version", "steps", "world_size", "compute_dtype"} (rank 0, last)

The state is saved and loaded through `get_state_dict`/`set_state_dict`, which see DTensor
shards on an FSDP2 learner and plain tensors on a `single` one, and DCP reshards on load: a
checkpoint written by W ranks resumes on any other number of ranks (or on one). A rank without
an RNG file of its own (more ranks than were saved) keeps its seeded RNG; the minibatch
generator, which every rank holds identically, comes from rank 0's file. Everything is read back
with `torch.load(weights_only=True)` or DCP's own reader: a checkpoint never executes code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from services.weights.matching import TensorShape, weights_mismatch

HF_DIR = "hf"  # config, generation config and tokenizer
STATE_DIR = "state"  # the DCP checkpoint
RNG_DIR = "rng"
LEARNER_STATE = "learner.json"
MODEL_KEY, OPTIM_KEY = "model", "optim"  # top-level keys of the DCP state


def rng_file(directory: Path, rank: int) -> Path:
    return directory / RNG_DIR / f"rank-{rank:05d}.pt"


@dataclass(frozen=True)
class TrainingState:
    """What besides the weights a resumed learner needs."""

    optimizer: Optimizer
    scheduler: LRScheduler
    generator: torch.Generator


@dataclass(frozen=True)
class LearnerState:
    """The `learner.json` of a checkpoint."""

    version: int
    steps: int
    world_size: int
    compute_dtype: str


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    hf_files: Any,
    state: TrainingState,
    learner: LearnerState,
    adapters_only: bool = False,
) -> Path:
    """Write the checkpoint directory `path` (created) from every rank; return it.

    Every rank of the learner group calls this with the same `path` (a shared volume on a
    cluster). `hf_files(dir)` writes the config and tokenizer files; rank 0 calls it.
    `adapters_only` (LoRA): the model part holds the trainable parameters alone; the frozen
    base weights are the model's files already.
    """
    directory = Path(path)
    rank = _rank()
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        hf_files(directory / HF_DIR)
        (directory / RNG_DIR).mkdir(exist_ok=True)
    _barrier()
    model_state, optim_state = get_state_dict(model, state.optimizer)
    if adapters_only:
        model_state = _trainable(model, model_state)
    dcp_save({MODEL_KEY: model_state, OPTIM_KEY: optim_state}, checkpoint_id=directory / STATE_DIR)
    rng = {
        "torch": torch.get_rng_state(),
        "generator": state.generator.get_state(),
        "scheduler": state.scheduler.state_dict(),
    }
    torch.save(rng, rng_file(directory, rank))
    _barrier()
    if rank == 0:
        # Written last: a directory with learner.json has every rank's part.
        text = json.dumps(learner.__dict__, indent=2) + "\n"
        (directory / LEARNER_STATE).write_text(text, encoding="utf-8")
    _barrier()
    return directory


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, state: TrainingState, adapters_only: bool = False
) -> LearnerState:
    """Restore weights, optimiser, schedule and RNGs (in place) from a `save_checkpoint` dir.

    Called by every rank; the number of ranks may differ from the one that saved it.
    `adapters_only`: as it was saved; the frozen parameters keep their values.
    """
    directory = Path(path)
    learner = read_learner_state(directory)
    model_state, optim_state = get_state_dict(model, state.optimizer)
    if adapters_only:
        model_state = _trainable(model, model_state)
    # The weights are checked here (check_model_weights), so that the load itself may skip the
    # frozen parameters, which strict loading would report as missing.
    options = StateDictOptions(strict=not adapters_only)
    check_model_weights(directory / STATE_DIR, model_state)
    # DCP loads in place into these (resharding to this group's layout).
    dcp_load({MODEL_KEY: model_state, OPTIM_KEY: optim_state}, checkpoint_id=directory / STATE_DIR)
    set_state_dict(
        model,
        state.optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=options,
    )
    own = rng_file(directory, _rank())
    rng = torch.load(own if own.exists() else rng_file(directory, 0), weights_only=True)
    if own.exists():
        torch.set_rng_state(rng["torch"])
    state.generator.set_state(rng["generator"])
    state.scheduler.load_state_dict(rng["scheduler"])
    return learner


def _trainable(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` without the frozen parameters, under every name of a tied one
    (`ignore_frozen_params` would keep the second name of a tied frozen weight, lm_head)."""
    frozen = {
        name
        for name, parameter in model.named_parameters(remove_duplicate=False)
        if not parameter.requires_grad
    }
    return {name: value for name, value in state.items() if name not in frozen}


class CheckpointMismatchError(ValueError):
    """A checkpoint whose weights are not those of the model it is loaded into."""


def stored_model_entries(metadata: Metadata) -> dict[str, STORAGE_TYPES]:
    """The model's part of a DCP checkpoint's metadata: each weight's name (without the
    `MODEL_KEY` prefix) and what DCP recorded of it."""
    prefix = f"{MODEL_KEY}."
    return {
        key.removeprefix(prefix): entry
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
    }


def check_model_weights(state_dir: Path, model_state: Mapping[str, Any]) -> None:
    """Refuse a DCP checkpoint whose model weights are not `model_state`'s: other names or
    other (global) shapes (DCP itself would load the common names and silently leave the rest,
    and fail on a shape deep inside the load)."""
    stored = {
        name: TensorShape(tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else ())
        for name, entry in stored_model_entries(FileSystemReader(state_dir).read_metadata()).items()
    }
    wanted = {
        name: TensorShape(tuple(value.shape) if isinstance(value, torch.Tensor) else ())
        for name, value in model_state.items()
    }
    problem = weights_mismatch(wanted, stored)
    if problem:
        raise CheckpointMismatchError(f"{state_dir} holds the weights of another model: {problem}")


def read_learner_state(path: str | Path) -> LearnerState:
    """The `learner.json` of a checkpoint directory; a clear error for a foreign directory."""
    file = Path(path) / LEARNER_STATE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        return LearnerState(
            version=int(data["version"]),
            steps=int(data["steps"]),
            world_size=int(data.get("world_size", 1)),
            compute_dtype=str(data.get("compute_dtype", "float32")),
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{file} is not a learner checkpoint's state: {error}") from None
