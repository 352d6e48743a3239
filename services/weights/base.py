"""What every weight transport shares: the manifest of a published version and the offer.

A learner publishes version v as a manifest (names, shapes and dtypes of every tensor, grouped
into buckets of about `pipeline.weight_bucket_mb`) and the tensors themselves, bucket by bucket:

- `object_store`: each bucket is one object in Ray's object store (the bucket packed into one
  flat uint8 numpy array, which Ray serialises out-of-band; Ray pickles a torch tensor in-band);
  the offer carries the bucket refs, and a worker fetches one bucket at a time
  (`object_store.fetch_buckets`).
- `collective`: the buckets are broadcast from learner rank 0 over a torch.distributed group
  that every generation worker's receiving processes joined (`WeightGroup`); the manifest
  travels ahead through Ray, so every receiver allocates its buckets before the broadcast.
  Where every rank sits on one GPU (a learner colocated with its engines) NCCL cannot form the
  group (it refuses two ranks on one device): the group hands each bucket over as a CUDA IPC
  handle instead (`services.weights.ipc`), behind the same `Channel`.

No path builds one payload proportional to the model: the largest message is one bucket (or one
tensor larger than a bucket).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

WeightTransportName = Literal["object_store", "collective"]
# How a collective weight group moves bytes: NCCL broadcast (GPUs), gloo broadcast (CPU), or
# shared-memory handles between processes of one device (`services.weights.ipc`).
WeightGroupBackend = Literal["nccl", "gloo", "ipc"]
WEIGHT_GROUP_BACKENDS: tuple[WeightGroupBackend, ...] = ("nccl", "gloo", "ipc")


def group_backend(name: str) -> WeightGroupBackend:
    """`name` as a weight group backend; ValueError naming the choices otherwise."""
    for backend in WEIGHT_GROUP_BACKENDS:
        if name == backend:
            return backend
    raise ValueError(f"weight group backend must be one of {WEIGHT_GROUP_BACKENDS}, got {name!r}")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a published version, as it is sent (the compute dtype, full shape)."""

    name: str  # the Hugging Face name (what `load_state_dict` and vLLM's `load_weights` take)
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {self.name!r}: unknown dtype {self.dtype!r}")
        return dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.torch_dtype.itemsize


@dataclass(frozen=True)
class WeightsManifest:
    """The tensors of one published version, in the order they are sent, bucket by bucket."""

    version: int
    buckets: tuple[tuple[TensorSpec, ...], ...]
    # Tied names (alias -> the name sent): e.g. lm_head.weight -> model.embed_tokens.weight.
    aliases: Mapping[str, str] = field(default_factory=dict)

    def names(self) -> list[str]:
        """Every name a receiver ends up with, aliases included."""
        return [spec.name for bucket in self.buckets for spec in bucket] + list(self.aliases)

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for bucket in self.buckets for spec in bucket)


class StateDictMismatchError(ValueError):
    """Weights whose names or shapes do not match the model they are loaded into."""


class WeightGroupError(RuntimeError):
    """A collective of a weight group failed: a peer died, left, or did not answer in time.
    The group is unusable afterwards (its ranks are out of step): close it and form another."""


class WeightAuthenticationError(WeightGroupError):
    """A message of a weight group failed its authentication check (`services.weights.auth`):
    written by someone who does not hold the group's key, or altered on the way. Nothing of it
    was loaded; the end that refused it has closed its channel (form another group)."""


# A publish's header: three int64 (version, buckets, bytes), as every channel announces it.
HEADER_BYTES = 24


def header_values(manifest: WeightsManifest) -> list[int]:
    """What a publish announces first: version, bucket count, bytes."""
    return [manifest.version, len(manifest.buckets), manifest.nbytes]


def check_header(received: Sequence[int], manifest: WeightsManifest) -> None:
    """RuntimeError unless the announced publish is the one `manifest` describes."""
    if list(received) != header_values(manifest):
        version, buckets, nbytes = received
        raise RuntimeError(
            f"weight group sent version {version} ({buckets} buckets, {nbytes} bytes), "
            f"expected version {manifest.version} ({len(manifest.buckets)} buckets, "
            f"{manifest.nbytes} bytes)"
        )


