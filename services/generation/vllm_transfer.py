"""How weights and their descriptions cross from the vLLM backend's process into vLLM's workers.

`LLM.collective_rpc` carries control messages only: plain ints, strings, lists and dicts. The
weights themselves never travel as one payload proportional to the model:

- A bucket the backend already holds (a state dict, an `object_store` offer) is written into a
  file in shared memory (`/dev/shm`), one bucket at a time, laid out as a packed bucket
  (`services.weights.buckets`); `collective_rpc` carries the file's path and the bucket's
  specs, and every worker maps the file and loads from views of it (no copy on that side).
  Tensors cannot be `collective_rpc` arguments themselves with the engine core in its own
  process (vLLM's default; seen on vLLM 0.32): the client encodes them out-of-band, but the
  engine core decodes a utility call's arguments without their types, so a tensor reaches it
  as a `[dtype, shape, buffer or buffer index]` list, not a tensor (its out-of-band buffer
  dropped; a small inline one then fails to pickle on its way to the workers: "cannot pickle
  memoryview objects"). A `bytes` argument would pass, and is what this replaces: msgspec
  refuses one over 4 GiB, and it is a whole extra host copy per worker.
- A `collective` publish is received by every worker itself from the learner's process group;
  only the manifest crosses `collective_rpc`.

Both ends of the shared-memory handoff are here, so the layout is defined once.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from services.weights.base import TensorSpec, WeightGroup, WeightsManifest
from services.weights.buckets import bucket_nbytes, unpack_bucket

# tmpfs: a file there is memory that another process maps without a copy.
SHARED_DIR = "/dev/shm"
FILE_PREFIX = "kpo-weights-"


def shared_dir() -> str:
    """Where shared buckets are written: /dev/shm, or the temp directory where there is none."""
    if os.path.isdir(SHARED_DIR) and os.access(SHARED_DIR, os.W_OK):
        return SHARED_DIR
    return tempfile.gettempdir()


# --- wire forms (what collective_rpc carries) ---------------------------------------------------


def specs_to_wire(specs: Sequence[TensorSpec]) -> list[list[Any]]:
    return [[spec.name, list(spec.shape), spec.dtype] for spec in specs]


def specs_from_wire(wire: Sequence[Sequence[Any]]) -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(str(name), tuple(int(size) for size in shape), str(dtype))
        for name, shape, dtype in wire
    )


def manifest_to_wire(manifest: WeightsManifest) -> dict[str, Any]:
    return {
        "version": manifest.version,
        "buckets": [specs_to_wire(bucket) for bucket in manifest.buckets],
        "aliases": dict(manifest.aliases),
    }


def manifest_from_wire(wire: Mapping[str, Any]) -> WeightsManifest:
    return WeightsManifest(
        version=int(wire["version"]),
        buckets=tuple(specs_from_wire(bucket) for bucket in wire["buckets"]),
        aliases={str(alias): str(name) for alias, name in wire["aliases"].items()},
    )


def group_to_wire(group: WeightGroup) -> dict[str, Any]:
    return {
        "address": group.address,
        "world_size": group.world_size,
        "backend": group.backend,
        "generation": group.generation,
    }


def group_from_wire(wire: Mapping[str, Any]) -> WeightGroup:
    backend = str(wire["backend"])
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"weight group backend must be 'nccl' or 'gloo', got {backend!r}")
    return WeightGroup(
        address=str(wire["address"]),
        world_size=int(wire["world_size"]),
        backend="nccl" if backend == "nccl" else "gloo",
        generation=int(wire["generation"]),
    )


# --- shared-memory buckets ----------------------------------------------------------------------


@dataclass(frozen=True)
class SharedBucket:
    """A packed bucket in a shared-memory file: what a worker needs to map it."""

    path: str
    nbytes: int
    specs: tuple[TensorSpec, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"path": self.path, "nbytes": self.nbytes, "specs": specs_to_wire(self.specs)}


@contextlib.contextmanager
def shared_bucket(
    tensors: Sequence[Tensor], specs: Sequence[TensorSpec], directory: str | None = None
) -> Iterator[SharedBucket]:
    """Write `tensors` (in `specs` order, checked by the caller) into a new shared file; remove
    it on exit. One copy per tensor, straight into its slot (any device: copied to the host)."""
    nbytes = bucket_nbytes(specs)
    fd, path = tempfile.mkstemp(prefix=FILE_PREFIX, dir=directory or shared_dir())
    try:
        try:
            # Reserve the pages now: a full tmpfs then fails here with ENOSPC, instead of a
            # SIGBUS at the first write into the mapping.
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
        flat = _map(path, nbytes)
        for view, tensor in zip(unpack_bucket(flat, specs).values(), tensors, strict=True):
            view.copy_(tensor.detach())
        del flat  # unmapped; the file keeps the bytes for the workers
        yield SharedBucket(path, nbytes, tuple(specs))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def open_shared_bucket(wire: Mapping[str, Any]) -> dict[str, Tensor]:
    """name -> a read-only-by-convention view of the shared file `wire` describes (a worker's
    side: mapped, not copied; the mapping lives as long as the views)."""
    specs = specs_from_wire(wire["specs"])
    nbytes = int(wire["nbytes"])
    path = str(wire["path"])
    size = os.path.getsize(path)
    if size != nbytes or bucket_nbytes(specs) != nbytes:
        raise ValueError(
            f"shared bucket {path} holds {size} bytes, expected {nbytes} for its "
            f"{len(specs)} tensors"
        )
    return unpack_bucket(_map(path, nbytes), specs)


def _map(path: str, nbytes: int) -> Tensor:
    # A zero-byte mapping is an error to mmap; a bucket of empty tensors needs none.
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
