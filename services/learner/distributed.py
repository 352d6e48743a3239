"""The learner group's torch.distributed process group and the few collectives the step uses.

Ranks join through a TCP rendezvous at rank 0's address (`rendezvous_address`, asked of rank 0
by the driver and handed to every rank): NCCL on GPUs, gloo on CPU. A `single` learner has no
process group, and every collective here is then the identity, so the step's code is one path.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def rendezvous_address() -> str:
    """tcp://<this node's IP>:<a free port>, for rank 0 to serve the rendezvous on."""
    import ray

    host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return f"tcp://{host}:{port}"


@dataclass(frozen=True)
class RankGroup:
    """This process's place in the learner group; collectives over the group."""

    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def join(self, address: str, device: torch.device, timeout_s: float) -> None:
        """Join the process group at `address` (blocks until every rank has joined); "": none.

        An FSDP2 learner of one rank has a process group of one (FSDP2 needs one).
        """
        if not address:
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=address,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
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
        """Every rank's `item` (picklable), in rank order, on every rank."""
        if not self.distributed:
            return [item]
        items: list[Any] = [None] * self.world_size
        dist.all_gather_object(items, item)
        return items

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()
