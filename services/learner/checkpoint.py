"""Learner checkpoints: a loadable Hugging Face model directory plus the training state.

Layout of a checkpoint directory:

    config.json, generation_config.json, model*.safetensors   model.save_pretrained
    tokenizer files                                           tokenizer.save_pretrained
    optimizer.pt, scheduler.pt                                state dicts
    rng.pt                                                    torch CPU RNG + learner generator
    learner.json                                              {"version": ..., "steps": ...}

So a checkpoint can be served or evaluated as an ordinary model (`from_pretrained(path)`), and
resuming from it continues bit for bit where the saved learner was. Everything is read back with
`torch.load(weights_only=True)`: a checkpoint never executes code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from services.generation.hf_backend import check_state_dict

LEARNER_STATE = "learner.json"


@dataclass(frozen=True)
class TrainingState:
    """What besides the weights a resumed learner needs."""

    optimizer: Optimizer
    scheduler: LRScheduler
    generator: torch.Generator


def save_checkpoint(
    path: str | Path,
    model: Any,
    tokenizer: Any,
    state: TrainingState,
    version: int,
    steps: int,
) -> Path:
    """Write model, tokenizer and training state into directory `path` (created); return it."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    torch.save(state.optimizer.state_dict(), directory / "optimizer.pt")
    torch.save(state.scheduler.state_dict(), directory / "scheduler.pt")
    rng = {"torch": torch.get_rng_state(), "generator": state.generator.get_state()}
    torch.save(rng, directory / "rng.pt")
    learner = {"version": version, "steps": steps}
    (directory / LEARNER_STATE).write_text(json.dumps(learner, indent=2) + "\n")
    return directory


def load_model_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Copy the safetensors weights in directory `path` into `model`'s parameters, in place.

    Every `*.safetensors` file is read (a sharded save writes several). Keys and shapes are
    checked first, so a mismatched checkpoint leaves the model untouched; a tied alias (e.g.
    `lm_head.weight`, which `save_pretrained` leaves out) may be absent.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    device = next(model.parameters()).device
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file, device=str(device)))
    check_state_dict(model, weights)
    with torch.no_grad():
        model.load_state_dict(weights, strict=False)


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, state: TrainingState
) -> dict[str, int]:
    """Restore weights (in place) and training state from a `save_checkpoint` directory.

    Returns its `learner.json`: {"version": ..., "steps": ...}.
    """
    directory = Path(path)
    load_model_weights(directory, model)
    state.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
    state.scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))
    rng = torch.load(directory / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    state.generator.set_state(rng["generator"])
    return read_learner_state(directory)


def read_learner_state(path: str | Path) -> dict[str, int]:
    """The `learner.json` of a checkpoint directory: {"version": ..., "steps": ...}."""
    data = json.loads((Path(path) / LEARNER_STATE).read_text())
    return {"version": int(data["version"]), "steps": int(data["steps"])}
