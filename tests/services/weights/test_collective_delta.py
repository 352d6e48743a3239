"""Delta publishes over a real gloo weight group (`WeightGroup.delta`): rank 0 and the
receivers are threads of this process, as in test_group_authentication.py. After every
version each receiver holds the sender's weights bit for bit; a receiver whose copy went wrong
catches it by the digest, takes the rest of the publish (the sender is not held), loads
nothing wrong, and a re-formed group sends it the weights whole."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from services.weights.base import Channel, TensorSpec, WeightGroup, WeightsManifest
from services.weights.buckets import plan_buckets
from services.weights.collective import connect, open_weight_group
from services.weights.delta import DeltaMismatchError

HOST = "127.0.0.1"
TIMEOUT_S = 20.0
RECEIVERS = 2


def first_weights() -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": torch.randn(128, 64, generator=generator).to(torch.bfloat16)
        for i in range(4)
    }


def stepped(weights: dict[str, Tensor], seed: int) -> dict[str, Tensor]:
    """A small sign step of every weight, rounded to bf16: most values do not move."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (t.float() - 1e-4 * torch.randn(t.shape, generator=generator).sign()).to(t.dtype)
        for name, t in weights.items()
    }


def manifest_of(weights: dict[str, Tensor], version: int) -> WeightsManifest:
    specs = [TensorSpec(name, tuple(t.shape), "bfloat16") for name, t in weights.items()]
    return WeightsManifest(version, plan_buckets(specs, 2 * 128 * 64 * 2))


def buckets_of(
    weights: dict[str, Tensor], manifest: WeightsManifest
) -> Iterator[dict[str, Tensor]]:
    for specs in manifest.buckets:
        yield {spec.name: weights[spec.name] for spec in specs}


def joined(generation: int) -> tuple[WeightGroup, list[Channel]]:
    group = open_weight_group(
        1 + RECEIVERS, "gloo", generation, host=HOST, timeout_s=TIMEOUT_S, delta=True
    )
    ends: dict[int, Channel] = {}

    def join(rank: int) -> None:
        ends[rank] = connect(group, rank, timeout_s=TIMEOUT_S, host=HOST)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(1, 1 + RECEIVERS)]
    for thread in threads:
        thread.start()
    join(0)
    for thread in threads:
        thread.join()
    return group, [ends[rank] for rank in range(1 + RECEIVERS)]


def publish(
    ends: list[Channel], weights: dict[str, Tensor], version: int
) -> tuple[list[dict[str, Tensor] | BaseException], int]:
    """Send `weights` as `version` from rank 0 while every receiver takes it; what each
    receiver got (or raised) and the bytes rank 0 broadcast."""
    manifest = manifest_of(weights, version)
    got: list[dict[str, Tensor] | BaseException] = [{} for _ in ends[1:]]

    def receive(slot: int) -> None:
        try:
            received: dict[str, Tensor] = {}
            for bucket in ends[1 + slot].receive(manifest):
                received.update({name: t.clone() for name, t in bucket.items()})
            got[slot] = received
        except DeltaMismatchError as error:
            got[slot] = error

    threads = [threading.Thread(target=receive, args=(slot,)) for slot in range(RECEIVERS)]
    for thread in threads:
        thread.start()
    sent_before = sum(ends[0].messages)
    ends[0].send(manifest, buckets_of(weights, manifest))
    for thread in threads:
        thread.join(4 * TIMEOUT_S)
        assert not thread.is_alive()
    return got, sum(ends[0].messages) - sent_before


def assert_bitwise(got: dict[str, Tensor] | BaseException, want: dict[str, Tensor]) -> None:
    assert isinstance(got, dict), got
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_delta_publishes_over_gloo_are_bitwise_and_smaller() -> None:
    _, ends = joined(1)
    try:
        weights = first_weights()
        dense = sum(t.numel() * t.element_size() for t in weights.values())
        sent = []
        for version in range(1, 5):
            got, nbytes = publish(ends, weights, version)
            sent.append(nbytes)
            for received in got:
                assert_bitwise(received, weights)
            weights = stepped(weights, version)
        assert sent[0] >= dense  # nothing earlier: whole
        assert all(nbytes < dense / 2 for nbytes in sent[1:]), (sent, dense)
    finally:
        for end in ends:
            end.close()


def test_a_receiver_whose_copy_went_wrong_loads_nothing_and_gets_the_weights_whole() -> None:
    _, ends = joined(2)
    try:
        weights = first_weights()
        publish(ends, weights, 1)
        damaged = ends[1].delta
        assert damaged is not None and damaged.version == 1
        held = dict(damaged.held())
        held[0][17] ^= 0x04  # its copy of version 1 is wrong now
        weights = stepped(weights, 1)
        got, _ = publish(ends, weights, 2)  # the sender is not held: this returns
        assert isinstance(got[0], DeltaMismatchError) and "digest" in str(got[0])
        assert damaged.version is None and not list(damaged.held())
        assert_bitwise(got[1], weights)
    finally:
        for end in ends:
            end.close()
    _, ends = joined(3)  # re-formed: its first send is whole, and the receiver is healed
    try:
        got, _ = publish(ends, weights, 2)
        for received in got:
            assert_bitwise(received, weights)
    finally:
        for end in ends:
            end.close()


@pytest.mark.parametrize("delta", [True, False])
def test_the_delta_setting_crosses_to_vllms_workers(delta: bool) -> None:
    from services.generation.vllm_transfer import group_from_wire, group_to_wire

    group = WeightGroup("127.0.0.1:1", 3, "gloo", 1, b"k" * 32, delta)
    assert group_from_wire(group_to_wire(group)) == group
