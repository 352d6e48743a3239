"""Buckets of weights: which tensors travel together, and one flat byte tensor per bucket.

A bucket is packed as the raw bytes of its tensors, in manifest order, each starting at a
multiple of `ALIGN` bytes, so that unpacking is a view per tensor (`Tensor.view(dtype)` needs
its byte offset to be a multiple of the dtype's size), whatever the dtypes (bfloat16 included,
which numpy has no type for). The plan and the layout only need the `TensorSpec`s, so a sender
and a receiver that hold the same manifest agree on every offset without exchanging any.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from services.weights.base import TensorSpec, WeightsManifest

# Every dtype's size divides it (complex128: 16), and 64 is a cache line.
ALIGN = 64


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def bucket_layout(specs: Sequence[TensorSpec]) -> tuple[list[int], int]:
    """(byte offset of each tensor, total bytes) of a bucket of `specs` packed in order."""
    offsets: list[int] = []
    end = 0
    for spec in specs:
        start = _aligned(end)
        offsets.append(start)
        end = start + spec.nbytes
    return offsets, end


def bucket_nbytes(specs: Sequence[TensorSpec]) -> int:
    """Bytes of the packed bucket of `specs` (its tensors and the alignment between them)."""
    return bucket_layout(specs)[1]


def plan_buckets(
    specs: Sequence[TensorSpec], bucket_bytes: int
) -> tuple[tuple[TensorSpec, ...], ...]:
    """Group `specs`, in order, into buckets whose packed size stays within `bucket_bytes`.

    A tensor larger than a bucket gets a bucket of its own (tensors are never split: a
    receiver loads whole tensors).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    if not specs:
        raise ValueError("no tensors to plan buckets for")
    names = [spec.name for spec in specs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"tensor names repeat: {duplicates}")
    buckets: list[tuple[TensorSpec, ...]] = []
    current: list[TensorSpec] = []
    for spec in specs:
        if current and bucket_nbytes([*current, spec]) > bucket_bytes:
            buckets.append(tuple(current))
            current = []
        current.append(spec)
    buckets.append(tuple(current))
    return tuple(buckets)


def _same_layout(tensors: Sequence[Tensor], offsets: Sequence[int], total: int) -> Tensor | None:
    """The flat tensor `tensors` are already views of, laid out as a packed bucket; else None.

    A publisher that gathers each tensor straight into its slot of one flat buffer
    (`unpack_bucket` of an empty buffer) hands over views, and packing them again would hold
    the bucket twice.
    """
    storage = tensors[0].untyped_storage()
    if storage.nbytes() != total:
        return None
    for tensor, offset in zip(tensors, offsets, strict=True):
        if (
            tensor.untyped_storage().data_ptr() != storage.data_ptr()
            or not tensor.is_contiguous()
            or tensor.storage_offset() * tensor.element_size() != offset
        ):
            return None
    flat = torch.empty(0, dtype=torch.uint8, device=tensors[0].device)
    return flat.set_(storage)


