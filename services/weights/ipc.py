"""The `ipc` weight group: buckets handed over as shared-memory handles, for ranks on one device.

NCCL refuses two ranks on one GPU, and a learner colocated with its vLLM engines on one GPU is
exactly that. There learner rank 0 packs each bucket on the GPU and hands every receiver a CUDA
IPC handle of it (torch's own reduction of a CUDA tensor: the allocation's cudaIpcMemHandle,
the offset and size within it, and the event of the packing copy) instead of broadcasting the
bytes; each receiver maps that memory, loads the bucket from it (a GPU-to-GPU copy within one
device, nothing through the host) and acknowledges, and rank 0 drops the bucket once every
receiver has acknowledged it. A bucket packed on the CPU travels the same way as a file in
shared memory (`services.weights.shared_memory`), which is how tests run this protocol on a
machine without a GPU. The handle's kind follows the device of the bucket; a receiver maps
either kind.

Handles, headers and acknowledgements go through the group's TCPStore (the one the collective
transport's ranks meet at), under the group's prefix, one key per message, as JSON (no pickle:
the store is a network service), each sealed with the group's key (`services.weights.auth`: a
tag naming the store key, checked on the raw value before it is parsed). Per publish, with n
counting the channel's publishes:

    n/header         rank 0: version, buckets, bytes (checked by each receiver, as a broadcast
                     header is)
    n/i              rank 0: the handle of bucket i and the digest of its content (taken by
                     rank 0 where the bytes are; each receiver takes it again over the memory
                     it mapped and loads nothing unless both match; of a CUDA bucket, whose
                     bytes the host does not read, the digest covers its length only: its
                     handle, sealed with the rest, is what is authenticated)
    n/i/ack/r        receiver r: done with bucket i (its load finished; on CUDA, synchronised)

A value that fails its check (a stranger's write, a genuine value moved to another key, a
handle to other bytes) closes the end that read it and raises `WeightAuthenticationError`
naming the store key; nothing of it is mapped or loaded.

Every wait of a publish is bounded by the group's timeout: a receiver that dies or stalls makes
`send` raise `WeightGroupError`, as a broadcast does. A receiver keeps the views of a bucket
until it asks for the next one, so rank 0 may hold that bucket's memory one bucket longer (CUDA
frees an allocation only once every process that mapped it has unmapped it).

`collective.connect` picks this channel: for a group opened as `ipc`, and for an NCCL group
whose ranks all report the same GPU (its UUID). It hands the channel over once every rank has
joined (its rendezvous, bounded by the join deadline, is every transport's).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch._C._distributed_c10d import Store

from services.weights import auth
from services.weights.base import (
    HEADER_BYTES,
    TensorSpec,
    WeightAuthenticationError,
    WeightGroup,
    WeightGroupError,
    WeightsManifest,
    check_header,
    header_values,
)
from services.weights.buckets import bucket_nbytes, checked_buckets, pack_bucket, unpack_bucket
from services.weights.shared_memory import map_shared_flat, shared_bucket

# --- handles ------------------------------------------------------------------------------------

# The fields of torch's reduction of a CUDA tensor (`torch.multiprocessing.reductions.
# reduce_tensor`), in order, and how each crosses as JSON. Classes and the dtype are fixed (a
# packed bucket is a flat uint8 tensor), the device travels as the GPU's UUID (an index means a
# different GPU in a process with other CUDA_VISIBLE_DEVICES), bytes as hex.
_CUDA_FIELDS = (
    "tensor_cls",
    "size",
    "stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
_CUDA_BYTES = ("storage_handle", "ref_counter_handle", "event_handle")
_CUDA_INTS = ("tensor_offset", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset")


def cuda_handle_to_wire(reduction: Sequence[Any], device_uuid: str) -> dict[str, Any]:
    """The JSON form of `reduce_tensor`'s arguments for a flat uint8 CUDA tensor."""
    if len(reduction) != len(_CUDA_FIELDS):
        raise ValueError(
            f"a CUDA tensor reduction has {len(_CUDA_FIELDS)} fields, got {len(reduction)}"
        )
    fields = dict(zip(_CUDA_FIELDS, reduction, strict=True))
    if fields["dtype"] != torch.uint8 or len(fields["size"]) != 1:
        raise ValueError(f"only a flat uint8 bucket is handed over, got {fields['dtype']}")
    wire: dict[str, Any] = {"kind": "cuda", "device_uuid": device_uuid}
    wire["numel"] = int(fields["size"][0])
    wire["event_sync_required"] = bool(fields["event_sync_required"])
    for name in _CUDA_INTS:
        wire[name] = int(fields[name])
    for name in _CUDA_BYTES:
        value = fields[name]
        wire[name] = None if value is None else bytes(value).hex()
    return wire


