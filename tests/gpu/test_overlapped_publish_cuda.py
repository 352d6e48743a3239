"""The overlapped publish on a GPU: copies on a side stream, ordered after the last update by an
event, and the next update waiting for them on the device (tests/services/learner/
test_overlapped_publish.py is the same on CPU)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from services.learner.publish import MiB, publish_point
from services.messages import ScoredGroup
from tests.services.learner.conftest import make_core
from tests.services.learner.test_overlapped_publish import (
    WAIT_S,
    GatedRead,
    check_version_one_published,
    publish_in_thread,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(
    "device", ["cpu", "cuda"], ids=["pinned-host-buckets", "broadcast-buffer-buckets"]
)
def test_a_publish_read_beside_the_next_cuda_step_is_the_version_it_began_with(
    tiny_model_dir: Path, groups: list[ScoredGroup], device: str
) -> None:
    """Held after one bucket while the next step trains up to its update: every published
    tensor is still version 1's, bit for bit, in pinned host memory (object store) or on the
    GPU (what a collective send broadcasts)."""
    core = make_core(tiny_model_dir, "token", lr=1e-2, device="cuda", compute_dtype="bfloat16")
    core.train_step(groups)  # version 1
    version_one = core.state_dict_for_publish()
    manifest = core.weights_manifest(MiB // 16)
    assert len(manifest.buckets) > 2
    read = GatedRead()
    core.before_update = read.wait
    fence = read.arm()
    buckets = core.overlapped_weight_buckets(manifest, fence, publish_point(core.device), device)
    gate, got = threading.Event(), {}
    publisher = publish_in_thread(buckets, gate, got)
    stepper = threading.Thread(target=core.train_step, args=(groups,), daemon=True)
    stepper.start()

    assert read.reached.wait(WAIT_S)
    gate.set()
    check_version_one_published(core, (publisher, stepper), manifest, got, version_one)
    for tensor in got.values():
        assert tensor.device.type == device
        assert device == "cuda" or tensor.is_pinned()
