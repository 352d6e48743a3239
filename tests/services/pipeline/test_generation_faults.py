"""The driver's handling of generation workers that raise or hang, on a real local Ray.

`RaisingWorker`, `SwapFailingWorker` and `HangingWorker` stand in for a worker whose engine
fails on the prompts it was given, one that gave up loading the weights it was offered, and one
whose engine is wedged: real actor processes speaking the worker's protocol. Their replacements
are real generation workers on the tiny model.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import ray

from services.generation.base import GroupRequest, StreamedGroups
from services.generation.worker import WeightSwapError
from services.pipeline import supervisor as supervisor_module
from services.pipeline.actors import RunActors, start_generation_worker, start_verifier
from services.pipeline.driver import GenerationFailed, RunDriver
from services.pipeline.outputs import RunDirectory
from services.pipeline.streams import WorkerStream
from services.tasks.models import resolve_model
from tests.services.pipeline.conftest import tiny_spec

pytestmark = [pytest.mark.usefixtures("ray_instance"), pytest.mark.timeout(240)]


@ray.remote(num_cpus=0, max_concurrency=4)
class RaisingWorker:
    """Takes prompts; its engine then fails: every `next_groups` raises."""

    def submit(self, requests: list[GroupRequest]) -> None:
        return None

    def next_groups(self, timeout_s: float) -> StreamedGroups:
        raise RuntimeError("engine failed on these prompts")

    def offer_weights(self, version: int, offer: Any) -> bool:
        return True


@ray.remote(num_cpus=0, max_concurrency=4)
class SwapFailingWorker:
    """Takes prompts; loading its offered weights failed twice, so it halted."""

    def submit(self, requests: list[GroupRequest]) -> None:
        return None

    def next_groups(self, timeout_s: float) -> StreamedGroups:
        raise WeightSwapError("loading weights of version 1 failed: fetch failed")

    def offer_weights(self, version: int, offer: Any) -> bool:
        return True


@ray.remote(num_cpus=0, max_concurrency=4)
class HangingWorker:
    """Takes prompts and never answers `next_groups` (a wedged engine)."""

    def __init__(self) -> None:
        self._never = threading.Event()

    def submit(self, requests: list[GroupRequest]) -> None:
        return None

    def next_groups(self, timeout_s: float) -> StreamedGroups:
        self._never.wait()
        return StreamedGroups([])

    def offer_weights(self, version: int, offer: Any) -> bool:
        return True


def driver_with(
    tmp_path: Path, worker: Any, *overrides: str
) -> tuple[RunDriver, RunActors, list[str]]:
    """A driver whose only generation worker is `worker`, its prompts handed out; their ids.

    Synchronous, so that no prompt is handed out beyond the first batch's until it is scored.
    """
    spec = tiny_spec("pipeline.mode=sync", *overrides)
    driver = RunDriver(spec, RunDirectory(tmp_path / "out"), [])
    driver._model_dir = resolve_model(spec.model)
    actors = RunActors(generation=[worker], verifiers=[start_verifier(spec)], learner=None)
    driver.supervisor.pids = {"generation": [0], "verifiers": [0]}
    driver._streams = [WorkerStream(worker)]
    driver.weights.connect(actors, driver._streams)
    driver._dispatch_generation(actors)
    driver._poll(actors, 0)
    return driver, actors, list(driver._streams[0].outstanding)


def drive_until(driver: RunDriver, actors: RunActors, groups: int) -> None:
    """The driver's loop without a learner: hand out prompts, complete calls (weight
    deliveries included) and stop hung actors until the buffer holds `groups` groups."""
    while len(driver.buffer) < groups:
        driver._dispatch_generation(actors)
        refs = list(driver._pending) + driver.weights.pending_refs()
        ready, _ = ray.wait(refs, num_returns=1, timeout=0.5)
        for ref in ready:
            driver._on_ready(actors, ref)
        driver._stop_hung(actors)


def test_prompts_a_worker_raised_on_are_generated_by_its_replacement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervisor_module, "start_generation_worker", start_generation_worker)
    driver, actors, issued = driver_with(tmp_path, RaisingWorker.remote())
    drive_until(driver, actors, len(issued))

    assert driver.counters.generation_replacements == 1
    assert actors.generation[0] is driver._streams[0].actor
    # The replacement generated exactly the prompts the first worker failed on, once each.
    assert sorted(group.prompt.prompt_id for group in driver.buffer.groups) == sorted(issued)
    assert driver.buffer.reserved == 0


def test_prompts_that_fail_on_two_workers_fail_the_run_naming_actor_and_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        supervisor_module, "start_generation_worker", lambda *_: RaisingWorker.remote()
    )
    driver, actors, _ = driver_with(tmp_path, RaisingWorker.remote())
    with pytest.raises(
        GenerationFailed, match=r"failed on 2 actors.*generation worker 0.*engine failed"
    ):
        drive_until(driver, actors, 1)
    assert driver.counters.generation_replacements == 1


def test_a_weight_load_a_worker_gave_up_on_replaces_it_without_counting_against_its_prompts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers in a row fail their weight load holding the same prompts: not the prompts'
    doing, so the run goes on, and the third worker generates them."""
    starts = iter([SwapFailingWorker.remote, None])

    def start(spec: Any, model_dir: Path) -> Any:
        make = next(starts)
        return make() if make is not None else start_generation_worker(spec, model_dir)

    monkeypatch.setattr(supervisor_module, "start_generation_worker", start)
    driver, actors, issued = driver_with(tmp_path, SwapFailingWorker.remote())
    drive_until(driver, actors, len(issued))

    assert driver.counters.generation_replacements == 2
    assert sorted(group.prompt.prompt_id for group in driver.buffer.groups) == sorted(issued)
    assert driver.buffer.reserved == 0


def test_a_worker_that_returns_nothing_past_its_deadline_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Long enough for the replacement's first groups (it is started up front, so the deadline
    # measures generation, not loading: a group of the tiny model takes about a second), short
    # enough to wait out the hung one in a test.
    overrides = ("generation.first_group_timeout_s=12",)
    spec = tiny_spec("pipeline.mode=sync", *overrides)
    replacement = start_generation_worker(spec, resolve_model(spec.model))
    ray.get(replacement.policy_version.remote())  # up and holding the model
    monkeypatch.setattr(supervisor_module, "start_generation_worker", lambda *_: replacement)
    driver, actors, issued = driver_with(tmp_path, HangingWorker.remote(), *overrides)
    hung = actors.generation[0]
    drive_until(driver, actors, len(issued))

    assert driver.counters.generation_replacements == 1
    assert actors.generation[0] is replacement is not hung
    assert sorted(group.prompt.prompt_id for group in driver.buffer.groups) == sorted(issued)
