"""`StoreObserver` and `execute_stored_run`: a run's reports in the control plane's store.

Real stores (the local one and a real redis-server); the last tests are whole tiny runs on a
real local Ray instance: one reporting into both stores at once, one that crashes and is
executed again from its checkpoint, as a restarted Ray job would be.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.observers import MetricsRecord, RunState
from services.pipeline.job import execute_stored_run, run_output_dir
from services.pipeline.launch import execute_run
from services.pipeline.outputs import RunDirectory, format_progress_line, read_metrics
from services.pipeline.store_observer import StoreObserver
from services.store import LocalStore, RedisStore, RetryPolicy, RunStatus, Store
from tests.services.pipeline.conftest import tiny_spec
from tests.services.store.redis_server import RedisServer


def record(step: int, **values: Any) -> dict[str, Any]:
    """A metrics record with the keys a progress line shows."""
    return {
        "step": step,
        "reward_mean": 0.5,
        "accuracy": 0.25,
        "entropy": 1.5,
        "clip_fraction": 0.01,
        "staleness_mean": 0.5,
        "staleness_max": 1.0,
        "rollouts_dropped_stale": 0,
        "step_seconds": 0.2,
        **values,
    }


@pytest.fixture
def local_store(tmp_path: Path) -> Iterator[LocalStore]:
    store = LocalStore(tmp_path / "store")
    try:
        yield store
    finally:
        store.close()


def statuses(store: Store, run_id: str) -> list[str]:
    return [t.status.value for t in store.get_run(run_id).transitions]


def test_reports_become_transitions_metrics_and_log_lines(local_store: LocalStore) -> None:
    run = local_store.create_run({"name": "unit"})
    observer = StoreObserver(local_store, run.id, total_steps=2)
    observer.on_status("running", step=0, resumed_from=None)
    observer.on_metrics(record(1, entropy=math.nan))
    observer.on_metrics(record(2))
    observer.on_status("succeeded", step=2)

    assert statuses(local_store, run.id) == ["queued", "running", "succeeded"]
    stored = local_store.read_metrics(run.id)
    assert [r["step"] for r in stored] == [1, 2]
    assert stored[0]["entropy"] is None  # NaN is not JSON: stored as null, like metrics.jsonl
    assert stored[1] == record(2)
    assert local_store.tail_logs(run.id) == [
        "[kpo] run running",
        format_progress_line(record(1, entropy=None), 2),
        format_progress_line(record(2), 2),
        "[kpo] run succeeded",
    ]
    assert "entropy nan" in local_store.tail_logs(run.id)[1]
    assert observer.final_state == "succeeded"


def test_a_failed_run_keeps_its_error(local_store: LocalStore) -> None:
    run = local_store.create_run({"name": "unit"})
    observer = StoreObserver(local_store, run.id, total_steps=2)
    observer.on_status("running")
    observer.on_status("failed", "RuntimeError: the pipeline stalled")
    stored = local_store.get_run(run.id)
    assert stored.status == RunStatus.FAILED
    assert stored.error == "RuntimeError: the pipeline stalled"
    assert (
        local_store.tail_logs(run.id)[-1] == "[kpo] run failed: RuntimeError: the pipeline stalled"
    )


def test_a_resumed_run_reports_running_again_without_a_second_transition(
    local_store: LocalStore,
) -> None:
    run = local_store.create_run({"name": "unit"})
    StoreObserver(local_store, run.id, total_steps=4).on_status("running", resumed_from=None)
    # The job restarted: a new driver (and observer) resumes from the checkpoint of step 2.
    resumed = StoreObserver(local_store, run.id, total_steps=4)
    resumed.on_status("running", resumed_from=2)
    resumed.on_metrics(record(3))
    resumed.on_status("succeeded")
    assert statuses(local_store, run.id) == ["queued", "running", "succeeded"]
    assert "[kpo] resumed from the checkpoint of step 2" in local_store.tail_logs(run.id)


def test_a_run_cancelled_while_queued_is_asked_to_stop(
    local_store: LocalStore, caplog: pytest.LogCaptureFixture
) -> None:
    run = local_store.create_run({"name": "unit"})
    local_store.transition(run.id, "cancelled", "cancelled before it started")
    asked: list[bool] = []
    observer = StoreObserver(
        local_store, run.id, 2, on_finished_elsewhere=lambda: asked.append(True)
    )
    with caplog.at_level(logging.WARNING):
        observer.on_status("running")
        observer.on_status("cancelled")
    assert asked == [True]
    stored = local_store.get_run(run.id)
    assert stored.status == RunStatus.CANCELLED
    assert stored.error == "cancelled before it started"
    assert "status report skipped" in caplog.text


def test_a_full_outage_buffer_is_logged_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    store = RedisStore.from_url(server.url, policy=RetryPolicy(deadline_s=0.1), buffer_capacity=1)
    try:
        run = store.create_run({"name": "unit"})
        observer = StoreObserver(store, run.id, total_steps=3)
        observer.on_status("running")
        server.kill()
        with caplog.at_level(logging.WARNING):
            observer.on_metrics(record(1))  # buffered; its log line finds the buffer full
            observer.on_metrics(record(2))  # not accepted: logged, not raised
        assert "not stored" in caplog.text and "buffered" in caplog.text
        assert store.pending_writes == 1
        server.start()
        assert store.flush(timeout_s=10)
        observer.on_metrics(record(3))
        observer.on_status("succeeded")
        assert [r["step"] for r in store.read_metrics(run.id)] == [1, 3]
        assert statuses(store, run.id) == ["queued", "running", "succeeded"]
    finally:
        store.close()
        server.stop()


@pytest.mark.usefixtures("ray_instance")
@pytest.mark.timeout(300)
def test_a_real_run_reports_everything_in_order_to_both_stores(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    spec = tiny_spec("pipeline.steps=2")
    stores: list[Store] = [LocalStore(tmp_path / "store"), RedisStore.from_url(redis_server.url)]
    try:
        runs = [store.create_run(spec.model_dump(mode="json")) for store in stores]
        observers = [
            StoreObserver(store, run.id, spec.pipeline.steps)
            for store, run in zip(stores, runs, strict=True)
        ]
        out = tmp_path / "out"
        assert execute_run(spec, RunDirectory(out), observers) == "succeeded"

        written = read_metrics(out)
        assert [r["step"] for r in written] == [1, 2]
        for store, run in zip(stores, runs, strict=True):
            assert statuses(store, run.id) == ["queued", "running", "succeeded"]
            assert store.read_metrics(run.id) == written  # every record, in order, as written
            lines = store.tail_logs(run.id)
            assert lines[0] == "[kpo] run running" and lines[-1] == "[kpo] run succeeded"
            assert lines[1:-1] == [format_progress_line(r, 2) for r in written]
            events = [e.kind for e in store.read_events(run.id)]
            assert events == ["status", "status", "metrics", "metrics", "status"]
    finally:
        for store in stores:
            store.close()


def test_a_stored_run_whose_spec_does_not_validate_is_marked_failed(
    local_store: LocalStore, tmp_path: Path
) -> None:
    run = local_store.create_run({"name": "bad", "generation": {"group_size": 1}})
    assert execute_stored_run(local_store, run.id, tmp_path) == "failed"
    stored = local_store.get_run(run.id)
    assert stored.status == RunStatus.FAILED
    assert stored.error is not None
    assert f"run {run.id}: spec: generation.group_size: " in stored.error
    assert not run_output_dir(tmp_path, run.id).exists()  # nothing started


def test_a_finished_run_is_not_run_again(local_store: LocalStore, tmp_path: Path) -> None:
    run = local_store.create_run({"name": "done"})
    local_store.transition(run.id, "cancelled", "cancelled before it started")
    assert execute_stored_run(local_store, run.id, tmp_path) == "cancelled"
    assert local_store.get_run(run.id).error == "cancelled before it started"


class Crash(BaseException):
    """Ends the driver as a SIGKILL would: nothing reports it (not an `Exception`)."""


class CrashAtStep:
    def __init__(self, step: int) -> None:
        self.step = step

    def on_status(self, state: RunState, error: str | None = None, **details: Any) -> None:
        pass

    def on_metrics(self, record: MetricsRecord) -> None:
        if record["step"] == self.step:
            raise Crash


@pytest.mark.usefixtures("ray_instance")
@pytest.mark.timeout(300)
def test_a_run_executed_again_resumes_from_its_checkpoint_and_stores_each_step_once(
    local_store: LocalStore, tmp_path: Path
) -> None:
    spec = tiny_spec("pipeline.steps=4", "pipeline.checkpoint_every=2")
    run = local_store.create_run(spec.model_dump(mode="json"))
    # The first attempt dies after step 3, past its checkpoint of step 2, without a word.
    first = StoreObserver(local_store, run.id, 4)
    with pytest.raises(Crash):
        execute_run(spec, RunDirectory(run_output_dir(tmp_path, run.id)), [first, CrashAtStep(3)])
    assert local_store.get_run(run.id).status == RunStatus.RUNNING
    assert [r["step"] for r in local_store.read_metrics(run.id)] == [1, 2, 3]

    assert execute_stored_run(local_store, run.id, tmp_path) == "succeeded"
    assert statuses(local_store, run.id) == ["queued", "running", "succeeded"]
    # Step 3 was trained again; the store keeps the record it already had, once.
    assert [r["step"] for r in local_store.read_metrics(run.id)] == [1, 2, 3, 4]
    assert "[kpo] resumed from the checkpoint of step 2" in local_store.tail_logs(run.id)
    assert [r["step"] for r in read_metrics(run_output_dir(tmp_path, run.id))] == [1, 2, 3, 4]