def _spec_of(tensor: Tensor, index: int) -> TensorSpec:
    return TensorSpec(f"#{index}", tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


def _layout_of(tensors: Sequence[Tensor]) -> tuple[list[int], int]:
    """`bucket_layout` of a bucket's tensors, which must be some, all on one device."""
    if not tensors:
        raise ValueError("cannot pack an empty bucket")
    devices = {tensor.device for tensor in tensors}
    if len(devices) > 1:
        names = sorted(map(str, devices))
        raise ValueError(f"a bucket's tensors must share one device, got {names}")
    return bucket_layout([_spec_of(t, i) for i, t in enumerate(tensors)])


def pack_bucket(tensors: Sequence[Tensor], into: Tensor | None = None) -> Tensor:
    """One flat uint8 tensor of `tensors`' bytes (layout: `bucket_layout`), on their device,
    or in the first bytes of `into` (a 1-D uint8 buffer at least that large, on any device).

    Tensors that already are the views of one packed buffer (see `_same_layout`) give back that
    buffer itself, sharing their memory, where no `into` is given; anything else is copied.
    """
    offsets, total = _layout_of(tensors)
    if into is None:
        packed = _same_layout(tensors, offsets, total)
        if packed is not None:
            return packed
        flat = torch.zeros(total, dtype=torch.uint8, device=tensors[0].device)
    else:
        if into.dtype != torch.uint8 or into.dim() != 1 or into.numel() < total:
            raise ValueError(f"a buffer of {into.numel()} {into.dtype} cannot hold {total} bytes")
        flat = into[:total]
    end = 0  # where the bytes copied so far end: a reused buffer's gaps are zeroed
    for tensor, offset in zip(tensors, offsets, strict=True):
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if into is not None and offset > end:
            flat[end:offset].zero_()
        flat[offset : offset + raw.numel()].copy_(raw)
        end = offset + raw.numel()
    if into is not None:
        flat[end:].zero_()
    return flat


class HostPacker:
    """Packs a sender's buckets, one after another, into one host buffer it reuses (grown to the
    largest): a fresh buffer of hundreds of MB per bucket costs its page faults each time, more
    than the copy into it. Each packed bucket is valid until the next `pack`."""

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def pack(self, tensors: Sequence[Tensor]) -> Tensor:
        """`tensors` packed on the host (`pack_bucket`); host tensors that already are the views
        of one packed buffer give back that buffer, as `pack_bucket` does."""
        offsets, total = _layout_of(tensors)
        if tensors[0].device.type == "cpu":
            packed = _same_layout(tensors, offsets, total)
            if packed is not None:
                return packed
        if self._buffer is None or self._buffer.numel() < total:
            self._buffer = None  # let go of the smaller one first
            self._buffer = torch.empty(total, dtype=torch.uint8)
        return pack_bucket(tensors, into=self._buffer)


def unpack_bucket(flat: Tensor, specs: Sequence[TensorSpec]) -> dict[str, Tensor]:
    """name -> a view of `flat` with the spec's shape and dtype (no copy: the views share
    `flat`'s memory, so writing into them fills `flat`)."""
    offsets, total = bucket_layout(specs)
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(
            f"a packed bucket is a 1-D uint8 tensor, got {flat.dtype} of shape {tuple(flat.shape)}"
        )
    if flat.numel() != total:
        names = [spec.name for spec in specs]
        raise ValueError(
            f"packed bucket holds {flat.numel()} bytes, its specs need {total} ({names[:3]}...)"
        )
    out: dict[str, Tensor] = {}
    for spec, offset in zip(specs, offsets, strict=True):
        raw = flat[offset : offset + spec.nbytes]
        out[spec.name] = raw.view(spec.torch_dtype).view(spec.shape)
    return out


def bucket_tensors(bucket: Mapping[str, Tensor], specs: Sequence[TensorSpec]) -> list[Tensor]:
    """`bucket`'s tensors in `specs` order, checked against them (names, shapes, dtypes)."""
    expected = [spec.name for spec in specs]
    if sorted(bucket) != sorted(expected):
        missing = sorted(set(expected) - set(bucket))
        unexpected = sorted(set(bucket) - set(expected))
        raise ValueError(
            f"bucket does not match its manifest: missing {missing}, unexpected {unexpected}"
        )
    tensors = []
    for spec in specs:
        tensor = bucket[spec.name]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.torch_dtype:
            raise ValueError(
                f"tensor {spec.name!r}: got {tensor.dtype} {tuple(tensor.shape)}, manifest says "
                f"{spec.dtype} {spec.shape}"
            )
        tensors.append(tensor)
    return tensors


def checked_buckets(
    manifest: WeightsManifest, buckets: Iterable[Mapping[str, Tensor]]
) -> Iterator[tuple[int, list[Tensor], tuple[TensorSpec, ...]]]:
    """(index, tensors in manifest order, specs) of each bucket a sender is given, checked
    against `manifest`: each bucket's tensors (`bucket_tensors`) and their count (ValueError).

    Senders hold one bucket at a time: a bucket is let go here before the next is taken, and a
    caller deletes its tensors before asking for the next. (A plain loop over `enumerate` would
    not do: its reused result tuple keeps the previous item alive while the next is made.)
    """
    expected = len(manifest.buckets)
    index = 0
    for bucket in buckets:
        if index >= expected:
            raise ValueError(f"more buckets than the manifest's {expected}")
        specs = manifest.buckets[index]
        tensors = bucket_tensors(bucket, specs)
        del bucket
        yield index, tensors, specs
        del tensors
        index += 1
    if index != expected:
        raise ValueError(f"got {index} buckets, the manifest has {expected}")


def packed_buckets(
    manifest: WeightsManifest,
    buckets: Iterable[Mapping[str, Tensor]],
    pack: Callable[[Sequence[Tensor]], Tensor],
) -> Iterator[Tensor]:
    """Each bucket a sender is given, checked (`checked_buckets`) and packed by `pack`. A
    bucket's tensors and its packed bytes are let go before the next bucket is asked for (a
    generator expression would keep the last tensors bound while the next is gathered)."""
    for _, tensors, _ in checked_buckets(manifest, buckets):
        flat = pack(tensors)
        del tensors
        yield flat
        del flat