def cuda_rebuild_args(wire: dict[str, Any], device_index: int) -> tuple[Any, ...]:
    """The arguments of `rebuild_cuda_tensor` for a handle in JSON form, on local CUDA device
    `device_index` (the inverse of `cuda_handle_to_wire`)."""
    fields: dict[str, Any] = {
        "tensor_cls": torch.Tensor,
        "size": torch.Size([int(wire["numel"])]),
        "stride": (1,),
        "storage_cls": torch.storage.TypedStorage,
        "dtype": torch.uint8,
        "device": device_index,
        "requires_grad": False,
        "event_sync_required": bool(wire["event_sync_required"]),
    }
    for name in _CUDA_INTS:
        fields[name] = int(wire[name])
    for name in _CUDA_BYTES:
        value = wire[name]
        fields[name] = None if value is None else bytes.fromhex(value)
    return tuple(fields[name] for name in _CUDA_FIELDS)


def cuda_device_uuid(index: int) -> str:
    """The UUID of local CUDA device `index` (the same string in every process)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def local_cuda_index(device_uuid: str) -> int:
    """This process's index of the GPU with `device_uuid`; ValueError when it cannot see it."""
    for index in range(torch.cuda.device_count()):
        if cuda_device_uuid(index) == device_uuid:
            return index
    raise ValueError(f"GPU {device_uuid} is not visible to this process (CUDA_VISIBLE_DEVICES)")


@contextlib.contextmanager
def exported(
    tensors: Sequence[Tensor], specs: Sequence[TensorSpec]
) -> Iterator[tuple[dict[str, Any], bytes]]:
    """(the handle in JSON form, the content digest) of a packed bucket of `tensors`, valid
    until the block exits; the digest is taken over the bytes the handle points at.

    CUDA tensors: packed on their GPU, handed over as a CUDA IPC handle. CPU tensors: written
    into a shared-memory file, removed on exit (mappings made before stay valid).
    """
    device = tensors[0].device
    if device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        flat = pack_bucket(tensors)
        digest = auth.content_digest(flat)
        _, reduction = reduce_tensor(flat)  # type: ignore[no-untyped-call]
        try:
            yield cuda_handle_to_wire(reduction, cuda_device_uuid(flat.device.index)), digest
        finally:
            del flat
        return
    if device.type != "cpu":
        raise ValueError(f"an ipc weight group hands over CPU or CUDA buckets, not {device}")
    with shared_bucket(tensors, specs) as shared:
        digest = auth.content_digest(map_shared_flat(shared.path, shared.nbytes))
        yield {"kind": "shared_file", "path": shared.path, "nbytes": shared.nbytes}, digest


def opened_flat(handle: dict[str, Any], nbytes: int) -> Tensor:
    """The packed bucket of `nbytes` a handle (JSON form) points at, mapped into this process
    as one flat uint8 tensor (ValueError where it holds another size)."""
    kind = handle.get("kind")
    if kind == "shared_file":
        if int(handle["nbytes"]) != nbytes:
            raise ValueError(f"shared bucket of {handle['nbytes']} bytes, expected {nbytes}")
        return map_shared_flat(str(handle["path"]), nbytes)
    if kind == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if int(handle["numel"]) != nbytes:
            raise ValueError(f"CUDA bucket of {handle['numel']} bytes, expected {nbytes}")
        index = local_cuda_index(str(handle["device_uuid"]))
        flat: Tensor = rebuild_cuda_tensor(*cuda_rebuild_args(handle, index))  # type: ignore[no-untyped-call]
        return flat
    raise ValueError(f"unknown weight handle kind {kind!r}")


# --- the channel --------------------------------------------------------------------------------


