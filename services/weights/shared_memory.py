"""Packed buckets in shared-memory files: one process writes a bucket, others on the host map it.

A file in tmpfs (`/dev/shm`) is memory that another process maps without a copy. The writer
lays the bucket out as a packed bucket (`services.weights.buckets`), so a reader needs only the
file's path and the bucket's specs, and reads each tensor as a view of the mapping. Used where
weights cross processes of one host that share no process group: into vLLM's worker processes
(`services.generation.vllm_transfer`) and by the `ipc` weight group on CPU
(`services.weights.ipc`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from services.weights.base import TensorSpec
from services.weights.buckets import bucket_nbytes, unpack_bucket

# tmpfs: a file there is memory that another process maps without a copy.
SHARED_DIR = "/dev/shm"
FILE_PREFIX = "kpo-weights-"


def shared_dir() -> str:
    """Where shared buckets are written: /dev/shm, or the temp directory where there is none."""
    if os.path.isdir(SHARED_DIR) and os.access(SHARED_DIR, os.W_OK):
        return SHARED_DIR
    return tempfile.gettempdir()


@dataclass(frozen=True)
class SharedBucket:
    """A packed bucket in a shared-memory file: what a reader needs to map it."""

    path: str
    nbytes: int
    specs: tuple[TensorSpec, ...]


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
        del flat  # unmapped; the file keeps the bytes for the readers
        yield SharedBucket(path, nbytes, tuple(specs))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def map_shared_bucket(shared: SharedBucket) -> dict[str, Tensor]:
    """name -> a read-only-by-convention view of the shared file (a reader's side: mapped, not
    copied; the mapping lives as long as the views)."""
    size = os.path.getsize(shared.path)
    if size != shared.nbytes or bucket_nbytes(shared.specs) != shared.nbytes:
        raise ValueError(
            f"shared bucket {shared.path} holds {size} bytes, expected {shared.nbytes} for its "
            f"{len(shared.specs)} tensors"
        )
    return unpack_bucket(_map(shared.path, shared.nbytes), shared.specs)


def map_shared_flat(path: str, nbytes: int) -> Tensor:
    """The whole packed bucket in the shared file `path`, mapped as one flat uint8 tensor
    (ValueError unless the file holds exactly `nbytes`)."""
    size = os.path.getsize(path)
    if size != nbytes:
        raise ValueError(f"shared bucket {path} holds {size} bytes, expected {nbytes}")
    return _map(path, nbytes)


def _map(path: str, nbytes: int) -> Tensor:
    # A zero-byte mapping is an error to mmap; a bucket of empty tensors needs none.
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
