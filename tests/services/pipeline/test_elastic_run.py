"""The elastic generation pool (`generation.actors`) in real runs on a local Ray with the tiny
model: it grows while generation is the bottleneck and shrinks while the learner is, within its
bounds, as the run's events, records and actors show."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.exceptions import RayActorError

from services.observers import MetricsRecord
from services.pipeline.driver import RunDriver
from services.pipeline.elastic import POOL_EVENT
from services.pipeline.outputs import RunDirectory
from tests.services.pipeline.conftest import tiny_spec

pytestmark = [pytest.mark.usefixtures("ray_instance"), pytest.mark.timeout(240)]

# Short windows so that a run of a few seconds per step decides; the thresholds as shipped.
QUICK_POOL = (
    "generation.actors.min=1",
    "generation.actors.max=2",
    "generation.actors.window_s=1",
    "generation.actors.cooldown_s=0.5",
    "generation.num_cpus=0.5",
    "pipeline.checkpoint_every=0",
)


class PoolWatcher:
    """Records the pool's events with the driver's workers at each, and each step's record;
    checks at every `removed` event that the worker that left is dead."""

    def __init__(self) -> None:
        self.driver: RunDriver | None = None
        self.events: list[dict[str, Any]] = []
        self.records: list[MetricsRecord] = []
        self.leaving: list[Any] = []  # the worker each shrink drains
        self.dead_after_removal: list[bool] = []

    def on_status(self, state: str, error: str | None = None, **details: Any) -> None:
        pass

    def on_metrics(self, record: MetricsRecord) -> None:
        self.records.append(record)

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        if kind != POOL_EVENT:
            return
        assert self.driver is not None
        streams = len(self.driver._streams)
        self.events.append({**data, "streams": streams, "records": len(self.records)})
        if data["action"] == "shrink":
            self.leaving.append(self.driver._streams[-1].actor)
        elif data["action"] == "removed":
            self.dead_after_removal.append(_dead(self.leaving[-1]))


def _dead(handle: Any, within_s: float = 30.0) -> bool:
    """Whether the actor's calls fail as a dead actor's within `within_s` (a kill takes
    effect asynchronously: a call sent just after it may still be answered)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_call__.remote(lambda _self: None), timeout=within_s)
        except RayActorError:
            return True
        time.sleep(0.05)  # polling the actor's state, not waiting in its place
    return False


def run(tmp_path: Path, *overrides: str) -> tuple[RunDriver, PoolWatcher]:
    watcher = PoolWatcher()
    driver = RunDriver(tiny_spec(*QUICK_POOL, *overrides), RunDirectory(tmp_path), [watcher])
    watcher.driver = driver
    assert driver.run() == "succeeded"
    return driver, watcher


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_the_pool_grows_while_the_learner_waits_for_generation(
    tmp_path: Path, transport: str
) -> None:
    # One worker generating two long groups at a time for batches of four: the learner waits.
    # Collective: the weight group is re-formed with the new worker before it takes prompts.
    driver, watcher = run(
        tmp_path,
        f"pipeline.weight_transport={transport}",
        "generation.num_workers=1",
        "generation.prompts_per_batch=2",
        "generation.max_new_tokens=96",
        # Long enough after the grow for the new actor's process to start on a busy machine.
        "pipeline.steps=30",
    )
    grows = [e for e in watcher.events if e["action"] == "grow"]
    assert grows, watcher.events
    first = grows[0]
    assert (first["size"], first["target"]) == (1, 2)
    assert first["starved_fraction"] >= driver.spec.generation.actors.grow_idle_fraction  # type: ignore[union-attr]
    sizes = [r["generation_workers"] for r in watcher.records]
    assert all(1 <= size <= 2 for size in sizes) and 2 in sizes, (sizes, watcher.events)
    assert watcher.records[-1]["generation_pool_grows_total"] == len(grows)
    # The worker added was brought to the current weights (it takes prompts only then) and
    # generated groups that came back. The run's last publish may still be on its way to it
    # when the run ends (as to any worker): no older version is.
    assert len(driver._streams) == 2 and driver._streams[1].joined, watcher.events
    assert driver._streams[1].tokens > 0
    outstanding = {v for v, n in driver._streams[1].unacknowledged.items() if n > 0}
    assert outstanding <= {driver.spec.pipeline.steps}, (outstanding, watcher.events)


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_the_pool_shrinks_while_generation_waits_for_the_learner(
    tmp_path: Path, transport: str
) -> None:
    # Two workers of short responses feeding a learner that passes over each batch 6 times.
    # Collective: the weight group is re-formed without the worker that left.
    driver, watcher = run(
        tmp_path,
        f"pipeline.weight_transport={transport}",
        "generation.num_workers=2",
        "generation.max_new_tokens=8",
        "learner.ppo_epochs=6",
        "learner.minibatches=2",
        "pipeline.steps=8",
    )
    actions = [e["action"] for e in watcher.events]
    assert actions[:2] == ["shrink", "removed"], watcher.events
    shrink = watcher.events[0]
    assert (shrink["size"], shrink["target"]) == (2, 1)
    assert shrink["backed_up_fraction"] >= driver.spec.generation.actors.shrink_full_fraction  # type: ignore[union-attr]
    assert watcher.dead_after_removal[0]  # killed once it had drained
    assert watcher.events[1]["streams"] == 1  # and its stream removed
    assert "grow" not in actions  # the learner stays the bottleneck: no flapping back
    sizes = [r["generation_workers"] for r in watcher.records]
    assert sizes[-1] == 1 and all(1 <= size <= 2 for size in sizes)
    assert watcher.records[-1]["generation_pool_shrinks_total"] == 1
    assert len(driver._streams) == 1 and driver.supervisor.pids["generation"][1:] == []
