"""The overlapped publish on a GPU: copies on a side stream, ordered after the last update by an
event, and the next update waiting for them on the device (tests/services/learner/
test_overlapped_publish.py is the same on CPU); GPU buckets allocated on the side stream that
writes them, and kept from reuse until the consumer's stream has read them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from services.learner.publish import MiB, WeightsRead, publish_point
from services.messages import ScoredGroup
from tests.services.learner.conftest import make_core
from tests.services.learner.test_overlapped_publish import (
    WAIT_S,
    GatedRead,
    check_version_one_published,
    publish_in_thread,
)

# About 50 ms of GPU time at 2 GHz: long enough that the next bucket's copies would run before
# the consumer's read of this one if its memory were reused at once.
SLOW_READ_CYCLES = 100_000_000

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


def test_a_bucket_read_late_on_the_consumer_s_stream_is_not_overwritten_by_the_next(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    """The consumer reads each GPU bucket on a stream of its own, as a collective send does,
    queued behind slow work, and drops it before taking the next. The next bucket's copies
    run on the side stream at once: had they reused the dropped bucket's memory (a block of
    the consumer's stream reused in its order, or of the side stream with no record of the
    consumer's), the late reads would see the next bucket's bytes."""
    core = make_core(tiny_model_dir, "token", lr=1e-2, device="cuda", compute_dtype="bfloat16")
    core.train_step(groups)
    version_one = core.state_dict_for_publish()
    manifest = core.weights_manifest(MiB // 16)
    assert len(manifest.buckets) > 2
    fence = WeightsRead().arm()
    after = publish_point(core.device)
    got = {}
    with torch.cuda.stream(torch.cuda.Stream()):
        for bucket in core.overlapped_weight_buckets(manifest, fence, after, "cuda"):
            torch.cuda._sleep(SLOW_READ_CYCLES)
            got.update({name: tensor.clone() for name, tensor in bucket.items()})
            del bucket  # the generator's own reference goes when it is resumed
    torch.cuda.synchronize()
    names = [spec.name for specs in manifest.buckets for spec in specs]
    assert sorted(got) == sorted(names)
    for name in names:
        assert torch.equal(got[name].cpu(), version_one[name]), name
