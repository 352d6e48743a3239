"""The object_store transport through a real local Ray instance."""

from __future__ import annotations

import os

import numpy as np
import pytest
import ray
import torch
from torch import Tensor

from services.weights.base import TensorSpec, WeightsManifest, WeightsOffer
from services.weights.buckets import bucket_nbytes, plan_buckets
from services.weights.object_store import fetch_buckets, put_buckets

pytestmark = pytest.mark.usefixtures("ray_instance")

BUCKET_BYTES = 4096


def weights() -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(40, 16, generator=generator).to(torch.bfloat16),  # 1280 bytes
        "norm": torch.randn(16, generator=generator),
        "steps": torch.tensor([2**50 + 1, -3], dtype=torch.int64),
        "mask": torch.rand(33, generator=generator) > 0.5,
        "big": torch.randn(50, 40, generator=generator),  # 8000 bytes: a bucket of its own
        "head": torch.randn(16, 40, generator=generator).half(),
    }


def publish(tensors: dict[str, Tensor]) -> tuple[WeightsManifest, list[dict[str, Tensor]]]:
    specs = [
        TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in tensors.items()
    ]
    manifest = WeightsManifest(7, plan_buckets(specs, BUCKET_BYTES), {"lm_head": "embed"})
    buckets = [{spec.name: tensors[spec.name] for spec in bucket} for bucket in manifest.buckets]
    return manifest, buckets


@ray.remote(num_cpus=0.5)
def fetch_elsewhere(wrapped: list[WeightsOffer]) -> tuple[int, dict[str, Tensor]]:
    """In a Ray worker process: fetch every bucket, keep copies (the views are read-only)."""
    got: dict[str, Tensor] = {}
    for bucket in fetch_buckets(wrapped[0]):
        got.update({name: tensor.clone() for name, tensor in bucket.items()})
    return os.getpid(), got


def raw(tensor: Tensor) -> Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def test_a_worker_process_fetches_every_tensor_bitwise() -> None:
    tensors = weights()
    manifest, buckets = publish(tensors)
    offer = put_buckets(manifest, iter(buckets))
    assert offer.transport == "object_store" and offer.manifest == manifest
    assert len(offer.bucket_refs) == len(manifest.buckets) == 3
    # Wrapped in a list, as the driver does, so Ray hands the worker the refs unresolved.
    pid, got = ray.get(fetch_elsewhere.remote([offer]))
    assert pid != os.getpid()
    assert got.keys() == tensors.keys()  # aliases are the loader's job
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(raw(got[name]), raw(tensor)), name


def test_every_object_is_one_packed_bucket_never_a_bytes_blob() -> None:
    tensors = weights()
    manifest, buckets = publish(tensors)
    offer = put_buckets(manifest, iter(buckets))
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    for ref, specs in zip(offer.bucket_refs, manifest.buckets, strict=True):
        stored = ray.get(ref)
        assert isinstance(stored, np.ndarray) and stored.dtype == np.uint8
        assert stored.nbytes == bucket_nbytes(specs)
        assert stored.nbytes <= max(BUCKET_BYTES, largest) < total


def test_fetched_buckets_come_one_at_a_time_in_manifest_order() -> None:
    manifest, buckets = publish(weights())
    offer = put_buckets(manifest, iter(buckets))
    fetched = fetch_buckets(offer)
    first = next(fetched)
    assert list(first) == [spec.name for spec in manifest.buckets[0]]
    assert [list(b) for b in fetched] == [[s.name for s in b] for b in manifest.buckets[1:]]


def test_buckets_that_do_not_match_the_manifest_are_refused() -> None:
    manifest, buckets = publish(weights())
    with pytest.raises(ValueError, match="got 2 buckets, the manifest has 3"):
        put_buckets(manifest, iter(buckets[:2]))
    with pytest.raises(ValueError, match="more buckets than the manifest's 3"):
        put_buckets(manifest, iter([*buckets, buckets[0]]))
    with pytest.raises(ValueError, match=r"missing \['mask', 'norm', 'steps'\]"):
        put_buckets(manifest, iter([{"embed": buckets[0]["embed"]}]))
    with pytest.raises(ValueError, match="takes an object_store offer, got 'collective'"):
        next(fetch_buckets(WeightsOffer("collective", manifest)))
