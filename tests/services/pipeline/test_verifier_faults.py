"""The driver's handling of a batch whose verifier actor dies on it, on a real local Ray.

`DyingVerifier` stands in for a verifier that a batch crashes: a real actor process that exits
on every call. Killing real verifier actors mid-run is in tests/chaos.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray

from services.messages import Response
from services.pipeline import supervisor as supervisor_module
from services.pipeline.actors import RunActors, start_verifier
from services.pipeline.calls import VERIFIER_LOST, ScoringFailed
from services.pipeline.driver import FaultBudgetExhausted, RunDriver
from services.pipeline.outputs import RunDirectory
from tests.services.pipeline.conftest import tiny_spec

pytestmark = [pytest.mark.usefixtures("ray_instance"), pytest.mark.timeout(120)]


@ray.remote(num_cpus=0)
class DyingVerifier:
    def score(self, groups: object) -> None:
        os._exit(1)


def drive_scoring(
    driver: RunDriver, actors: RunActors, verifiers: list[ray.actor.ActorHandle]
) -> None:
    """Score two groups through `driver`, completing calls until none is pending."""
    prompts = driver.prompts.take(2)
    driver.buffer.reserve(len(prompts))
    groups = [
        [Response(p.prompt_id, [5, 6], [7, 2], [-0.5, -0.25], "stop", 0, "#### 1")] * 2
        for p in prompts
    ]
    driver._score(actors, 0, prompts, groups)
    while driver._pending:
        ready, _ = ray.wait(list(driver._pending), num_returns=1, timeout=60)
        assert ready, "a scoring call neither finished nor failed"
        for ref in ready:
            driver._complete(actors, ref, driver._pending.pop(ref))


def test_a_batch_that_kills_its_verifier_twice_is_marked_unverified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[ray.actor.ActorHandle] = []

    def start_dying(_spec: object) -> ray.actor.ActorHandle:
        started.append(DyingVerifier.remote())
        return started[-1]

    monkeypatch.setattr(supervisor_module, "start_verifier", start_dying)
    driver = RunDriver(tiny_spec(), RunDirectory(tmp_path / "out"), [])
    actors = RunActors(generation=[], verifiers=[DyingVerifier.remote()], learner=None)
    drive_scoring(driver, actors, started)

    c = driver.counters
    assert (c.verifier_replacements, c.rescored_groups, c.unverified_groups) == (2, 2, 2)
    assert actors.verifiers[0] is started[-1]
    responses = [r for group in driver.buffer.groups for r in group.responses]
    assert len(responses) == 4
    assert all(r.reward == 0.0 and not r.verified for r in responses)
    assert {r.failure for r in responses} == {VERIFIER_LOST}
    assert driver.buffer.reserved == 0


def test_a_batch_whose_verifier_dies_once_is_scored_by_the_replacement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = tiny_spec()
    monkeypatch.setattr(supervisor_module, "start_verifier", start_verifier)
    driver = RunDriver(spec, RunDirectory(tmp_path / "out"), [])
    actors = RunActors(generation=[], verifiers=[DyingVerifier.remote()], learner=None)
    drive_scoring(driver, actors, [])
    c = driver.counters
    assert (c.verifier_replacements, c.rescored_groups, c.unverified_groups) == (1, 2, 0)
    responses = [r for group in driver.buffer.groups for r in group.responses]
    assert len(responses) == 4 and all(r.verified for r in responses)


def test_no_replacement_left_fails_with_the_setting_named(tmp_path: Path) -> None:
    driver = RunDriver(
        tiny_spec("pipeline.actor_replacements=0"), RunDirectory(tmp_path / "out"), []
    )
    actors = RunActors(generation=[], verifiers=[DyingVerifier.remote()], learner=None)
    with pytest.raises(FaultBudgetExhausted, match=r"pipeline.actor_replacements = 0"):
        drive_scoring(driver, actors, [])


@ray.remote(num_cpus=0)
class RaisingVerifier:
    """A verifier that is alive but raises on every batch (a bug, or a batch it cannot take)."""

    def score(self, groups: object) -> None:
        raise ValueError("verifier bug on this batch")


def test_a_batch_a_verifier_raises_on_is_scored_by_another_actor(tmp_path: Path) -> None:
    driver = RunDriver(tiny_spec(), RunDirectory(tmp_path / "out"), [])
    verifiers = [RaisingVerifier.remote(), start_verifier(tiny_spec())]
    actors = RunActors(generation=[], verifiers=verifiers, learner=None)
    drive_scoring(driver, actors, [])
    c = driver.counters
    # Nothing died: no replacement, the groups scored by the other actor.
    assert (c.verifier_replacements, c.rescored_groups, c.unverified_groups) == (0, 2, 0)
    assert actors.verifiers == verifiers
    responses = [r for group in driver.buffer.groups for r in group.responses]
    assert len(responses) == 4 and all(r.verified for r in responses)


def test_a_batch_verifiers_raise_on_twice_fails_the_run_naming_actor_and_error(
    tmp_path: Path,
) -> None:
    driver = RunDriver(tiny_spec(), RunDirectory(tmp_path / "out"), [])
    actors = RunActors(generation=[], verifiers=[RaisingVerifier.remote()], learner=None)
    with pytest.raises(
        ScoringFailed, match=r"verifier actor 0, raised: ValueError..verifier bug on this"
    ):
        drive_scoring(driver, actors, [])