@dataclass
class IpcChannel:
    """One rank's end of an ipc weight group (the `Channel` interface: rank 0 sends), made by
    `collective.connect` once every rank has joined."""

    group: WeightGroup
    rank: int
    store: Store | None
    timeout: timedelta
    # Bytes this end took part in, in order: each header, then each bucket handed over.
    messages: list[int] = field(default_factory=list)
    changed_fraction: float = 1.0  # an ipc group sends every publish whole
    publishes: int = 0

    def _fail(self, what: str, error: Exception) -> WeightGroupError:
        return WeightGroupError(
            f"{self.group.member(self.rank)}: {what} within "
            f"{self.timeout.total_seconds():g} s: {error}"
        )

    def _live_store(self) -> Store:
        if self.store is None:
            raise RuntimeError(f"weight group {self.group.address} is closed")
        return self.store

    def _wait(self, keys: list[str], what: str) -> None:
        try:
            self._live_store().wait(keys, self.timeout)
        except RuntimeError as error:  # torch's DistStoreError: a timeout, a closed store
            raise self._fail(what, error) from error

    def _put(self, key: str, value: Any) -> None:
        auth.post(self._live_store(), self.group, key, json.dumps(value).encode())

    def _read(self, key: str) -> Any:
        """The value under `key` (present), once its seal verified; else this end is closed and
        `WeightAuthenticationError` raised, nothing of the value parsed."""
        try:
            body = auth.read(self._live_store(), self.group, self.rank, key)
        except WeightAuthenticationError:
            self.close()
            raise
        return json.loads(body)

    def _take(self, key: str, what: str) -> Any:
        self._wait([key], what)
        return self._read(key)

    def send(self, manifest: WeightsManifest, buckets: Iterable[dict[str, Tensor]]) -> None:
        """Hand over `manifest`'s version bucket by bucket (rank 0; buckets in manifest order),
        each dropped once every receiver acknowledged it."""
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} of a weight group receives, only rank 0 sends")
        publish, self.publishes = self.publishes, self.publishes + 1
        self._put(f"{publish}/header", header_values(manifest))
        self.messages.append(HEADER_BYTES)
        receivers = range(1, self.group.world_size)
        for index, tensors, specs in checked_buckets(manifest, buckets):
            with exported(tensors, specs) as (handle, digest):
                self._put(f"{publish}/{index}", {"handle": handle, "digest": digest.hex()})
                acks = [f"{publish}/{index}/ack/{rank}" for rank in receivers]
                self._wait(acks, f"bucket {index} of version {manifest.version} not acknowledged")
                for ack in acks:  # a stranger's acknowledgement must not free the bucket early
                    self._read(ack)
            self.messages.append(bucket_nbytes(specs))
            del tensors
        self._forget(publish, len(manifest.buckets), receivers)

    def _forget(self, publish: int, buckets: int, receivers: range) -> None:
        """Delete a finished publish's keys (every receiver has read them all)."""
        store = self._live_store()
        keys = [f"{publish}/header"]
        for index in range(buckets):
            keys.append(f"{publish}/{index}")
            keys.extend(f"{publish}/{index}/ack/{rank}" for rank in receivers)
        for key in keys:
            store.delete_key(key)

    def receive(
        self, manifest: WeightsManifest, device: torch.device | str | None = None
    ) -> Iterator[dict[str, Tensor]]:
        """The buckets rank 0 hands over for `manifest`, one at a time, as views of the memory
        rank 0 packed them in (or copies on `device`, when given). The header is taken (and
        checked) before this returns; every bucket must then be taken (rank 0 waits for each
        one's acknowledgement until the timeout)."""
        if self.rank == 0:
            raise RuntimeError("rank 0 of a weight group sends; receivers are ranks >= 1")
        publish, self.publishes = self.publishes, self.publishes + 1
        header = self._take(f"{publish}/header", f"no header of publish {publish}")
        self.messages.append(HEADER_BYTES)
        check_header([int(value) for value in header], manifest)
        target = None if device is None else torch.device(device)
        return self._buckets(publish, manifest, target)

    def _buckets(
        self, publish: int, manifest: WeightsManifest, target: torch.device | None
    ) -> Iterator[dict[str, Tensor]]:
        for index, specs in enumerate(manifest.buckets):
            key = f"{publish}/{index}"
            message = self._take(key, f"no bucket {index} of publish {publish}")
            flat = opened_flat(message["handle"], bucket_nbytes(specs))
            if auth.content_digest(flat) != bytes.fromhex(message["digest"]):
                del flat
                self.close()
                raise auth.refused(
                    self.group,
                    self.rank,
                    f"store key '{auth.store_prefix(self.group)}/{key}'",
                    "the bytes its handle points at do not match the digest rank 0 signed",
                )
            bucket = unpack_bucket(flat, specs)
            del flat
            mapped_on = next(iter(bucket.values())).device
            if target is not None and target != mapped_on:
                bucket = {name: tensor.to(target) for name, tensor in bucket.items()}
            yield bucket
            del bucket
            if mapped_on.type == "cuda":
                # The loads that read the mapped memory ran on this process's streams: finish
                # them before rank 0 may free it.
                torch.cuda.synchronize(mapped_on)
            self._put(f"{publish}/{index}/ack/{self.rank}", 1)
            self.messages.append(bucket_nbytes(specs))

    def close(self) -> None:
        """Leave the group; idempotent (rank 0's store is stopped by `collective`)."""
        self.store = None
