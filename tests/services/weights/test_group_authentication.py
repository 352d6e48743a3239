"""A weight group's messages are authenticated: a stranger who reaches the group's store (or
sits on the path of its broadcasts) can make a receiver refuse a publish, never load bytes of
its own.

Real components: the group's TCPStore, a second TCPStore client playing the stranger (it
connects to the group's host:port as any process that reaches the node could), real gloo
broadcasts. Rank 0 and the receivers are threads of this process, as in test_ipc.py.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psutil
import pytest
import torch
from torch import Tensor
from torch._C._distributed_c10d import TCPStore

from services.generation.vllm_transfer import group_from_wire, group_to_wire
from services.weights import stores
from services.weights.auth import DIGEST_CHUNK_BYTES, content_digest, new_key
from services.weights.base import (
    Channel,
    TensorSpec,
    WeightAuthenticationError,
    WeightGroup,
    WeightGroupBackend,
    WeightGroupError,
)
from services.weights.base import WeightsManifest as Manifest
from services.weights.buckets import bucket_nbytes, plan_buckets
from services.weights.collective import connect, open_weight_group, stop_serving
from services.weights.shared_memory import shared_bucket

HOST = "127.0.0.1"
TIMEOUT_S = 5.0
GENERATION = 7
PREFIX = f"kpo-weights/{GENERATION}"


def state(seed: int) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 16, generator=generator) for i in range(4)}


def manifest_of(weights: dict[str, Tensor], version: int) -> Manifest:
    specs = [TensorSpec(name, tuple(t.shape), "float32") for name, t in weights.items()]
    return Manifest(version, plan_buckets(specs, 2 * 64 * 16 * 4))


def buckets_of(weights: dict[str, Tensor], manifest: Manifest) -> Iterator[dict[str, Tensor]]:
    for specs in manifest.buckets:
        yield {spec.name: weights[spec.name] for spec in specs}


def joined(backend: WeightGroupBackend, world_size: int = 2) -> tuple[WeightGroup, list[Channel]]:
    """A fresh group on loopback, every rank joined (rank 0 first in the list)."""
    group = open_weight_group(world_size, backend, GENERATION, host=HOST, timeout_s=TIMEOUT_S)
    ends: dict[int, Channel] = {}

    def join(rank: int) -> None:
        ends[rank] = connect(group, rank, timeout_s=TIMEOUT_S, host=HOST)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(1, world_size)]
    for thread in threads:
        thread.start()
    join(0)
    for thread in threads:
        thread.join()
    return group, [ends[rank] for rank in range(world_size)]


def stranger(group: WeightGroup) -> TCPStore:
    """A client of the group's store that was handed nothing: it only reached host:port."""
    host, _, port = group.address.rpartition(":")
    return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=TIMEOUT_S))


class Receiver:
    """A receiving rank's model: parameters that each received bucket is copied into."""

    def __init__(self, weights: dict[str, Tensor]) -> None:
        self.params = {name: torch.zeros_like(tensor) for name, tensor in weights.items()}
        self.before = {name: tensor.clone() for name, tensor in self.params.items()}

    def load(self, channel: Channel, manifest: Manifest) -> None:
        for bucket in channel.receive(manifest):
            for name, tensor in bucket.items():
                self.params[name].copy_(tensor)

    def unchanged(self) -> bool:
        return all(torch.equal(self.params[n], t) for n, t in self.before.items())


@pytest.fixture
def ipc_group() -> Iterator[tuple[WeightGroup, list[Channel]]]:
    group, ends = joined("ipc")
    yield group, ends
    for end in ends:
        end.close()
    stop_serving(group)


def test_a_strangers_header_and_bucket_are_refused_and_nothing_is_loaded(
    ipc_group: tuple[WeightGroup, list[Channel]],
) -> None:
    """The stranger posts a whole publish of its own (a header that matches the manifest and a
    handle to a shared file of its bytes) before rank 0 sends anything."""
    group, (_, receiving) = ipc_group
    weights = state(1)
    manifest = manifest_of(weights, 3)
    forged = {name: torch.full_like(tensor, 66.0) for name, tensor in weights.items()}
    receiver = Receiver(weights)
    store = stranger(group)
    specs = manifest.buckets[0]
    with shared_bucket([forged[spec.name] for spec in specs], specs) as shared:
        header = [manifest.version, len(manifest.buckets), manifest.nbytes]
        store.set(f"{PREFIX}/0/header", json.dumps(header))
        handle = {"kind": "shared_file", "path": shared.path, "nbytes": shared.nbytes}
        store.set(f"{PREFIX}/0/0", json.dumps(handle))
        with pytest.raises(WeightGroupError) as refused:
            receiver.load(receiving, manifest)
    assert receiver.unchanged(), "the stranger's bytes were loaded"
    message = str(refused.value)
    assert f"weight group {group.address} (generation {GENERATION}), rank 1" in message
    assert f"store key '{PREFIX}/0/header'" in message
    assert "authentication" in message


