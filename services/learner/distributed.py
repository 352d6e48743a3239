"""The learner group's torch.distributed process group and the few collectives the step uses.

Ranks join through a TCP rendezvous at rank 0's address (`rendezvous_address`, asked of rank 0
by the driver and handed to every rank): NCCL on GPUs, gloo on CPU. A `single` learner has no
process group, and every collective here is then the identity, so the step's code is one path.

Rank 0 serves the rendezvous's TCPStore on exactly the address it announces (loopback when
the Ray cluster is one node: `services.weights.stores`), not on every interface as torch's
`tcp://` rendezvous does. The store itself authenticates nobody; with a key (handed to every
rank through Ray by the group's owner) the ranks prove to each other that they hold it once
the group is formed, so a stranger who took a rank's place at the rendezvous is refused before
any step. Nothing a peer sends is unpickled: `gather` moves JSON and raw tensor bytes.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from services.weights import auth
from services.weights.collective import process_group_construction
from services.weights.stores import serve_store, serving_host


def rendezvous_address() -> str:
    """tcp://<host>:<a free port>, for rank 0 to serve the rendezvous on: host is loopback on a
    one-node Ray cluster, else this node's IP."""
    host = serving_host()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _rendezvous_store(address: str, rank: int, world_size: int, timeout: timedelta) -> Store:
    """The rendezvous's store at `address` (tcp://host:port): served by rank 0 on that address
    only, joined by the others; returns once every rank has come (or raises at `timeout`)."""
    where = urlsplit(address)
    if where.scheme != "tcp" or where.hostname is None or where.port is None:
        raise ValueError(f"a learner rendezvous address is tcp://host:port, got {address!r}")
    if rank == 0:
        store: Store = serve_store(
            where.hostname, where.port, world_size, timeout, wait_for_workers=True
        )
    else:
        store = TCPStore(where.hostname, where.port, world_size, is_master=False, timeout=timeout)
    return PrefixStore("default_pg", store)


@dataclass(frozen=True)
class RankGroup:
    """This process's place in the learner group; collectives over the group."""

    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def join(self, address: str, device: torch.device, timeout_s: float, key: bytes = b"") -> None:
        """Join the process group at `address` (blocks until every rank has joined); "": none.
        `key`: the group's secret (handed to every rank through Ray); with one, every rank
        checks that all the others hold it (RuntimeError naming those that do not).

        An FSDP2 learner of one rank has a process group of one (FSDP2 needs one).
        """
        if not address:
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        store = _rendezvous_store(address, self.rank, self.world_size, timeout)
        # Under the lock the weight group holds while it sets NCCL's error handling around its
        # own construction (services.weights.collective): built meanwhile, this group would
        # take that value. Taken for gloo too, one rule for either backend: the weight group
        # holds it only while it constructs an NCCL group, which returns at once (NCCL
        # connects lazily), so a join waits for it no longer than that.
        with process_group_construction():
            dist.init_process_group(
                backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
            )
        if key:
            self._check_members(address, key)

    def _device(self) -> torch.device:
        """Where this group's collectives take their tensors (NCCL: the current GPU)."""
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _check_members(self, address: str, key: bytes) -> None:
        """Every rank shows a tag of its rank under `key`; RuntimeError unless all verify."""
        device = self._device()

        def proof(rank: int) -> bytes:
            return auth.tag(key, ["learner-member", address, rank], b"")

        mine = torch.frombuffer(bytearray(proof(self.rank)), dtype=torch.uint8).to(device)
        shown = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(shown, mine)
        strangers = [
            rank
            for rank, tag in enumerate(shown)
            if not auth.verify(key, ["learner-member", address, rank], b"", _bytes(tag))
        ]
        if strangers:
            self.leave()
            raise RuntimeError(
                f"learner group at {address}: ranks {strangers} do not hold the group's key "
                "(a stranger took their place at the rendezvous): refused"
            )

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def sum(self, tensor: Tensor) -> Tensor:
        """The element-wise sum of `tensor` over the ranks (in place, and returned)."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def max(self, tensor: Tensor) -> Tensor:
        """The element-wise max of `tensor` over the ranks (in place, and returned)."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def sum_floats(self, values: list[float], device: torch.device) -> list[float]:
        """Sum a few Python floats over the ranks (float64 on the collective's device)."""
        summed = self.sum(torch.tensor(values, dtype=torch.float64, device=device))
        return [float(v) for v in summed.tolist()]

    def gather(self, item: Any) -> list[Any]:
        """Every rank's `item`, in rank order, on every rank. `item`: JSON values (dicts with
        str keys, lists, str, int, float, bool, None) and tensors at any depth (tuples come
        back as lists, tensors on the CPU). Nothing is pickled: each rank's item crosses as
        JSON and raw tensor bytes (`encode_gathered`), padded to the longest."""
        if not self.distributed:
            return [item]
        payload = encode_gathered(item)
        device = self._device()
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        lengths = [int(length.item()) for length in sizes]
        mine = torch.zeros(max(lengths), dtype=torch.uint8)
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        mine = mine.to(device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        return [
            decode_gathered(_bytes(got[:length]))
            for got, length in zip(everyone, lengths, strict=True)
        ]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def _bytes(tensor: Tensor) -> bytes:
    return bytes(tensor.cpu().numpy().tobytes())


# --- gather's payload: JSON and raw tensor bytes, no pickle ---------------------------------------

_MAGIC = b"kpo-gather/1\n"
_TENSOR = "$tensor"
_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
}


