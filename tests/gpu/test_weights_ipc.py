"""The weight group on one GPU: an NCCL group whose ranks share the GPU hands buckets over as
CUDA IPC handles (`services.weights.ipc`), received bitwise in another process.

Runs only where a GPU exists; tests/services/weights/test_ipc.py covers the protocol on CPU.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as EventType
from typing import Any

import numpy as np
import pytest
import torch

from services.weights.base import TensorSpec, WeightGroup, WeightsManifest
from services.weights.buckets import plan_buckets
from services.weights.collective import connect, open_weight_group
from services.weights.ipc import IpcChannel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HOST = "127.0.0.1"
TIMEOUT_S = 120.0


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        f"layers.{i}.weight": torch.randn(1024, 1024, generator=generator).to(torch.bfloat16)
        for i in range(6)
    }


def manifest_of(state: dict[str, torch.Tensor]) -> WeightsManifest:
    specs = [TensorSpec(name, tuple(t.shape), "bfloat16") for name, t in state.items()]
    return WeightsManifest(7, plan_buckets(specs, 4 * 2**20))


def receiver_main(
    group: WeightGroup, manifest: WeightsManifest, out: Queue[Any], read: EventType
) -> None:
    channel = connect(group, 1, timeout_s=TIMEOUT_S, host=HOST)
    got: dict[str, np.ndarray] = {}
    devices = set()
    for bucket in channel.receive(manifest):
        devices.update(tensor.device.type for tensor in bucket.values())
        # Plain arrays, pickled by value: a torch CPU tensor on a queue travels as a handle to
        # this process's shared memory, which is gone once it exits (ConnectionResetError in
        # the parent). numpy has no bfloat16, so the bits travel as int16.
        got.update(
            {name: tensor.cpu().view(torch.int16).numpy() for name, tensor in bucket.items()}
        )
    out.put({"kind": type(channel).__name__, "devices": sorted(devices), "weights": got})
    read.wait(TIMEOUT_S)  # alive until the parent has the result
    channel.close()


def bfloat16_of(bits: np.ndarray) -> torch.Tensor:
    """The bfloat16 tensor whose bits `receiver_main` sent as int16."""
    return torch.from_numpy(bits).view(torch.bfloat16)


def test_ranks_on_one_gpu_hand_buckets_over_as_cuda_ipc_handles() -> None:
    state = weights()
    manifest = manifest_of(state)
    assert len(manifest.buckets) == 3
    group = open_weight_group(2, "nccl", 1, host=HOST, timeout_s=TIMEOUT_S)
    context = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    out: Queue[Any] = context.Queue()
    read = context.Event()
    receiver = context.Process(target=receiver_main, args=(group, manifest, out, read))
    receiver.start()
    try:
        channel = connect(group, 0, timeout_s=TIMEOUT_S, host=HOST)
        assert isinstance(channel, IpcChannel)  # not NCCL: it refuses two ranks on one GPU
        cuda = {name: tensor.cuda() for name, tensor in state.items()}
        channel.send(manifest, ({s.name: cuda[s.name] for s in b} for b in manifest.buckets))
        result = out.get(timeout=TIMEOUT_S)
    finally:
        read.set()
        receiver.join(TIMEOUT_S)
        if receiver.is_alive():
            receiver.kill()
    assert result["kind"] == "IpcChannel" and result["devices"] == ["cuda"]
    assert result["weights"].keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(bfloat16_of(result["weights"][name]), tensor), name
    channel.close()
