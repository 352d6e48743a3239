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

No path builds one payload proportional to the model: the largest message is one bucket (or one
tensor larger than a bucket).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

WeightTransportName = Literal["object_store", "collective"]


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


@dataclass(frozen=True)
class WeightGroup:
    """Where a collective weight group meets: learner rank 0 is group rank 0, every receiving
    process of the generation workers one of ranks 1 .. world_size - 1."""

    address: str  # host:port of the TCPStore that learner rank 0 serves
    world_size: int
    backend: Literal["nccl", "gloo"]
    generation: int  # counts re-formations (a replaced worker re-forms the group)


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