def encode_gathered(item: Any) -> bytes:
    """`item` (JSON values and tensors) as bytes: a magic line, the JSON tree's length (8
    bytes) and the tree, each tensor a {"$tensor": [dtype, shape]} leaf, then every tensor's
    raw bytes in the tree's order. TypeError for anything else."""
    blobs: list[bytes] = []

    def walk(value: Any) -> Any:
        if isinstance(value, Tensor):
            tensor = value.detach().to("cpu").contiguous()
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise TypeError(f"gather moves tensors of {sorted(_DTYPES)}, not {dtype}")
            blobs.append(_bytes(tensor.reshape(-1).view(torch.uint8)))
            return {_TENSOR: [dtype, list(tensor.shape)]}
        if isinstance(value, dict):
            if _TENSOR in value or not all(isinstance(key, str) for key in value):
                raise TypeError(f"gather moves dicts of str keys other than {_TENSOR!r}")
            return {key: walk(inner) for key, inner in value.items()}
        if isinstance(value, list | tuple):
            return [walk(inner) for inner in value]
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise TypeError(f"gather moves JSON values and tensors, not {type(value).__name__}")

    tree = json.dumps(walk(item)).encode()
    return _MAGIC + len(tree).to_bytes(8, "little") + tree + b"".join(blobs)


def decode_gathered(payload: bytes) -> Any:
    """The item `encode_gathered` made `payload` of; ValueError naming what is wrong with a
    payload it did not make (nothing in it is executed: JSON, and bytes read as numbers)."""
    if not payload.startswith(_MAGIC) or len(payload) < len(_MAGIC) + 8:
        raise ValueError("not a gathered payload (no kpo-gather header)")
    start = len(_MAGIC) + 8
    end = start + int.from_bytes(payload[len(_MAGIC) : start], "little")
    if end > len(payload):
        raise ValueError("gathered payload: its JSON tree runs past its end")
    try:
        tree = json.loads(payload[start:end])
    except (ValueError, RecursionError) as error:
        raise ValueError(f"gathered payload: unreadable JSON tree ({error})") from error
    offset = end

    def tensor(spec: Any) -> Tensor:
        nonlocal offset
        dtype, shape = _tensor_spec(spec)
        count = 1
        for size in shape:
            count *= size
        nbytes = count * dtype.itemsize
        if offset + nbytes > len(payload):
            raise ValueError("gathered payload: a tensor's bytes run past its end")
        raw = torch.empty(0, dtype=torch.uint8)
        if nbytes:  # frombuffer refuses an empty buffer
            chunk = bytearray(payload[offset : offset + nbytes])
            raw = torch.frombuffer(chunk, dtype=torch.uint8)
        offset += nbytes
        return raw.view(dtype).reshape(shape)

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if _TENSOR in node:
                return tensor(node[_TENSOR])
            return {key: walk(inner) for key, inner in node.items()}
        if isinstance(node, list):
            return [walk(inner) for inner in node]
        return node

    value = walk(tree)
    if offset != len(payload):
        raise ValueError(f"gathered payload: {len(payload) - offset} bytes past its last tensor")
    return value


def _tensor_spec(spec: Any) -> tuple[torch.dtype, list[int]]:
    """(dtype, shape) of a tensor leaf; ValueError for a dtype or shape it cannot be."""
    if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[1], list)):
        raise ValueError(f"gathered payload: a tensor leaf is [dtype, shape], got {spec!r}")
    dtype, shape = spec
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"gathered payload: unknown dtype {dtype!r}")
    if not all(
        isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape
    ):
        raise ValueError(f"gathered payload: bad shape {shape!r}")
    return _DTYPES[dtype], shape
