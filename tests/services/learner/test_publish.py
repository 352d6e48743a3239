"""What a learner publishes: the manifest (HF names, compute dtype, tied aliases) and buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from services.learner.distributed import RankGroup
from services.learner.publish import full_tensor, iter_buckets, weights_manifest
from services.weights.buckets import bucket_nbytes
from tests.services.learner.conftest import make_core
from tests.services.weights.models import save_tied_model


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tied_model(tmp_path_factory.mktemp("tied"))


def test_manifest_names_shapes_dtype_and_aliases(tied_model_dir: Path) -> None:
    core = make_core(tied_model_dir, compute_dtype="bfloat16")
    manifest = core.weights_manifest(bucket_bytes=16 * 1024)
    state = core.model.policy.state_dict()
    assert manifest.version == 0
    assert manifest.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    sent = [spec.name for bucket in manifest.buckets for spec in bucket]
    assert sent == [name for name in state if name != "lm_head.weight"]  # HF names, in order
    assert sorted(manifest.names()) == sorted(state)
    for bucket in manifest.buckets:
        for spec in bucket:
            assert spec.shape == tuple(state[spec.name].shape)
            assert spec.dtype == "bfloat16"  # the compute dtype, not the float32 master
        assert len(bucket) == 1 or bucket_nbytes(bucket) <= 16 * 1024


def test_buckets_hold_the_weights_in_the_compute_dtype_bitwise(tied_model_dir: Path) -> None:
    core = make_core(tied_model_dir, compute_dtype="bfloat16")
    manifest = core.weights_manifest(bucket_bytes=16 * 1024)
    got: dict[str, Tensor] = {}
    for bucket in core.weight_buckets(manifest):
        got.update({name: tensor.clone() for name, tensor in bucket.items()})
    state = core.model.policy.state_dict()
    assert got.keys() == set(state) - {"lm_head.weight"}
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu"
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
    published = core.state_dict_for_publish()
    assert published["lm_head.weight"] is published["model.embed_tokens.weight"]


class WithCounter(nn.Module):
    """A module with a float parameter and an integer buffer (a step count, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.register_buffer("count", torch.tensor([2**40 + 3, -5], dtype=torch.int64))


def test_integer_tensors_keep_their_dtype() -> None:
    module = WithCounter()
    manifest = weights_manifest(module, torch.bfloat16, 1, bucket_bytes=1024)
    dtypes = {spec.name: spec.dtype for bucket in manifest.buckets for spec in bucket}
    assert dtypes == {"weight": "bfloat16", "count": "int64"}
    (bucket,) = list(iter_buckets(module, manifest, RankGroup()))
    assert bucket["count"].tolist() == [2**40 + 3, -5]


def test_other_ranks_walk_every_tensor_and_get_nothing() -> None:
    module = WithCounter()
    manifest = weights_manifest(module, torch.float32, 1, bucket_bytes=1024)
    walked: list[tuple[int, ...]] = []

    def gather(tensor: Tensor) -> Tensor:
        walked.append(tuple(tensor.shape))
        return full_tensor(tensor)

    assert list(iter_buckets(module, manifest, RankGroup(1, 2), gather=gather)) == []
    assert walked == [(3, 4), (2,)]


def test_a_manifest_of_another_model_is_refused() -> None:
    manifest = weights_manifest(WithCounter(), torch.float32, 1, bucket_bytes=1024)
    with pytest.raises(ValueError, match=r"'weight' .* shape \(3, 4\), the model: shape \(2, 2\)"):
        list(iter_buckets(nn.Linear(2, 2), manifest, RankGroup()))
    with pytest.raises(ValueError, match=r"'weight' .* the model: no such tensor"):
        list(iter_buckets(nn.Module(), manifest, RankGroup()))
