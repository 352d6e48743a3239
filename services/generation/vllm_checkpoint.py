"""What the vLLM backend checks weights against: the checkpoint it started from.

vLLM's model holds fused, sharded parameters under its own names; the learner sends Hugging
Face names. So a publish is checked against the checkpoint's tensor names and shapes (read from
the safetensors headers, no tensor loaded), before anything reaches the engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from services.weights.base import StateDictMismatchError, TensorSpec, WeightsManifest
from services.weights.buckets import plan_buckets
from services.weights.matching import TensorShape, shapes_of, weights_mismatch


def checkpoint_shapes(model_path: str | os.PathLike[str]) -> dict[str, tuple[int, ...]] | None:
    """Tensor names and shapes of a local safetensors checkpoint, from the file headers only.

    None when `model_path` is not a local directory with safetensors files (e.g. a hub name):
    weights are then not checked before loading.
    """
    directory = Path(model_path)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def ties_embeddings(model_path: str | os.PathLike[str]) -> bool:
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    return bool(json.loads(config.read_text()).get("tie_word_embeddings", False))


def ignorable_names(tied_embeddings: bool) -> Callable[[str], bool]:
    """Names a sender may include that a checkpoint omits and vLLM skips: the output head of a
    tied model, and the rotary `inv_freq` buffers of older transformers versions."""

    def ignorable(name: str) -> bool:
        return (tied_embeddings and name == "lm_head.weight") or name.endswith(
            "rotary_emb.inv_freq"
        )

    return ignorable


def check_state_dict(
    expected: Mapping[str, tuple[int, ...]],
    state_dict: Mapping[str, torch.Tensor],
    tied_embeddings: bool,
) -> None:
    """Raise StateDictMismatchError naming missing, unexpected and wrongly shaped keys.

    `expected` holds the checkpoint's names (Hugging Face names, which the learner's state dict
    uses too). A state dict may also carry the names `ignorable_names` lets through.
    """
    problem = weights_mismatch(
        {name: TensorShape(shape) for name, shape in expected.items()},
        shapes_of(state_dict),
        ignorable=ignorable_names(tied_embeddings),
    )
    if problem:
        raise StateDictMismatchError(f"state dict does not match the model: {problem}")


def state_dict_buckets(
    state_dict: Mapping[str, torch.Tensor], version: int, bucket_bytes: int
) -> tuple[WeightsManifest, Iterator[dict[str, torch.Tensor]]]:
    """A manifest of `state_dict` in buckets of about `bucket_bytes`, and its buckets (views)."""
    specs = [
        TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in state_dict.items()
    ]
    manifest = WeightsManifest(version=int(version), buckets=plan_buckets(specs, bucket_bytes))
    buckets = ({spec.name: state_dict[spec.name] for spec in b} for b in manifest.buckets)
    return manifest, buckets