def test_a_strangers_overwrite_of_a_bucket_key_is_refused_and_nothing_is_loaded(
    ipc_group: tuple[WeightGroup, list[Channel]],
) -> None:
    """Rank 0 posts a genuine header and bucket 0; before the receiver reads bucket 0 the
    stranger overwrites its key with a handle to bytes of its own."""
    group, (sending, receiving) = ipc_group
    weights = state(2)
    manifest = manifest_of(weights, 4)
    forged = {name: torch.full_like(tensor, -5.0) for name, tensor in weights.items()}
    receiver = Receiver(weights)
    store = stranger(group)
    errors: list[str] = []

    def send() -> None:
        try:
            sending.send(manifest, buckets_of(weights, manifest))
        except WeightGroupError as error:  # bucket 0 is never acknowledged
            errors.append(str(error))

    thread = threading.Thread(target=send)
    thread.start()
    store.wait([f"{PREFIX}/0/0"])  # rank 0 has posted bucket 0 and waits for its ack
    specs = manifest.buckets[0]
    with shared_bucket([forged[spec.name] for spec in specs], specs) as shared:
        handle = {"kind": "shared_file", "path": shared.path, "nbytes": shared.nbytes}
        store.set(f"{PREFIX}/0/0", json.dumps(handle))
        with pytest.raises(WeightGroupError) as refused:
            receiver.load(receiving, manifest)
    thread.join()
    assert receiver.unchanged(), "the stranger's bytes were loaded"
    message = str(refused.value)
    assert f"weight group {group.address} (generation {GENERATION}), rank 1" in message
    assert f"store key '{PREFIX}/0/0'" in message and "authentication" in message
    assert errors and "bucket 0 of version 4 not acknowledged" in errors[0]


def test_a_genuine_message_moved_to_another_key_is_refused(
    ipc_group: tuple[WeightGroup, list[Channel]],
) -> None:
    """The stranger cannot forge a tag, nor reuse a genuine one: a member's own message (rank
    1's `joined/1`), copied to the key of publish 0's header, is refused (every tag names the
    key it was written for)."""
    group, (_, receiving) = ipc_group
    weights = state(3)
    manifest = manifest_of(weights, 5)
    receiver = Receiver(weights)
    store = stranger(group)
    store.set(f"{PREFIX}/0/header", store.get(f"{PREFIX}/joined/1"))
    with pytest.raises(WeightGroupError, match=rf"store key '{PREFIX}/0/header'"):
        receiver.load(receiving, manifest)
    assert receiver.unchanged()


