"""Run a function on W real torch.distributed ranks (gloo on CPU, NCCL on CUDA), one process each.

On CPU the processes are forked, not spawned: a spawned one imports torch and transformers
afresh, which takes 10 to 30 s on a busy 2-core machine; a forked one starts at once. On CUDA
they are spawned, as they must be: CUDA cannot be used in a child forked after the parent
initialised it ("Cannot re-initialize CUDA in forked subprocess"), and the parent of a GPU test
usually has. A spawned child unpickles the function and its arguments, so both must be defined
at a module's top level. Each rank sets one torch thread first thing (a forked child must not
use the parent's thread pool) and joins the group through a TCP rendezvous on a free loopback
port. Rank r's return value comes back through a file (`torch.save`), so tensors travel as
they are.
"""

from __future__ import annotations

import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from services.learner.distributed import RankGroup

TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_method(device: str) -> str:
    """fork on CPU (fast); spawn where CUDA is asked for or already initialised here."""
    return "spawn" if device == "cuda" or torch.cuda.is_initialized() else "fork"


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    out: str,
    device: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(1)
    where = torch.device(device)
    if where.type == "cuda":
        # One GPU per rank, as a learner group places them (NCCL refuses two ranks on one GPU).
        where = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(where)
    group = RankGroup(rank, world_size)
    group.join(f"tcp://127.0.0.1:{port}", where, TIMEOUT_S)  # NCCL on CUDA, gloo on CPU
    try:
        result = fn(group, *args)
        torch.save(result, Path(out) / f"rank-{rank}.pt")
    finally:
        group.leave()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu"
) -> list[Any]:
    """`fn(group, *args)` on every rank of a fresh group on `device` ("cpu": gloo, forked
    ranks; "cuda": NCCL, spawned ranks, one GPU each); their results in rank order.

    Raises (with the failing rank's traceback) if a rank fails, and fails after TIMEOUT_S
    if one hangs, killing them all.
    """
    with tempfile.TemporaryDirectory() as out:
        ranks = mp.start_processes(
            _rank_main,
            args=(world_size, free_port(), out, device, fn, args),
            nprocs=world_size,
            join=False,
            start_method=start_method(device),
        )
        deadline = time.monotonic() + TIMEOUT_S
        while not ranks.join(timeout=1):  # raises if a rank failed
            if time.monotonic() > deadline:
                for process in ranks.processes:
                    process.kill()
                raise TimeoutError(f"{world_size} ranks did not finish within {TIMEOUT_S} s")
        return [
            torch.load(Path(out) / f"rank-{rank}.pt", weights_only=False)
            for rank in range(world_size)
        ]
