"""The `object_store` weight transport: one Ray object per bucket.

Each bucket is packed (`buckets.pack_bucket`) and put as a numpy uint8 array: Ray serialises a
numpy array out-of-band (pickle 5 buffers), so the bytes are copied once into the object store
and a worker on the same node reads them from shared memory without a copy; a torch tensor
would be pickled in-band through `torch.save` bytes. No object is larger than one bucket (or
one tensor larger than a bucket), so no path meets a size limit proportional to the model.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator

import ray
import torch
from torch import Tensor

from services.weights.base import WeightsManifest, WeightsOffer
from services.weights.buckets import checked_buckets, pack_bucket, unpack_bucket


def put_buckets(manifest: WeightsManifest, buckets: Iterable[dict[str, Tensor]]) -> WeightsOffer:
    """Put each bucket (in manifest order, each checked against it) into the object store.

    The objects are owned by the calling process: they live as long as a ref to them does and
    the caller is alive.
    """
    refs = []
    for _, tensors, _ in checked_buckets(manifest, buckets):
        flat = pack_bucket(tensors)
        refs.append(ray.put(flat.cpu().numpy()))
        del flat, tensors  # the store has its copy: hold one bucket at a time
    return WeightsOffer("object_store", manifest, tuple(refs))


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
