"""The stability guard in the run driver: its keys in each record, warn, cancel, rollback and
pause on a real local Ray run with the tiny model, and its state carried by the driver's
checkpoints."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from typer.testing import CliRunner

from services.cli import app
from services.pipeline.buffer import RolloutBuffer
from services.pipeline.calls import Counters
from services.pipeline.checkpoints import checkpoint_name, latest_checkpoint, read_driver_state
from services.pipeline.driver import RunDriver
from services.pipeline.driver_state import capture_driver_state, restore_driver_state
from services.pipeline.guard import StabilityGuard
from services.pipeline.launch import execute_run
from services.pipeline.outputs import RunDirectory, read_metrics
from services.pipeline.pause import ALERT_EVENT, RESUME_EVENT, read_event_lines
from services.pipeline.prompts import PromptStream
from services.pipeline.store_observer import StoreObserver
from services.store import LocalStore
from tests.services.pipeline.conftest import TINY_RUN, tiny_spec

# Objectives no run keeps: any clipped token, any drop of entropy or reward from its baseline,
# any rise of the gradient norm over its median breaks one, acted on at once.
MUST_BREAK = (
    "stability.enabled=true",
    "stability.patience=1",
    "stability.warmup_steps=0",
    "stability.objectives.clip_fraction_max=0.0",
    "stability.objectives.entropy_min_fraction=0.999",
    "stability.objectives.grad_norm_max_ratio=1.0001",
    "stability.objectives.reward_drop_max=1.0e-9",
)


def status_of(out: Path) -> dict[str, Any]:
    return json.loads((out / "status.json").read_text())


# Clean through the guard's warm-up (steps 1-4), broken at almost every step after: the run
# pauses at step 5 or soon after, and again after a resume (patience 1 re-arms at once).
PAUSING = (
    *MUST_BREAK,
    "stability.action=pause",
    "stability.warmup_steps=4",
    "learner.warmup_steps=0",
    "pipeline.steps=7",
)


def events_of(out: Path, kind: str) -> list[dict[str, Any]]:
    return [event["data"] for event in read_event_lines(out) if event["kind"] == kind]


class Driven:
    """A driver's `run` in a thread; waits on conditions of its run directory."""

    def __init__(self, driver: RunDriver) -> None:
        self.driver = driver
        self.out = driver.run_dir.path
        self.outcome: list[str] = []
        self.thread = threading.Thread(target=lambda: self.outcome.append(driver.run()))
        self.thread.start()

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.thread.is_alive(), f"the run ended ({self.outcome}) before {what}"
            assert time.monotonic() < deadline, f"no {what} in {timeout} s"
            self.thread.join(timeout=0.2)

    def answer_pauses(self, answered: int, timeout: float = 240) -> list[str]:
        """Resume each pause after the first `answered` unchanged until the run ends; its
        outcome."""
        deadline = time.monotonic() + timeout
        while self.thread.is_alive():
            assert time.monotonic() < deadline, f"the run did not end in {timeout} s"
            if len(events_of(self.out, "guard.paused")) > answered:
                request(self.out, {})
                answered += 1
            self.thread.join(timeout=0.2)
        return self.outcome


def request(out: Path, body: dict[str, Any]) -> None:
    """Write RUN_DIR/resume.json whole, as an operator should."""
    written = out / ".resume.json.tmp"
    written.write_text(json.dumps(body))
    os.replace(written, out / "resume.json")


def assert_no_actor_alive(pids: dict[str, list[int]]) -> None:
    """Every actor process of the attempt has ended (Ray's kill takes a moment to land)."""
    actor_pids = {*pids["generation"], *pids["verifiers"], *pids["learner"]}
    assert actor_pids
    processes = []
    for pid in actor_pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            processes.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive


