"""The `object_store` weight transport: one Ray object per bucket.

Each bucket is packed (`buckets.pack_bucket`) and put as a numpy uint8 array: Ray serialises a
numpy array out-of-band (pickle 5 buffers), so the bytes are copied once into the object store
and a worker on the same node reads them from shared memory without a copy; a torch tensor
would be pickled in-band through `torch.save` bytes. No object is larger than one bucket (or
one tensor larger than a bucket), so no path meets a size limit proportional to the model.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import ray
import torch
from torch import Tensor

from services.weights.base import WeightsManifest, WeightsOffer
from services.weights.buckets import HostPacker, packed_buckets, unpack_bucket
from services.weights.delta import (
    BucketPatch,
    DeltaBase,
    DeltaMismatchError,
    check_patch_specs,
    encode_bucket,
)


def put_buckets(
    manifest: WeightsManifest,
    buckets: Iterable[dict[str, Tensor]],
    delta: DeltaBase | None = None,
    source: Any = None,
) -> WeightsOffer:
    """Put each bucket (in manifest order, each checked against it) into the object store;
    with `delta` (the sender's copy of the last version put), each as its patch against it
    (`source`: who answers `dense_offer()` for a worker that cannot apply one).

    The objects are owned by the calling process: they live as long as a ref to them does and
    the caller is alive.
    """
    # Each bucket is put (copied into the store) before the next is packed over it.
    packed = packed_buckets(manifest, buckets, HostPacker().pack)
    if delta is None:
        refs = [ray.put(flat.numpy()) for flat in packed]  # one bucket held at a time
        return WeightsOffer("object_store", manifest, tuple(refs))
    refs, headers = [], []
    for patch in delta.encode(manifest.version, packed):
        refs.append(ray.put(patch.payload.numpy()))
        headers.append(patch.header)
        del patch  # (a dense patch's payload is the bucket) before the next is packed
    return WeightsOffer("object_store", manifest, tuple(refs), tuple(headers), source)


def put_dense(delta: DeltaBase, manifest: WeightsManifest, source: Any = None) -> WeightsOffer:
    """The version `delta` holds (`manifest`'s), put whole from its copy, as dense patches."""
    if delta.version != manifest.version:
        raise RuntimeError(
            f"no whole copy of version {manifest.version} is held (held: {delta.version})"
        )
    refs, headers = [], []
    for index, flat in delta.held():
        patch = encode_bucket(index, manifest.version, flat, None, -1)
        refs.append(ray.put(flat.numpy()))
        headers.append(patch.header)
    return WeightsOffer("object_store", manifest, tuple(refs), tuple(headers), source)


def _as_tensor(array: object, index: int) -> Tensor:
    """The uint8 tensor over a fetched bucket's array (no copy)."""
    import numpy as np

    if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
        raise TypeError(f"bucket {index} of the offer is not a packed bucket: {type(array)}")
    with warnings.catch_warnings():
        # A fetched object is read-only shared memory; the loader only reads from it.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(array)


def fetch_buckets(offer: WeightsOffer) -> Iterator[dict[str, Tensor]]:
    """The offer's buckets, one at a time, as name -> tensor (aliases are the loader's job).

    The tensors are read-only views of the fetched object (in shared memory when it is on this
    node): copy them into the model, or `clone` what must outlive the next bucket. A bucket is
    fetched only when the previous one is handed back, so one bucket is held at a time.
    """
    if offer.transport != "object_store":
        raise ValueError(f"fetch_buckets takes an object_store offer, got {offer.transport!r}")
    if offer.patches:
        raise ValueError(
            f"offer of version {offer.version} holds delta patches: apply them with fetch_patched"
        )
    manifest = offer.manifest
    if len(offer.bucket_refs) != len(manifest.buckets):
        raise ValueError(
            f"offer of version {manifest.version} has {len(offer.bucket_refs)} bucket refs for "
            f"{len(manifest.buckets)} buckets"
        )
    for index, (ref, specs) in enumerate(zip(offer.bucket_refs, manifest.buckets, strict=True)):
        bucket = unpack_bucket(_as_tensor(ray.get(ref), index), specs)
        yield bucket
        del bucket  # before fetching the next one


def fetch_patched(chain: Sequence[WeightsOffer], base: DeltaBase) -> Iterator[dict[str, Tensor]]:
    """The buckets of the newest offer of `chain`, one at a time, each built by applying the
    chain's patches (delta offers of consecutive versions, oldest first) to the receiver's
    copy `base`, which then holds that version. `DeltaMismatchError` where a patch does not
    apply or fails its digest (`base` then holds nothing: load a dense offer instead)."""
    if not chain or any(not offer.patches for offer in chain):
        raise ValueError("fetch_patched takes a chain of delta offers")
    for older, newer in itertools.pairwise(chain):
        if newer.version != older.version + 1:
            raise DeltaMismatchError(
                f"offers of versions {older.version} and {newer.version} are not consecutive"
            )
    manifest = chain[-1].manifest
    base.begin()
    for index, specs in enumerate(manifest.buckets):
        patches = []
        for offer in chain:
            header = offer.patches[index]
            check_patch_specs(header, specs)
            patches.append(
                BucketPatch(header, _as_tensor(ray.get(offer.bucket_refs[index]), index))
            )
        bucket = unpack_bucket(base.apply(patches), specs)
        del patches
        yield bucket
        del bucket
    base.end(manifest.version, len(manifest.buckets))