@dataclass(frozen=True)
class WeightGroup:
    """Where a collective weight group meets: learner rank 0 is group rank 0, every receiving
    process of the generation workers one of ranks 1 .. world_size - 1."""

    address: str  # host:port of the TCPStore that learner rank 0 serves
    world_size: int
    backend: WeightGroupBackend
    generation: int  # counts re-formations (a replaced worker re-forms the group)
    # The group's secret: 32 random bytes made by rank 0 (`collective.open_weight_group`), which
    # authenticate every message of the group (`services.weights.auth`). It reaches the members
    # inside this object, through Ray's calls, and is never written to the group's store; kept
    # out of the repr, so logs and error messages do not show it.
    key: bytes = field(default=b"", repr=False)
    # Delta publishes (`pipeline.weight_delta`): after a group's first send, each bucket travels
    # as a patch against the version the group sent before (services/weights/delta.py); every
    # member's channel holds that version's buckets on the host. A new group starts dense.
    delta: bool = False

    def member(self, rank: int) -> str:
        """How errors name `rank` of this group."""
        return f"weight group {self.address} (generation {self.generation}), rank {rank}"


PatchEncoding = Literal["dense", "sparse", "xor"]
PATCH_ENCODINGS: tuple[PatchEncoding, ...] = ("dense", "sparse", "xor")


@dataclass(frozen=True)
class PatchHeader:
    """A delta publish's patch of one bucket (services/weights/delta.py), less its payload:
    bucket `index` of `version`, in `encoding`, applied to the receiver's copy of
    `base_version` (-1: dense, applies to anything), giving `nbytes` bytes whose digest is
    `digest`."""

    index: int
    encoding: PatchEncoding
    version: int
    base_version: int
    nbytes: int
    digest: str
    changed: float  # fraction of the bucket's words that changed (1.0 for a first dense)
    payload_bytes: int  # what travels


@dataclass(frozen=True)
class WeightsOffer:
    """What the driver hands a generation worker for version `manifest.version`.

    `object_store`: `bucket_refs[i]` is a Ray ObjectRef of bucket i, packed (read it with
    `object_store.fetch_buckets`, which yields name -> tensor).
    The offer itself is passed inside a list, so Ray does not fetch anything on arrival.
    `collective`: no refs; the worker receives the buckets when the learner sends them.
    """

    transport: WeightTransportName
    manifest: WeightsManifest
    bucket_refs: tuple[Any, ...] = ()
    # Delta publishes (object_store): each bucket ref holds the payload of its patch here, to
    # apply to the worker's copy of the version before (services/weights/delta.py); empty:
    # the refs hold the buckets whole. `source` answers `dense_offer(at_least)` (learner rank
    # 0) for a worker that cannot apply them, and so do `peers`: surviving workers that hold
    # the version, named for a replacement (services/weights/sources.py asks the nearest).
    patches: tuple[PatchHeader, ...] = ()
    source: Any = None
    peers: tuple[Any, ...] = ()

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def sent_bytes(self) -> int:
        """Bytes the offer's buckets hold (its patches' payloads, or the buckets whole)."""
        if self.patches:
            return sum(patch.payload_bytes for patch in self.patches)
        return self.manifest.nbytes

    @property
    def changed_fraction(self) -> float:
        """Fraction of the weights' bytes that changed since the version before (1.0: sent
        whole)."""
        if not self.patches:
            return 1.0
        total = sum(patch.nbytes for patch in self.patches)
        return sum(patch.changed * patch.nbytes for patch in self.patches) / max(total, 1)


class Channel(Protocol):
    """One rank's end of a weight group (`collective.connect`): rank 0 sends, the others
    receive. `messages` lists the bytes of every message this end took part in, in order."""

    group: WeightGroup
    rank: int
    messages: list[int]
    # Of the last publish this end sent: the fraction of its bytes that changed since the one
    # before (1.0 where it was sent whole).
    changed_fraction: float

    def send(self, manifest: WeightsManifest, buckets: Iterable[dict[str, torch.Tensor]]) -> None:
        """Hand every bucket of `manifest`'s version to every receiver (rank 0)."""

    def receive(
        self, manifest: WeightsManifest, device: torch.device | str | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The buckets rank 0 sends for `manifest`, one at a time; every one must be taken."""

    def close(self) -> None:
        """Leave the group (idempotent)."""
