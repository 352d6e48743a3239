"""Warm standby generation workers (`generation.standby`) in whole runs, on a real local Ray
with the tiny model: a serving worker's process is killed (SIGKILL) mid-run and the standby
takes its place.

What the run is watched by is an observer of the driver's own (`Watcher`): it is called in the
driver's loop, between two of its calls, so what it reads of the driver's state is consistent.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

from services.observers import MetricsRecord, RunState
from services.pipeline.driver import PROMOTED_EVENT, RESTORED_EVENT, RunDriver
from services.pipeline.outputs import RunDirectory, read_metrics
from tests.chaos.runs import assert_ledger_balances
from tests.services.pipeline.conftest import process_alive, tiny_spec

pytestmark = [pytest.mark.usefixtures("ray_instance"), pytest.mark.timeout(400)]

WORKERS = 2
STANDBY_INDEX = WORKERS  # the standby's stream: after the serving ones
KILL_AT = 2  # the step after which serving worker 0 is killed
STEPS = 16
WAIT_FOR_NEW_STANDBY_AT = STEPS - 6
BATCH_GROUPS = 4  # TINY_RUN's
# From the kill to the first group of the worker in the killed one's place. A standby needs
# no model load and no weight delivery: the time is the death being noticed plus the
# generation of one group of the tiny model (about a second here, on 2 shared cores). A
# replacement first loads the model (bench_pipeline measures both in one run).
STANDBY_SERVES_WITHIN_S = 8.0


class Watcher:
    """Kills serving worker 0 after step KILL_AT, records the run's events and the pids it was
    reported, checks at every step that no standby was handed a prompt, and, once the standby
    built after the promotion holds the current version, records what it holds."""

    def __init__(self) -> None:
        self.driver: RunDriver | None = None
        self.events: list[tuple[str, dict[str, Any], float]] = []
        self.learner_pids: list[list[int]] = []
        self.killed: dict[str, Any] = {}
        self.standby_prompts: list[int] = []  # per step: groups handed to standby streams
        self.new_standby: dict[str, Any] | None = None

    def on_status(self, state: RunState, error: str | None = None, **details: Any) -> None:
        if "actors" in details:
            self.learner_pids.append(list(details["actors"]["learner"]))

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        self.events.append((kind, data, time.perf_counter()))

    def on_metrics(self, record: MetricsRecord) -> None:
        driver = self.driver
        assert driver is not None
        standby = [s for s in driver._streams if s.standby]
        self.standby_prompts.append(sum(s.groups_submitted + len(s.outstanding) for s in standby))
        if record["step"] == KILL_AT and not self.killed:
            pids = driver.supervisor.pids
            self.killed = {
                "pid": pids["generation"][0],
                "standby_pid": pids["standby"][0],
                "standby_actor": driver._streams[STANDBY_INDEX].actor,
            }
            os.kill(self.killed["pid"], signal.SIGKILL)
            self.killed["at"] = time.perf_counter()
        elif self.killed and self.new_standby is None:
            if record["step"] == WAIT_FOR_NEW_STANDBY_AT:
                # The run is faster than a worker's start on 2 shared cores: the loop waits
                # here until the new standby's constructor has run (its first call answers),
                # so that the steps after this one see it brought to the current version.
                new = driver._streams[STANDBY_INDEX].actor
                ray.get(new.policy_version.remote(), timeout=180)
            self._look_at_new_standby(driver)

    def _look_at_new_standby(self, driver: RunDriver) -> None:
        """Record the new standby once it is up and holds the version delivered last."""
        pid = driver.supervisor.pids["standby"][0]
        stream = driver._streams[STANDBY_INDEX]
        current = driver.weights.delivered_version
        if pid == self.killed["standby_pid"] or not stream.ready or current == 0:
            return
        version = ray.get(stream.actor.policy_version.remote(), timeout=30)
        if version != current:
            return  # acknowledged, still loading: looked at again at the next step
        stats = ray.get(stream.actor.stats.remote(), timeout=30)
        self.new_standby = {
            "pid": pid,
            "alive": process_alive(pid),
            "version": version,
            "current": current,
            "groups_returned": stats.groups_returned,
            "groups_in_flight": stats.groups_in_flight,
        }


def events_of(watcher: Watcher, kind: str) -> list[tuple[dict[str, Any], float]]:
    return [(data, at) for k, data, at in watcher.events if k == kind]


TRANSPORTS = [
    pytest.param((), id="object_store"),
    pytest.param(("pipeline.weight_transport=collective",), id="collective"),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_standby_takes_a_killed_workers_place_at_once_and_a_new_standby_is_built(
    tmp_path: Path, transport: tuple[str, ...]
) -> None:
    spec = tiny_spec(
        f"generation.num_workers={WORKERS}",
        "generation.standby=1",
        "generation.num_cpus=0.5",  # three workers and the learner on the instance's 3 CPUs
        f"pipeline.steps={STEPS}",
        *transport,
    )
    out = tmp_path / "out"
    watcher = Watcher()
    driver = RunDriver(spec, RunDirectory(out), [watcher])
    watcher.driver = driver
    assert driver.run() == "succeeded"

    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    last = records[-1]
    assert last["generation_replacements"] == 1 and last["standby_promotions"] == 1
    assert last["learner_restarts"] == 0
    # No learner restart: the learner reported at the start is the learner of the whole run.
    assert len(watcher.learner_pids) == 1
    assert_ledger_balances(out, BATCH_GROUPS)

    # The standby took worker 0's place: one promotion event, for worker 0.
    ((promoted, _),) = events_of(watcher, PROMOTED_EVENT)
    assert promoted["worker"] == 0 and promoted["standby"] == 0
    assert driver.supervisor.pids["generation"][0] == watcher.killed["standby_pid"]
    # ... and served: the first group of worker 0's place came from it, within the bound.
    restored = [(d, at) for d, at in events_of(watcher, RESTORED_EVENT) if d["worker"] == 0]
    ((first, at),) = restored
    assert first["via"] == "standby"
    assert at - watcher.killed["at"] < STANDBY_SERVES_WITHIN_S, at - watcher.killed["at"]

    # No standby was handed a prompt at any step; the promoted one was, once serving.
    assert watcher.standby_prompts and set(watcher.standby_prompts) == {0}
    assert driver._streams[0].actor is watcher.killed["standby_actor"]
    assert driver._streams[0].groups_submitted > 0

    # A new standby was built beside the run: another process, alive, at the current version,
    # and it generated nothing.
    new = watcher.new_standby
    assert new is not None, "the new standby never held the current version"
    assert new["pid"] not in (watcher.killed["standby_pid"], watcher.killed["pid"])
    assert new["alive"] and new["version"] == new["current"] > KILL_AT
    assert new["groups_returned"] == 0 and new["groups_in_flight"] == 0
    # status.json names them by role: the promoted standby serves, the new one stands by.
    pids = json.loads((out / "status.json").read_text())["actors"]
    assert pids["generation"][0] == watcher.killed["standby_pid"]
    assert pids["standby"] == [new["pid"]]
    # The run's end stops the standby too (Ray's kill takes a moment to land).
    with contextlib.suppress(psutil.NoSuchProcess):  # gone already
        _, alive = psutil.wait_procs([psutil.Process(new["pid"])], timeout=30)
        assert not alive
