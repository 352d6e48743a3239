"""What every backend needs to load a published version bucket by bucket.

A backend checks the manifest against its model before it touches a single weight
(`check_manifest`), so a mismatched publish leaves the model and its version as they were; then
it loads each bucket as it arrives, tied aliases included (`with_aliases`), and drops it.
`load_buckets_into` does all of it for a plain torch module (the hf backend, the benchmark's
receivers).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from services.weights.base import StateDictMismatchError, WeightsManifest


def check_manifest(
    manifest: WeightsManifest, expected_shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """Raise StateDictMismatchError naming the names the manifest lacks, those the model does
    not have, and those whose shapes differ (tied aliases count as the tensor they alias)."""
    shapes = {spec.name: spec.shape for bucket in manifest.buckets for spec in bucket}
    dangling = sorted(alias for alias, name in manifest.aliases.items() if name not in shapes)
    for alias, name in manifest.aliases.items():
        if name in shapes:
            shapes[alias] = shapes[name]
    missing = sorted(set(expected_shapes) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected_shapes))
    wrong_shape = [
        f"{name}: got {shapes[name]}, model has {tuple(shape)}"
        for name, shape in expected_shapes.items()
        if name in shapes and tuple(shapes[name]) != tuple(shape)
    ]
    if missing or unexpected or wrong_shape or dangling:
        raise StateDictMismatchError(
            f"weights of version {manifest.version} do not match the model: missing {missing}; "
            f"unexpected {unexpected}; wrong shapes {wrong_shape}"
            + (f"; aliases of unsent tensors {dangling}" if dangling else "")
        )


def with_aliases(bucket: Mapping[str, Tensor], aliases: Mapping[str, str]) -> dict[str, Tensor]:
    """`bucket` plus each tied alias of a tensor in it, under the alias's name (same tensor;
    `aliases`: a manifest's alias -> name). A loader that keeps tied tensors once skips the
    aliases it does not hold (vLLM's skip `lm_head.weight` of a tied model)."""
    out = dict(bucket)
    for alias, name in aliases.items():
        if name in bucket:
            out[alias] = bucket[name]
    return out


def module_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """name -> shape of every entry of `module`'s state dict (what a manifest must cover)."""
    return {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}


@torch.no_grad()
def load_buckets_into(
    module: nn.Module, buckets: Iterable[Mapping[str, Tensor]], manifest: WeightsManifest
) -> None:
    """Copy each bucket into `module`'s tensors in place (any device or dtype: the module's
    tensors keep theirs), after checking the manifest against the module."""
    targets = module.state_dict()  # detached views of the live parameters and buffers
    check_manifest(manifest, {name: tuple(t.shape) for name, t in targets.items()})
    loaded = 0
    for bucket in buckets:
        written: set[int] = set()
        for name, tensor in with_aliases(bucket, manifest.aliases).items():
            target = targets[name]
            if target.data_ptr() in written:  # a tied alias of a tensor just copied
                continue
            target.copy_(tensor)
            written.add(target.data_ptr())
        loaded += 1
    if loaded != len(manifest.buckets):
        raise ValueError(
            f"weights of version {manifest.version}: got {loaded} of "
            f"{len(manifest.buckets)} buckets"
        )