class Tampering:
    """A receiver's gloo backend whose received buckets are altered on the way (an on-path
    attacker of the broadcast): one byte of every message of `size` bytes is flipped."""

    def __init__(self, inner: Any, size: int) -> None:
        self.inner, self.size = inner, size

    def broadcast(self, tensors: list[Tensor], options: Any) -> Any:
        work = self.inner.broadcast(tensors, options)
        tensor, size = tensors[0], self.size

        class Work:
            def wait(self, timeout: timedelta) -> bool:
                done = bool(work.wait(timeout))
                if tensor.numel() * tensor.element_size() == size:
                    tensor.view(torch.uint8)[size // 2] ^= 0xFF
                return done

        return Work()

    def shutdown(self) -> None:
        self.inner.shutdown()


def test_a_bucket_altered_on_the_way_is_refused_and_nothing_is_loaded() -> None:
    group, (sending, receiving) = joined("gloo")
    try:
        weights = state(4)
        manifest = manifest_of(weights, 6)
        first = bucket_nbytes(manifest.buckets[0])
        receiving.backend = Tampering(receiving.backend, first)  # type: ignore[attr-defined]
        receiver = Receiver(weights)
        errors: list[str] = []

        def send() -> None:
            try:
                sending.send(manifest, buckets_of(weights, manifest))
            except WeightGroupError as error:
                errors.append(str(error))

        thread = threading.Thread(target=send)
        thread.start()
        with pytest.raises(WeightGroupError) as refused:
            receiver.load(receiving, manifest)
        thread.join(4 * TIMEOUT_S)
        assert not thread.is_alive()
        assert receiver.unchanged(), "the altered bucket was loaded"
        message = str(refused.value)
        assert f"weight group {group.address} (generation {GENERATION}), rank 1" in message
        assert "bucket 0 of version 6" in message and "authentication" in message
    finally:
        sending.close()
        receiving.close()


def listening_addresses(port: int) -> set[str]:
    """The local addresses this process listens on at `port`."""
    return {
        str(conn.laddr.ip)
        for conn in psutil.Process().net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port
    }


def test_a_single_host_groups_store_listens_on_loopback_only() -> None:
    group = open_weight_group(2, "gloo", GENERATION, host=HOST, timeout_s=TIMEOUT_S)
    try:
        port = int(group.address.rpartition(":")[2])
        assert listening_addresses(port) == {HOST}
    finally:
        stop_serving(group)


def test_a_strangers_joined_key_is_refused_by_the_rendezvous() -> None:
    """The stranger posts `joined/1` before rank 1 comes: rank 0 refuses to count it."""
    group = open_weight_group(2, "gloo", GENERATION, host=HOST, timeout_s=TIMEOUT_S)
    try:
        stranger(group).set(f"{PREFIX}/joined/1", "1")
        with pytest.raises(WeightAuthenticationError, match=rf"store key '{PREFIX}/joined/1'"):
            connect(group, 0, timeout_s=TIMEOUT_S, join_timeout_s=TIMEOUT_S, host=HOST)
    finally:
        stop_serving(group)


def test_a_strangers_acknowledgement_does_not_free_a_bucket(
    ipc_group: tuple[WeightGroup, list[Channel]],
) -> None:
    """An acknowledgement rank 0 did not get from a member makes its send fail, not drop the
    bucket before the receiver has read it."""
    group, (sending, _) = ipc_group
    weights = state(5)
    manifest = manifest_of(weights, 8)
    stranger(group).set(f"{PREFIX}/0/0/ack/1", "1")
    with pytest.raises(
        WeightAuthenticationError, match=rf"rank 0: refused store key '{PREFIX}/0/0/ack/1'"
    ):
        sending.send(manifest, buckets_of(weights, manifest))


def test_a_member_needs_the_groups_key() -> None:
    group = open_weight_group(2, "gloo", GENERATION, host=HOST, timeout_s=TIMEOUT_S)
    try:
        keyless = dataclasses.replace(group, key=b"")
        with pytest.raises(ValueError, match="has no key"):
            connect(keyless, 1, timeout_s=TIMEOUT_S, host=HOST)
        foreign = dataclasses.replace(group, key=new_key())
        with pytest.raises(ValueError, match="its key differs"):
            connect(foreign, 0, timeout_s=TIMEOUT_S, host=HOST)
        # The key never shows in logs or error messages.
        assert group.key.hex() not in repr(group) and len(group.key) == 32
    finally:
        stop_serving(group)


def test_every_group_has_a_key_of_its_own_that_crosses_to_vllms_workers() -> None:
    first = open_weight_group(2, "gloo", 1, host=HOST)
    second = open_weight_group(2, "gloo", 1, host=HOST)
    try:
        assert first.key != second.key
        assert group_from_wire(json.loads(json.dumps(group_to_wire(first)))) == first
    finally:
        stop_serving(first)
        stop_serving(second)


def test_a_one_node_ray_cluster_serves_its_groups_on_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(stores, "node_address", lambda: "10.1.2.3")
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": False}])
    assert stores.serving_host() == HOST
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": True}])
    assert stores.serving_host() == "10.1.2.3"


def test_a_content_digest_covers_every_byte_and_only_the_bytes() -> None:
    flat = torch.randint(0, 256, (3 * DIGEST_CHUNK_BYTES + 5,), dtype=torch.uint8)
    digest = content_digest(flat)
    assert content_digest(flat.clone()) == digest
    for position in (0, DIGEST_CHUNK_BYTES, flat.numel() - 1):
        altered = flat.clone()
        altered[position] ^= 1
        assert content_digest(altered) != digest
    assert content_digest(flat[:-1]) != digest
    assert content_digest(torch.empty(0, dtype=torch.uint8)) != content_digest(flat[:1])
