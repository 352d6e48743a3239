"""The `hf` backend receiving weights over a collective group (real gloo, and ipc: shared-memory
handles, CPU buckets in shared files here), no Ray.

A thread of this process plays learner rank 0 (`services.weights.collective`); the backend joins
as rank 1 through `GenerationBackend`'s default receiving methods.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.generation.hf_backend import HFBackend
from services.weights.base import Channel, StateDictMismatchError, TensorSpec, WeightsManifest
from services.weights.buckets import plan_buckets
from services.weights.collective import connect, open_weight_group

HOST = "127.0.0.1"


def manifest_of(state: dict[str, torch.Tensor], version: int) -> WeightsManifest:
    specs = [TensorSpec(name, tuple(t.shape), "float32") for name, t in state.items()]
    return WeightsManifest(version, plan_buckets(specs, 48 * 1024))


def buckets(
    state: dict[str, torch.Tensor], manifest: WeightsManifest
) -> Iterator[dict[str, torch.Tensor]]:
    for specs in manifest.buckets:
        yield {spec.name: state[spec.name] for spec in specs}


@pytest.fixture(params=["gloo", "ipc"])
def joined(
    fresh_hf_backend: HFBackend, request: pytest.FixtureRequest
) -> Iterator[tuple[HFBackend, Channel]]:
    """The backend joined to a fresh group whose rank 0 is this process's sender channel."""
    group = open_weight_group(2, request.param, generation=1, host=HOST)
    sender: list[Channel] = []
    thread = threading.Thread(target=lambda: sender.append(connect(group, 0, host=HOST)))
    thread.start()
    fresh_hf_backend.join_weight_group(group, 1)
    thread.join()
    yield fresh_hf_backend, sender[0]
    sender[0].close()
    fresh_hf_backend.close_weight_group()


def send_while(
    channel: Channel, state: dict[str, torch.Tensor], manifest: WeightsManifest
) -> threading.Thread:
    thread = threading.Thread(target=channel.send, args=(manifest, buckets(state, manifest)))
    thread.start()
    return thread


def noisy(backend: HFBackend, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.1 * torch.randn(v.shape, generator=generator)
        for k, v in backend.model.state_dict().items()
    }


def assert_holds(backend: HFBackend, state: dict[str, torch.Tensor]) -> None:
    live = backend.model.state_dict()
    assert all(torch.equal(live[name], tensor) for name, tensor in state.items())


def test_apply_loads_every_bucket_bitwise(joined: tuple[HFBackend, Channel]) -> None:
    backend, channel = joined
    state = noisy(backend, 1)
    manifest = manifest_of(state, 3)
    assert len(manifest.buckets) > 3
    sending = send_while(channel, state, manifest)
    backend.receive_weights(manifest, apply=True)
    sending.join()
    assert backend.policy_version == 3 and backend.staged_version is None
    assert_holds(backend, state)


def test_staged_weights_wait_for_apply_staged(joined: tuple[HFBackend, Channel]) -> None:
    backend, channel = joined
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    state = noisy(backend, 2)
    manifest = manifest_of(state, 4)
    sending = send_while(channel, state, manifest)
    backend.receive_weights(manifest, apply=False)
    sending.join()
    assert backend.policy_version == 0 and backend.staged_version == 4
    assert_holds(backend, before)
    backend.apply_staged()
    assert backend.policy_version == 4 and backend.staged_version is None
    assert_holds(backend, state)
    with pytest.raises(RuntimeError, match="no weights were staged"):
        backend.apply_staged()


def test_a_mismatched_manifest_is_drained_then_refused(
    joined: tuple[HFBackend, Channel],
) -> None:
    """The sender is not left waiting, the model is untouched, and the group stays usable."""
    backend, channel = joined
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    wrong = {**noisy(backend, 3), "extra.weight": torch.zeros(5)}
    manifest = manifest_of(wrong, 5)
    sending = send_while(channel, wrong, manifest)
    with pytest.raises(StateDictMismatchError, match=r"unexpected \['extra\.weight'\]"):
        backend.receive_weights(manifest, apply=True)
    sending.join()
    assert backend.policy_version == 0
    assert_holds(backend, before)
    state = noisy(backend, 4)
    manifest = manifest_of(state, 6)
    sending = send_while(channel, state, manifest)
    backend.receive_weights(manifest, apply=True)
    sending.join()
    assert_holds(backend, state)


def test_receiving_needs_a_joined_group(tiny_model_dir: Path) -> None:
    backend = HFBackend(tiny_model_dir)
    assert backend.weight_receivers() == 1
    with pytest.raises(RuntimeError, match="join_weight_group"):
        backend.receive_weights(WeightsManifest(1, ()), apply=True)
