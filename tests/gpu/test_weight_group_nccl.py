"""An NCCL weight group across two GPUs whose receiver dies: the sender's broadcast raises
`WeightGroupError` and its process lives on (torch's default error handling would end it).

Runs only where two GPUs exist (one GPU gives an ipc group: tests/gpu/test_weights_ipc.py);
tests/services/weights/test_collective.py covers a dead receiver over gloo on CPU.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.queues import Queue
from typing import Any

import pytest
import torch

from services.weights.base import TensorSpec, WeightGroup, WeightGroupError, WeightsManifest
from services.weights.buckets import plan_buckets
from services.weights.collective import WeightChannel, connect, open_weight_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

HOST = "127.0.0.1"
JOIN_S = 120.0
BROADCAST_S = 30.0
MANIFEST = WeightsManifest(
    3, plan_buckets([TensorSpec(f"w{i}", (1024, 1024), "bfloat16") for i in range(4)], 2**21)
)


def receiver_main(group: WeightGroup) -> None:
    """Rank 1 on GPU 1: joins, then dies before the first publish."""
    torch.cuda.set_device(1)
    connect(group, 1, timeout_s=BROADCAST_S, join_timeout_s=JOIN_S, host=HOST)
    os._exit(1)


def sender_main(out: Queue[Any]) -> None:
    """Rank 0 on GPU 0: opens the group, waits for the receiver to die, then sends."""
    torch.cuda.set_device(0)
    group = open_weight_group(2, "nccl", 1, host=HOST, timeout_s=BROADCAST_S)
    receiver = mp.get_context("spawn").Process(target=receiver_main, args=(group,))
    receiver.start()
    channel = connect(group, 0, timeout_s=BROADCAST_S, join_timeout_s=JOIN_S, host=HOST)
    receiver.join(JOIN_S)
    buckets = [
        {s.name: torch.ones(s.shape, dtype=torch.bfloat16, device="cuda") for s in specs}
        for specs in MANIFEST.buckets
    ]
    try:
        channel.send(MANIFEST, buckets)
    except WeightGroupError as error:
        out.put({"kind": type(channel).__name__, "raised": str(error)})
        return
    out.put({"kind": type(channel).__name__, "raised": None})


def test_a_dead_receiver_fails_the_nccl_send_and_not_the_sender() -> None:
    context = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    out: Queue[Any] = context.Queue()
    sender = context.Process(target=sender_main, args=(out,))
    sender.start()
    sender.join(JOIN_S + 4 * BROADCAST_S)
    if sender.is_alive():
        sender.kill()
        pytest.fail("the sender hung past the broadcast timeout")
    assert sender.exitcode == 0, f"the sender's process ended with {sender.exitcode}"
    result = out.get(timeout=10)
    assert result["kind"] == WeightChannel.__name__
    assert result["raised"] is not None and "rank 0" in result["raised"]