@pytest.mark.usefixtures("ray_instance")
@pytest.mark.timeout(300)
class TestGuardedRuns:
    def test_warn_records_the_action_and_the_run_succeeds(self, tmp_path: Path) -> None:
        settings = (
            *MUST_BREAK,
            "stability.action=warn",
            "pipeline.steps=4",
            "pipeline.checkpoint_every=10",
            "pipeline.keep_checkpoints=10",
        )
        spec = tiny_spec(*settings)
        run_file, out = tmp_path / "run.yaml", tmp_path / "out"
        run_file.write_text(yaml.safe_dump(TINY_RUN))
        overrides = [arg for setting in settings for arg in ("--set", setting)]
        result = CliRunner().invoke(app, ["run", str(run_file), "--out", str(out), *overrides])
        assert result.exit_code == 0, result.output
        records = read_metrics(out)
        assert [r["step"] for r in records] == [1, 2, 3, 4]
        actions = [r["guard_actions_total"] for r in records]
        assert actions[-1] >= 1 and actions == sorted(actions)
        # `kpo run` ends with the guard's summary.
        broken = sum(1 for r in records if r["guard_broken_objectives"])
        assert (
            f"[kpo] stability guard: {actions[-1]} actions, 0 rollbacks, broken objectives at "
            f"{broken} steps"
        ) in result.output
        # The first step with a broken objective opened an episode and asked for a checkpoint
        # (none was healthy): the driver wrote one there, besides the final one.
        first = next(r["step"] for r in records if r["guard_broken_objectives"] > 0)
        assert (out / "checkpoints" / checkpoint_name(first)).is_dir()
        found = latest_checkpoint(out / "checkpoints")
        assert found is not None and found[0] == 4
        guard = read_driver_state(found[1])["guard"]  # saved with the driver's state
        assert guard["seen"] == 4 and guard["last_checkpoint"] == 4
        assert status_of(out)["state"] == "succeeded"
        # A driver resuming from it takes the guard over as it was, and the actions' count.
        resumed = RunDriver(spec, RunDirectory(out), [])
        assert resumed.restore() == 4
        assert resumed.guard is not None and resumed.guard.state() == guard
        assert resumed.counters.guard_actions_total == actions[-1]

    def test_cancel_ends_the_run_cancelled_with_the_guards_reason(self, tmp_path: Path) -> None:
        spec = tiny_spec(*MUST_BREAK, "stability.action=cancel", "pipeline.steps=20")
        assert execute_run(spec, RunDirectory(tmp_path)) == "cancelled"
        records = read_metrics(tmp_path)
        assert records[-1]["guard_actions_total"] == 1
        assert records[-1]["step"] < 20
        status = status_of(tmp_path)
        assert status["state"] == "cancelled"
        guard = status["guard"]
        assert guard["action"] == "cancel"
        assert guard["reason"] in spec.stability.objectives.model_dump()
        assert guard["bound"] is not None and guard["step"] <= records[-1]["step"]
        acted = next(r for r in records if r["guard_actions_total"] == 1)
        assert guard["step"] == acted["step"]
        assert status["error"].startswith("stability guard: ")
        assert guard["reason"] in status["error"]

    def test_rollback_returns_to_the_healthy_checkpoint_with_its_remedy_then_stops_unstable(
        self, tmp_path: Path
    ) -> None:
        # Clean through the guard's warm-up (steps 1-6), broken at almost every step after: the
        # first rollback returns to a checkpoint judged healthy (by three clean steps on its
        # own policy's rollouts, within the warm-up), the next broken objective finds no
        # rollback left (max_rollbacks 1) and stops the run as unstable.
        spec = tiny_spec(
            *MUST_BREAK,
            "stability.warmup_steps=6",
            "stability.action=rollback",
            "stability.max_rollbacks=1",
            "stability.remedy.lr_scale=0.5",
            "learner.warmup_steps=0",
            "pipeline.steps=40",
            "pipeline.checkpoint_every=2",
            "pipeline.keep_checkpoints=1",
        )
        with LocalStore(tmp_path / "store") as store:
            run_id = store.create_run(spec.model_dump(mode="json")).id
            observer = StoreObserver(store, run_id, spec.pipeline.steps)
            assert execute_run(spec, RunDirectory(tmp_path), [observer]) == "failed"
            stored = store.read_metrics(run_id, limit=10_000)
            rewinds = [e.data for e in store.read_events(run_id) if e.kind == "metrics.rewound"]
        status = status_of(tmp_path)
        guard = status["guard"]
        assert guard["action"] == "stop_unstable" and guard["rollbacks"] == 1
        assert status["error"].startswith("stability guard: ") and "unstable" in status["error"]
        target = status["resumed_from"]  # the rollback's checkpoint: healthy, so kept
        assert target >= 2 and target % 2 == 0
        # The steps after the checkpoint were trained again: the records hold each step once.
        records = read_metrics(tmp_path)
        steps = [r["step"] for r in records]
        assert steps == list(range(1, len(steps) + 1))
        # The control plane's history is the same: the rollback dropped the abandoned steps.
        assert rewinds == [{"step": target}]
        assert [(r["step"], r["guard_rollbacks"]) for r in stored] == [
            (r["step"], r["guard_rollbacks"]) for r in records
        ]
        before = [r for r in records if r["guard_rollbacks"] == 0]
        after = [r for r in records if r["guard_rollbacks"] == 1]
        assert before[-1]["step"] == target and after[0]["step"] == target + 1
        assert after[-1]["step"] == guard["step"]  # the step that stopped it is recorded
        # The remedy: the learner trains on at half its rate (its schedule's base rate is the
        # remedied spec's, not the checkpoint's).
        assert all(r["lr"] == pytest.approx(0.5 * before[-1]["lr"]) for r in after)
        # Every response sampled after the checkpoint was dropped and counted.
        dropped = after[0]["rollouts_rolled_back_total"]
        assert dropped > 0 and dropped % spec.generation.group_size == 0
        assert all(r["rollouts_rolled_back_total"] == dropped for r in after)
        assert [r["guard_actions_total"] for r in after] == [1] * (len(after) - 1) + [2]
        # No checkpoint of the abandoned steps is left; the final one holds the rollback.
        found = latest_checkpoint(tmp_path / "checkpoints")
        assert found is not None and found[0] > target
        saved = read_driver_state(found[1])
        assert saved["guard"]["rollbacks"] == 1
        assert saved["counters"]["rollouts_rolled_back_total"] == dropped
        # A driver resumed from it trains with the remedy, as this one did.
        resumed = RunDriver(spec, RunDirectory(tmp_path), [])
        assert resumed.restore() == found[0]
        assert resumed.spec.learner.lr == pytest.approx(0.5 * spec.learner.lr)

    def test_pause_stops_every_actor_until_a_resume_with_a_patch_then_trains_on(
        self, tmp_path: Path
    ) -> None:
        spec = tiny_spec(*PAUSING)
        run = Driven(RunDriver(spec, RunDirectory(tmp_path), []))
        run.wait_for(lambda: bool(events_of(tmp_path, "guard.paused")), "pause")
        [paused] = events_of(tmp_path, "guard.paused")
        step = paused["checkpoint"]
        assert step == paused["step"] >= 5 and paused["action"] == "pause"
        assert paused["reason"] in spec.stability.objectives.model_dump()
        [action] = events_of(tmp_path, "guard.action")
        assert action["step"] == step and action["action"] == "pause"
        # Paused: the step checkpointed (marked paused) and exported, every actor stopped.
        status = status_of(tmp_path)
        assert status["state"] == "running" and status["paused"]["checkpoint"] == step
        assert_no_actor_alive(status["actors"])
        found = latest_checkpoint(tmp_path / "checkpoints")
        assert found is not None and found[0] == step
        assert read_driver_state(found[1])["paused"]["step"] == step
        assert (tmp_path / "model" / "config.json").exists()
        assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, step + 1))
        assert run.thread.is_alive()
        # A request the driver cannot apply is refused and moved aside; the run waits on.
        request(tmp_path, {"spec_patch": {"learner": {"batch_size": 2}}})
        run.wait_for(lambda: (tmp_path / "resume.refused.json").exists(), "refusal")
        [refused] = events_of(tmp_path, "guard.resume_refused")
        assert "learner.batch_size" in refused["reason"]
        assert status_of(tmp_path)["paused"]["checkpoint"] == step
        # Resumed at half the rate; each later pause is resumed unchanged.
        lr = spec.learner.lr
        patch = {"learner": {"lr": lr / 2}}
        request(tmp_path, {"spec_patch": patch})
        assert run.answer_pauses(answered=1) == ["succeeded"]
        records = read_metrics(tmp_path)
        assert [r["step"] for r in records] == list(range(1, 8))
        assert all(r["lr"] == pytest.approx(lr) for r in records if r["step"] <= step)
        assert all(r["lr"] == pytest.approx(lr / 2) for r in records if r["step"] > step)
        resumed = events_of(tmp_path, "guard.resumed")
        assert len(resumed) == len(events_of(tmp_path, "guard.paused"))
        assert resumed[0]["checkpoint"] == step and resumed[0]["spec_patch"] == patch
        assert all(r["in_force"] == patch for r in resumed)  # a later {} keeps the patch
        status = status_of(tmp_path)
        assert status["state"] == "succeeded" and status["paused"] is None
        # The final checkpoint carries the patch: a driver resumed from it trains with it.
        found = latest_checkpoint(tmp_path / "checkpoints")
        assert found is not None and found[0] == 7
        saved = read_driver_state(found[1])
        assert saved["spec_patch"] == patch
        # Marked paused only where the guard paused at the last step (that pause's request,
        # kept in RUN_DIR/resumes/, answers it again for a driver resumed from there).
        last_pause = events_of(tmp_path, "guard.paused")[-1]["checkpoint"]
        assert ("paused" in saved) == (last_pause == 7)
        again = RunDriver(spec, RunDirectory(tmp_path), [])
        assert again.restore() == 7
        assert again.spec.learner.lr == pytest.approx(lr / 2)

    def test_a_cancel_while_paused_ends_cancelled_and_a_resumed_driver_waits_again(
        self, tmp_path: Path
    ) -> None:
        spec = tiny_spec(*PAUSING)
        run = Driven(RunDriver(spec, RunDirectory(tmp_path), []))
        run.wait_for(lambda: bool(events_of(tmp_path, "guard.paused")), "pause")
        step = events_of(tmp_path, "guard.paused")[0]["checkpoint"]
        run.driver.cancel()
        run.thread.join(timeout=60)
        assert run.outcome == ["cancelled"]
        status = status_of(tmp_path)
        assert status["state"] == "cancelled"
        assert status["error"].startswith("cancelled while paused: step ")
        assert status["guard"]["action"] == "pause" and status["guard"]["step"] == step
        assert_no_actor_alive(status["actors"])
        # Its last checkpoint is the pause's, exported; no step after it was trained.
        found = latest_checkpoint(tmp_path / "checkpoints")
        assert found is not None and found[0] == step
        assert (tmp_path / "model" / "config.json").exists()
        assert read_metrics(tmp_path)[-1]["step"] == step
        # Continued later (`kpo resume`), it is still paused there: with the request written
        # beforehand it resumes at once, without announcing the pause again.
        request(tmp_path, {"spec_patch": {"learner": {"lr": spec.learner.lr / 4}}})
        later = Driven(RunDriver(spec, RunDirectory(tmp_path), []))
        later.wait_for(lambda: bool(events_of(tmp_path, "guard.resumed")), "resume")
        assert len(events_of(tmp_path, "guard.paused")) == 1
        assert events_of(tmp_path, "guard.resumed")[0]["checkpoint"] == step
        assert later.answer_pauses(answered=1) == ["succeeded"]
        records = read_metrics(tmp_path)
        assert [r["step"] for r in records] == list(range(1, 8))
        assert all(r["lr"] == pytest.approx(spec.learner.lr / 4) for r in records[step:])

    def test_alerts_checkpoint_and_pause_a_run_without_the_guard(self, tmp_path: Path) -> None:
        # Stored before the run starts, as the webhook stores them (the pause one twice: resent
        # by Alertmanager): answered at the first step, each once.
        store = LocalStore(tmp_path / "store")
        try:
            spec = tiny_spec("pipeline.steps=4", "pipeline.checkpoint_every=3")
            run_id = store.create_run(spec.model_dump(mode="json")).id
            for action, fingerprint in (("checkpoint", "a1"), ("pause", "b2"), ("pause", "b2")):
                store.append_event(
                    run_id,
                    ALERT_EVENT,
                    {
                        "alertname": "KPONoLearnerProgress",
                        "status": "firing",
                        "action": action,
                        "summary": "no learner step",
                        "fingerprint": fingerprint,
                        "starts_at": "2026-12-06T09:52:26+02:00",
                    },
                )
            out = tmp_path / "out"
            observer = StoreObserver(store, run_id, spec.pipeline.steps)
            run = Driven(RunDriver(spec, RunDirectory(out), [observer]))
            run.wait_for(lambda: bool(events_of(out, "guard.paused")), "the alert's pause")
            [paused] = events_of(out, "guard.paused")
            assert paused["checkpoint"] == 1 and paused["reason"].startswith("alert ")
            assert (out / "checkpoints" / checkpoint_name(1)).is_dir()  # not a periodic one
            store.append_event(run_id, RESUME_EVENT, {"spec_patch": {}})
            run.thread.join(timeout=240)
            assert run.outcome == ["succeeded"]
            actions = events_of(out, "guard.action")
            assert sorted((a["action"], a["alert"].split("@")[0]) for a in actions) == [
                ("checkpoint", "a1"),
                ("pause", "b2"),
            ]
            assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
            assert "guard_actions_total" not in read_metrics(out)[-1]  # no guard in this run
        finally:
            store.close()

    def test_default_objectives_fire_nothing_on_a_normal_run(self, tmp_path: Path) -> None:
        spec = tiny_spec("stability.enabled=true", "stability.warmup_steps=1", "pipeline.steps=5")
        assert execute_run(spec, RunDirectory(tmp_path)) == "succeeded"
        records = read_metrics(tmp_path)
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
        assert all(r["guard_actions_total"] == 0 for r in records)


