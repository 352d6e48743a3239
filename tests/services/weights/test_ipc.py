"""The ipc weight group's protocol (`services.weights.ipc`) over a real TCPStore, CPU buckets.

Rank 0 and the receivers are threads of this process here; tests/services/weights/
test_collective.py runs it across processes with an FSDP2 learner, and tests/gpu runs it with
CUDA IPC handles on one GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.weights.base import Channel, TensorSpec, WeightGroupError, WeightsManifest
from services.weights.buckets import plan_buckets
from services.weights.collective import connect, open_weight_group, stop_serving
from services.weights.ipc import IpcChannel, cuda_handle_to_wire, cuda_rebuild_args, opened_flat
from services.weights.shared_memory import FILE_PREFIX, shared_dir

HOST = "127.0.0.1"
TIMEOUT_S = 2.0


def state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 16, generator=generator) for i in range(5)}


def manifest_of(weights: dict[str, torch.Tensor], version: int) -> WeightsManifest:
    specs = [TensorSpec(name, tuple(t.shape), "float32") for name, t in weights.items()]
    return WeightsManifest(version, plan_buckets(specs, 2 * 64 * 16 * 4))


def buckets(
    weights: dict[str, torch.Tensor], manifest: WeightsManifest
) -> Iterator[dict[str, torch.Tensor]]:
    for specs in manifest.buckets:
        yield {spec.name: weights[spec.name] for spec in specs}


@pytest.fixture
def channels() -> Iterator[tuple[IpcChannel, IpcChannel, IpcChannel]]:
    """Rank 0 and two receivers of a fresh ipc group."""
    group = open_weight_group(3, "ipc", generation=1, host=HOST, timeout_s=TIMEOUT_S)
    joined: dict[int, Channel] = {}

    def join(rank: int) -> None:
        joined[rank] = connect(group, rank, timeout_s=TIMEOUT_S, host=HOST)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (1, 2)]
    for thread in threads:
        thread.start()
    join(0)
    for thread in threads:
        thread.join()
    ends = [joined[rank] for rank in range(3)]
    assert all(isinstance(end, IpcChannel) for end in ends)
    yield ends[0], ends[1], ends[2]  # type: ignore[misc]
    for end in ends:
        end.close()
    stop_serving(group)


def receive_all(channel: IpcChannel, manifest: WeightsManifest, out: dict[str, object]) -> None:
    try:
        got: dict[str, torch.Tensor] = {}
        for bucket in channel.receive(manifest):
            got.update({name: tensor.clone() for name, tensor in bucket.items()})
        out["weights"] = got
    except Exception as error:  # reported to the test
        out["error"] = error


def test_every_receiver_gets_each_publish_bitwise_and_nothing_is_left_behind(
    channels: tuple[IpcChannel, IpcChannel, IpcChannel],
) -> None:
    sender, *receivers = channels
    for version in (1, 2):  # two publishes over one channel: keys are per publish
        weights = state(version)
        manifest = manifest_of(weights, version)
        assert len(manifest.buckets) == 3
        results: list[dict[str, object]] = [{}, {}]
        threads = [
            threading.Thread(target=receive_all, args=(receiver, manifest, result))
            for receiver, result in zip(receivers, results, strict=True)
        ]
        for thread in threads:
            thread.start()
        sender.send(manifest, buckets(weights, manifest))
        for thread in threads:
            thread.join()
        for result in results:
            got = result["weights"]
            assert isinstance(got, dict) and got.keys() == weights.keys()
            assert all(torch.equal(got[name], tensor) for name, tensor in weights.items())
    sizes = [2 * 64 * 16 * 4, 2 * 64 * 16 * 4, 64 * 16 * 4]
    assert sender.messages == receivers[0].messages == [24, *sizes, 24, *sizes]
    assert not list(Path(shared_dir()).glob(f"{FILE_PREFIX}*")), "a shared bucket was left"
    # Every key of both publishes was deleted: only the joins remain.
    assert sender.store is not None and sender.store.num_keys() <= 1 + 3


def test_a_receiver_that_stops_early_makes_send_raise(
    channels: tuple[IpcChannel, IpcChannel, IpcChannel],
) -> None:
    sender, first, second = channels
    weights = state(3)
    manifest = manifest_of(weights, 3)
    result: dict[str, object] = {}
    thread = threading.Thread(target=receive_all, args=(first, manifest, result))
    thread.start()
    held: list[Iterator[dict[str, torch.Tensor]]] = []

    def take_one() -> None:
        held.append(second.receive(manifest))
        next(held[0])  # and never asks for the next: bucket 0 is never acknowledged

    stalled = threading.Thread(target=take_one)
    stalled.start()
    expected = r"rank 0: bucket 0 of version 3 not acknowledged within 2 s"
    with pytest.raises(WeightGroupError, match=expected):
        sender.send(manifest, buckets(weights, manifest))
    stalled.join()
    thread.join()
    assert isinstance(result.get("error"), WeightGroupError)
    assert "rank 1: no bucket 1 of publish 0 within 2 s" in str(result["error"])


def test_a_receiver_refuses_a_header_of_another_version(
    channels: tuple[IpcChannel, IpcChannel, IpcChannel],
) -> None:
    sender, first, _ = channels
    weights = state(4)
    sent, expected = manifest_of(weights, 4), manifest_of(weights, 5)
    send_errors: list[Exception] = []

    def send() -> None:
        try:
            sender.send(sent, buckets(weights, sent))
        except WeightGroupError as error:  # nobody takes the buckets
            send_errors.append(error)

    sending = threading.Thread(target=send)
    sending.start()
    with pytest.raises(RuntimeError, match=r"sent version 4 \(3 buckets, .*expected version 5"):
        first.receive(expected)
    sending.join()
    assert "bucket 0 of version 4 not acknowledged" in str(send_errors[0])


def test_roles_and_a_closed_channel_are_refused(
    channels: tuple[IpcChannel, IpcChannel, IpcChannel],
) -> None:
    sender, first, _ = channels
    manifest = manifest_of(state(5), 5)
    with pytest.raises(RuntimeError, match="only rank 0 sends"):
        first.send(manifest, [])
    with pytest.raises(RuntimeError, match="rank 0 of a weight group sends"):
        sender.receive(manifest)
    first.close()
    with pytest.raises(RuntimeError, match="is closed"):
        first.receive(manifest)


def test_a_cuda_handle_crosses_as_json_and_back() -> None:
    """A synthetic reduction (what `reduce_tensor` returns for a flat uint8 CUDA tensor; no GPU
    here) survives the JSON form, with the device replaced by the receiver's local index."""
    reduction = (
        torch.Tensor,
        torch.Size([4096]),
        (1,),
        128,
        torch.storage.TypedStorage,
        torch.uint8,
        0,
        b"\x01\x02handle",
        2**20,
        512,
        False,
        b"/torch_ref_counter",
        3,
        b"\xffevent",
        True,
    )
    wire = cuda_handle_to_wire(reduction, "GPU-1234")
    assert wire["kind"] == "cuda" and wire["device_uuid"] == "GPU-1234"
    import json

    back = cuda_rebuild_args(json.loads(json.dumps(wire)), device_index=2)
    assert back == (*reduction[:6], 2, *reduction[7:])
    with pytest.raises(ValueError, match="only a flat uint8 bucket"):
        cuda_handle_to_wire((*reduction[:5], torch.float32, *reduction[6:]), "GPU-1234")


def test_an_unknown_handle_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown weight handle kind 'rdma'"):
        opened_flat({"kind": "rdma"}, 0)
