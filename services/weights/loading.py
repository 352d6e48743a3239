"""What every backend needs to load a published version bucket by bucket.

A backend checks the manifest against its model before it touches a single weight
(`check_manifest`), so a mismatched publish leaves the model and its version as they were; then
it loads each bucket as it arrives, tied aliases included (`with_aliases`), and drops it.
`load_buckets_into` does all of it for a plain torch module (the hf backend, the benchmark's
receivers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

from services.weights.base import StateDictMismatchError, WeightsManifest
from services.weights.matching import TensorShape, shapes_of, weights_mismatch


def check_manifest(
    manifest: WeightsManifest,
    expected: Mapping[str, TensorShape | tuple[int, ...]],
    ignorable: Callable[[str], bool] = lambda name: False,
) -> None:
    """Raise StateDictMismatchError naming the names the manifest lacks, those the model does
    not have (but `ignorable`), and those whose shapes or dtypes differ (services.weights.
    matching); a tied alias counts as the tensor it aliases."""
    sent = {
        spec.name: TensorShape(spec.shape, spec.torch_dtype)
        for bucket in manifest.buckets
        for spec in bucket
    }
    dangling = sorted(alias for alias, name in manifest.aliases.items() if name not in sent)
    received = {**sent, **{a: sent[n] for a, n in manifest.aliases.items() if n in sent}}
    wanted = {
        name: shape if isinstance(shape, TensorShape) else TensorShape(tuple(shape))
        for name, shape in expected.items()
    }
    problems = [weights_mismatch(wanted, received, ignorable=ignorable)]
    if dangling:
        problems.append(f"aliases of unsent tensors {dangling}")
    if any(problems):
        raise StateDictMismatchError(
            f"weights of version {manifest.version} do not match the model: "
            + "; ".join(problem for problem in problems if problem)
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


def module_shapes(module: nn.Module) -> dict[str, TensorShape]:
    """name -> shape and dtype of every entry of `module`'s state dict (what a manifest must
    cover)."""
    return shapes_of(module.state_dict())


@torch.no_grad()
def load_buckets_into(
    module: nn.Module, buckets: Iterable[Mapping[str, Tensor]], manifest: WeightsManifest
) -> None:
    """Copy each bucket into `module`'s tensors in place (any device or dtype: the module's
    tensors keep theirs), after checking the manifest against the module."""
    targets = module.state_dict()  # detached views of the live parameters and buffers
    check_manifest(manifest, shapes_of(targets))
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
