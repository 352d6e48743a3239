"""Checking a manifest against a model, and loading buckets into a real tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.learner.distributed import RankGroup
from services.learner.publish import iter_buckets, weights_manifest
from services.weights.base import StateDictMismatchError, TensorSpec, WeightsManifest
from services.weights.loading import check_manifest, load_buckets_into, module_shapes
from tests.services.weights.models import save_tied_model


def manifest_of(**shapes: tuple[int, ...]) -> WeightsManifest:
    specs = tuple(TensorSpec(name, shape, "float32") for name, shape in shapes.items())
    return WeightsManifest(3, (specs,))


def test_check_manifest_names_missing_unexpected_and_wrong_shapes() -> None:
    expected = {"a": (2, 3), "b": (4,), "c": (1,)}
    check_manifest(manifest_of(a=(2, 3), b=(4,), c=(1,)), expected)
    with pytest.raises(StateDictMismatchError) as error:
        check_manifest(manifest_of(a=(3, 2), c=(1,), z=(5,)), expected)
    message = str(error.value)
    assert "version 3" in message
    assert "missing ['b']" in message
    assert "unexpected ['z']" in message
    assert "a: got (3, 2), model has (2, 3)" in message


def test_an_alias_stands_for_the_tensor_it_aliases() -> None:
    specs = (TensorSpec("embed", (5, 2), "bfloat16"),)
    tied = WeightsManifest(1, (specs,), {"head": "embed"})
    check_manifest(tied, {"embed": (5, 2), "head": (5, 2)})
    with pytest.raises(StateDictMismatchError, match=r"head: got \(5, 2\), model has \(2, 5\)"):
        check_manifest(tied, {"embed": (5, 2), "head": (2, 5)})
    dangling = WeightsManifest(1, (specs,), {"head": "gone"})
    with pytest.raises(StateDictMismatchError, match=r"aliases of unsent tensors \['head'\]"):
        check_manifest(dangling, {"embed": (5, 2), "head": (5, 2)})


def test_buckets_load_into_a_tied_model_bitwise(tmp_path: Path) -> None:
    source = AutoModelForCausalLM.from_pretrained(save_tied_model(tmp_path / "a", seed=1))
    target = AutoModelForCausalLM.from_pretrained(save_tied_model(tmp_path / "b", seed=2))
    manifest = weights_manifest(source, torch.float32, 4, bucket_bytes=8 * 1024)
    assert manifest.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert len(manifest.buckets) > 2
    load_buckets_into(target, iter_buckets(source, manifest, RankGroup()), manifest)
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
    # Still tied: one tensor under both names.
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()


def test_a_mismatched_manifest_leaves_the_model_untouched(tmp_path: Path) -> None:
    target = AutoModelForCausalLM.from_pretrained(save_tied_model(tmp_path / "m"))
    before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    shapes = module_shapes(target)
    name = "model.layers.0.mlp.up_proj.weight"
    specs = [
        TensorSpec(n, (1, *s.shape) if n == name else s.shape, "float32") for n, s in shapes.items()
    ]
    manifest = WeightsManifest(1, (tuple(specs),))
    buckets = [{spec.name: torch.zeros(spec.shape) for spec in specs}]
    with pytest.raises(StateDictMismatchError, match=r"layers\.0\.mlp\.up_proj\.weight: got"):
        load_buckets_into(target, buckets, manifest)
    for key, tensor in target.state_dict().items():
        assert torch.equal(tensor, before[key]), key