def test_the_guards_state_round_trips_through_the_driver_state() -> None:
    spec = tiny_spec(*MUST_BREAK)
    guard = StabilityGuard(spec.stability)
    for step, entropy in enumerate([1.0, 1.1, 0.5, 0.4], start=1):
        guard.observe({"step": step, "entropy": entropy, "clip_fraction": 0.1 * step})
    guard.checkpointed(4)
    state = capture_driver_state(
        Counters(step=4, guard_actions_total=1),
        1.0,
        PromptStream(spec.task, spec.seed),
        RolloutBuffer(spec.pipeline.buffer_groups, spec.pipeline.max_staleness),
        [],
        None,
        guard.state(),
    )
    restored = restore_driver_state(spec, json.loads(json.dumps(state)))
    assert restored.guard is not None
    assert restored.counters.guard_actions_total == 1
    again = StabilityGuard.from_state(spec.stability, restored.guard)
    assert again.state() == guard.state()
    # Both judge the next step alike.
    record = {"step": 5, "entropy": 0.3, "clip_fraction": 0.0}
    assert again.observe(record) == guard.observe(record)


def test_a_driver_state_without_the_guard_restores_none() -> None:
    spec = tiny_spec()
    state = capture_driver_state(
        Counters(),
        0.0,
        PromptStream(spec.task, spec.seed),
        RolloutBuffer(spec.pipeline.buffer_groups, spec.pipeline.max_staleness),
        [],
        None,
    )
    assert "guard" not in state
    assert restore_driver_state(spec, state).guard is None
