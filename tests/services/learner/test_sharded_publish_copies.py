"""A sharded learner's armed sends hold at most `pipeline.publish_in_flight` host copies of the
weights: the next publish gathers only once an earlier copy has been let go of.

Two real FSDP2 ranks (gloo, forked) over the tiny model, in small buckets. Rank 0's weight
group is an in-memory channel. Version 1 is published with its send armed and not decided;
then the ranks train a step and publish version 2. Rank 0 counts, through weak references to
every bucket it gathered, the versions whose host buckets are alive when each gather starts.
With one copy allowed, publish 2 waits for room (and says so), the test then starts send 1, and
gather 2 starts with no copy alive; with two allowed, it gathers at once, beside copy 1.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from torch import Tensor

from services.learner.distributed import RankGroup
from services.learner.publish import MiB, WeightsRead
from services.learner.publisher import Publisher
from services.messages import ScoredGroup
from services.spec import PipelineConfig
from services.weights.base import WeightsManifest
from tests.services.learner.conftest import make_core
from tests.services.learner.ranks import run_ranks


class DrainingChannel:
    """Rank 0's end of an in-memory weight group: a send takes every bucket, keeps nothing."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.group, self.rank, self.messages = None, 0, []
        self.changed_fraction = 1.0

    def send(self, manifest: WeightsManifest, buckets: Iterable[dict[str, Tensor]]) -> None:
        for _ in buckets:
            pass
        self.sent.append(manifest.version)

    def receive(self, manifest: WeightsManifest, device: object = None) -> Iterator[dict]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class CopyCounter:
    """Weak references to every host bucket rank 0 gathers, by version."""

    def __init__(self) -> None:
        self.buckets: dict[int, list[weakref.ref[Tensor]]] = {}
        self.alive_at_gather: dict[int, list[int]] = {}

    def alive(self) -> list[int]:
        gc.collect()  # only what is really held counts
        return sorted(
            version
            for version, refs in self.buckets.items()
            if any(ref() is not None for ref in refs)
        )

    def watch(self, gather: Any) -> Any:
        def counted(manifest: WeightsManifest, *args: Any, **kwargs: Any) -> Iterator[dict]:
            self.alive_at_gather[manifest.version] = self.alive()
            refs = self.buckets.setdefault(manifest.version, [])
            for bucket in gather(manifest, *args, **kwargs):
                refs.extend(weakref.ref(tensor) for tensor in bucket.values())
                yield bucket

        return counted


def two_armed_publishes(
    group: RankGroup, model_dir: Path, groups: list[ScoredGroup], in_flight: int
) -> dict[str, Any]:
    core = make_core(model_dir, "token", group=group)
    fences = WeightsRead()
    core.before_update = fences.wait
    publisher = Publisher(core, fences, group, "collective", MiB // 16, True, in_flight)
    counter, channel = CopyCounter(), DrainingChannel()
    waited: list[list[int]] = []
    deciders: list[threading.Thread] = []
    if group.rank == 0:
        core.weight_buckets = counter.watch(core.weight_buckets)  # type: ignore[method-assign]
        publisher.attach_channel(channel)

        def start_send_one(versions: list[int]) -> None:
            waited.append(versions)
            deciders.append(threading.Thread(target=lambda: publisher.decide(1, True).result()))
            deciders[-1].start()

        publisher.waits_for_room = start_send_one
    core.train_step(groups)
    publisher.publish(1, send=True)
    core.train_step(groups)
    publisher.publish(2, send=True)
    if group.rank != 0:
        return {}
    if not deciders:  # publish 2 did not wait: send 1 starts now
        publisher.decide(1, True).result()
    for decider in deciders:
        decider.join()
    publisher.decide(2, True).result()
    return {
        "alive_at_gather": counter.alive_at_gather,
        "waited": waited,
        "sent": channel.sent,
        "buckets": len(counter.buckets[1]),
    }


@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_sharded_learner_holds_at_most_publish_in_flight_copies(
    tiny_model_dir: Path, groups: list[ScoredGroup], in_flight: int
) -> None:
    result = run_ranks(two_armed_publishes, 2, tiny_model_dir, groups, in_flight)[0]
    assert result["buckets"] > 2 and result["sent"] == [1, 2]
    assert result["alive_at_gather"][1] == []
    if in_flight == 1:
        assert result["waited"] == [[1]]  # publish 2 waited for copy 1
        assert result["alive_at_gather"][2] == []
    else:
        assert result["waited"] == []
        assert result["alive_at_gather"][2] == [1]  # the two copies were held together


def test_publish_in_flight_is_a_bounded_setting() -> None:
    assert PipelineConfig().publish_in_flight == 1
    with pytest.raises(ValueError, match="publish_in_flight"):
        PipelineConfig(publish_in_flight=0)
