"""A publish that reads the weights while the next step trains publishes the version it began
with, bit for bit: the step's first update waits until every tensor is read."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from services.learner.publish import MiB, WeightsRead
from services.learner.step import LearnerCore
from services.messages import ScoredGroup
from services.weights.base import WeightsManifest
from tests.services.learner.conftest import make_core

WAIT_S = 120.0


def live_weights(core: LearnerCore) -> dict[str, Tensor]:
    policy = core.model.policy
    return {name: tensor.detach().clone() for name, tensor in policy.state_dict().items()}


class GatedRead(WeightsRead):
    """A fence that says when an update reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.reached = threading.Event()

    def wait(self) -> None:
        self.reached.set()
        super().wait()


def publish_in_thread(
    buckets: Iterator[dict[str, Tensor]], gate: threading.Event, got: dict[str, Tensor]
) -> threading.Thread:
    """Walk `buckets` on a thread of its own, stopping after the first until `gate` is set."""

    def walk() -> None:
        got.update(next(buckets))
        assert gate.wait(WAIT_S)
        for bucket in buckets:
            got.update(bucket)

    thread = threading.Thread(target=walk, daemon=True)
    thread.start()
    return thread


def test_the_next_step_updates_only_after_the_publish_read_every_tensor(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    core = make_core(tiny_model_dir, "token", lr=1e-2)
    core.train_step(groups)  # version 1
    version_one = core.state_dict_for_publish()
    manifest = core.weights_manifest(MiB // 16)
    assert manifest.version == 1 and len(manifest.buckets) > 2  # a walk the step can overtake
    read = GatedRead()
    core.before_update = read.wait
    buckets = core.overlapped_weight_buckets(manifest, read.arm(), None)
    gate, got = threading.Event(), {}
    publisher = publish_in_thread(buckets, gate, got)
    stepper = threading.Thread(target=core.train_step, args=(groups,), daemon=True)
    stepper.start()

    # The step trained its first minibatch and reached its update while the publish is held
    # after one bucket: the weights are still version 1's.
    assert read.reached.wait(WAIT_S)
    assert stepper.is_alive()
    for name, tensor in live_weights(core).items():
        assert torch.equal(tensor, version_one[name]), name

    gate.set()
    check_version_one_published(core, (publisher, stepper), manifest, got, version_one)


def check_version_one_published(
    core: LearnerCore,
    threads: tuple[threading.Thread, threading.Thread],
    manifest: WeightsManifest,
    got: dict[str, Tensor],
    version_one: dict[str, Tensor],
) -> None:
    """Once the publish and the step have ended: every tensor of `manifest` was published as
    version 1's, bit for bit, and the step trained on to version 2."""
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive()
    assert core.version == 2
    names = [spec.name for bucket in manifest.buckets for spec in bucket]
    assert sorted(got) == sorted(names)
    for name in names:
        assert torch.equal(got[name].cpu(), version_one[name]), name
    version_two = core.state_dict_for_publish()
    assert any(not torch.equal(version_two[name], version_one[name]) for name in names)


def test_a_publish_stopped_early_releases_the_update(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    """A publish that fails (its reader gone after one bucket) must not hold the learner."""
    core = make_core(tiny_model_dir, "token", lr=1e-2)
    manifest = core.weights_manifest(MiB // 16)
    read = WeightsRead()
    core.before_update = read.wait
    buckets = core.overlapped_weight_buckets(manifest, read.arm(), None)
    next(buckets)
    buckets.close()
    finished = threading.Thread(target=core.train_step, args=(groups,), daemon=True)
    finished.start()
    finished.join(WAIT_S)
    assert not finished.is_alive() and core.version == 1
