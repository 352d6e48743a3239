"""Where a paused run's resume request comes from: the store's `resume` events (StoreObserver) and
the run directory's resume.json (RunDirectory), each answering the same pause the same way every
time it is asked, in this driver or a restarted one; and the guard's state read from events."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.observers import AlertSource, EventObserver, ResumeSource
from services.pipeline.outputs import RunDirectory
from services.pipeline.pause import (
    ACTION_EVENT,
    ALERT_EVENT,
    PAUSED_EVENT,
    REFUSED_FILE,
    RESUME_EVENT,
    RESUMED_EVENT,
    guard_events,
    read_event_lines,
)
from services.pipeline.store_observer import StoreObserver
from services.store import LocalStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    opened = LocalStore(tmp_path / "store")
    try:
        yield opened
    finally:
        opened.close()


def paused(step: int, **extra: Any) -> dict[str, Any]:
    """A `guard.paused` event's data, as the driver reports it."""
    return {"action": "pause", "step": step, "checkpoint": step, "message": "m", **extra}


def test_both_sources_are_event_observers_and_resume_sources(
    tmp_path: Path, store: LocalStore
) -> None:
    run = store.create_run({"name": "t"})
    for observer in (RunDirectory(tmp_path / "run"), StoreObserver(store, run.id, 4)):
        assert isinstance(observer, EventObserver) and isinstance(observer, ResumeSource)


def test_the_store_answers_a_pause_with_the_first_resume_after_it(store: LocalStore) -> None:
    run = store.create_run({"name": "t"})
    observer = StoreObserver(store, run.id, total_steps=10)
    store.append_event(run.id, RESUME_EVENT, {"spec_patch": {"learner": {"lr": 1.0}}})  # early
    observer.on_event(PAUSED_EVENT, paused(5))
    assert observer.take_resume(5) is None
    assert observer.take_resume(3) is None  # no pause of that step
    first = store.append_event(
        run.id, RESUME_EVENT, {"spec_patch": {"learner": {"lr": 1.0e-6}}, "requested_at": 12.5}
    )
    store.append_event(run.id, RESUME_EVENT, {"spec_patch": {}})
    request = observer.take_resume(5)
    assert request is not None
    assert request.spec_patch == {"learner": {"lr": 1.0e-6}}
    assert (request.request_id, request.requested_at, request.problem) == (first, 12.5, None)
    assert observer.take_resume(5) == request  # the same, every time
    # A restarted driver's observer announces the pause again; the same request answers it.
    restarted = StoreObserver(store, run.id, total_steps=10)
    restarted.on_event(PAUSED_EVENT, paused(5))
    assert restarted.take_resume(5) == request
    # A refused one is no longer the answer: the next one is.
    restarted.refuse(request, "invalid")
    second = restarted.take_resume(5)
    assert second is not None and second.spec_patch == {} and second.request_id != first
    # The pause's log line says how to resume.
    assert any("resume with POST /v1/runs/" in line for line in store.tail_logs(run.id))


def test_a_stored_patch_that_is_no_mapping_is_a_problem_for_the_driver(store: LocalStore) -> None:
    run = store.create_run({"name": "t"})
    observer = StoreObserver(store, run.id, total_steps=10)
    observer.on_event(PAUSED_EVENT, paused(2))
    store.append_event(run.id, RESUME_EVENT, {"spec_patch": [1, 2]})
    request = observer.take_resume(2)
    assert request is not None and request.problem == "its spec_patch is not a mapping"


def test_the_guards_state_from_events(store: LocalStore) -> None:
    run = store.create_run({"name": "t"})
    assert guard_events(store, run.id).paused is None
    store.append_event(run.id, ACTION_EVENT, {"action": "warn", "step": 3, "rollbacks": 0})
    store.append_event(run.id, ACTION_EVENT, {"action": "pause", "step": 7, "rollbacks": 0})
    store.append_event(run.id, PAUSED_EVENT, paused(7))
    events = guard_events(store, run.id)
    assert events.actions == 2 and events.rollbacks == 0
    assert events.paused is not None and events.paused["checkpoint"] == 7
    store.append_event(run.id, RESUME_EVENT, {"spec_patch": {}})
    assert guard_events(store, run.id).paused is None  # asked to resume: no longer paused
    store.append_event(run.id, RESUMED_EVENT, {"checkpoint": 7})
    store.append_event(run.id, PAUSED_EVENT, paused(9))
    assert guard_events(store, run.id).paused == paused(9)
    store.append_event(run.id, RESUMED_EVENT, {"checkpoint": 9})
    assert guard_events(store, run.id).paused is None


def test_events_are_read_on_in_pages(store: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("services.pipeline.pause.EVENTS_PAGE", 3)
    run = store.create_run({"name": "t"})
    observer = StoreObserver(store, run.id, total_steps=10)
    for step in range(1, 8):
        observer.on_metrics({"step": step})
    observer.on_event(PAUSED_EVENT, paused(7))
    assert observer.take_resume(7) is None
    store.append_event(run.id, RESUME_EVENT, {"spec_patch": {}})
    request = observer.take_resume(7)
    assert request is not None and request.spec_patch == {}


def write_request(run_dir: Path, body: object) -> None:
    temporary = run_dir / ".resume.json.tmp"
    temporary.write_text(json.dumps(body))
    os.replace(temporary, run_dir / "resume.json")


def test_the_run_directory_takes_resume_json_and_keeps_it_for_that_pause(tmp_path: Path) -> None:
    run_dir = RunDirectory(tmp_path)
    assert run_dir.take_resume(6) is None
    write_request(tmp_path, {"spec_patch": {"learner": {"lr": 2.0e-4}}})
    request = run_dir.take_resume(6)
    assert request is not None and request.spec_patch == {"learner": {"lr": 2.0e-4}}
    assert not (tmp_path / "resume.json").exists()  # taken
    kept = tmp_path / "resumes" / "step-00000006.json"
    assert request.request_id == str(kept) and kept.exists()
    # Asked again (a driver resumed from that checkpoint again): the same request.
    assert RunDirectory(tmp_path).take_resume(6) == request
    # Another pause waits for a request of its own.
    assert run_dir.take_resume(9) is None
    write_request(tmp_path, {})
    other = run_dir.take_resume(9)
    assert other is not None and other.spec_patch == {}


@pytest.mark.parametrize(
    "text",
    ["", '{"spec_patch": {"learner": ', "[1]", '{"patch": {}}', '{"spec_patch": 3}'],
)
def test_a_resume_file_that_is_no_request_yet_is_left_where_it_is(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = RunDirectory(tmp_path)
    (tmp_path / "resume.json").write_text(text)
    assert run_dir.take_resume(4) is None
    assert run_dir.take_resume(4) is None
    assert (tmp_path / "resume.json").exists()
    warnings = [r for r in caplog.records if "is not a resume request yet" in r.message]
    assert len(warnings) == 1  # once per version of the file


def test_a_refused_request_is_moved_aside(tmp_path: Path) -> None:
    run_dir = RunDirectory(tmp_path)
    write_request(tmp_path, {"spec_patch": {"learner": {"batch_size": 3}}})
    request = run_dir.take_resume(4)
    assert request is not None
    run_dir.refuse(request, "learner.batch_size: a resume may change only ...")
    assert (tmp_path / REFUSED_FILE).exists()
    assert run_dir.take_resume(4) is None


def test_the_run_directory_keeps_its_events(tmp_path: Path) -> None:
    run_dir = RunDirectory(tmp_path)
    run_dir.on_event(PAUSED_EVENT, paused(3, value=float("nan")))
    run_dir.on_event(RESUMED_EVENT, {"checkpoint": 3})
    events = read_event_lines(tmp_path)
    assert [e["kind"] for e in events] == [PAUSED_EVENT, RESUMED_EVENT]
    assert events[0]["data"]["value"] is None  # JSON has no NaN


def firing(
    action: str | None, fingerprint: str = "c6eadffa33fcdf37", **extra: Any
) -> dict[str, Any]:
    """An `alert` event's data, as the webhook stores it (services/api/alerts.py)."""
    return {
        "alertname": "KPONoLearnerProgress",
        "status": "firing",
        "action": action,
        "summary": "no learner step for 15 minutes",
        "fingerprint": fingerprint,
        "starts_at": "2026-12-06T09:52:26+02:00",
        **extra,
    }


def test_alerts_ask_a_run_once_per_firing_until_an_action_answers_them(
    store: LocalStore,
) -> None:
    run = store.create_run({"name": "t"})
    observer = StoreObserver(store, run.id, total_steps=10)
    assert isinstance(observer, AlertSource)
    store.append_event(run.id, ALERT_EVENT, firing("warn"))  # the event is all a warn is
    store.append_event(run.id, ALERT_EVENT, firing("pause", status="resolved"))
    store.append_event(run.id, ALERT_EVENT, firing("pause"))
    store.append_event(run.id, ALERT_EVENT, firing("pause"))  # Alertmanager resent it
    store.append_event(run.id, ALERT_EVENT, firing("checkpoint", fingerprint="other"))
    requests = observer.take_alerts()
    assert [(r.action, r.key) for r in requests] == [
        ("pause", "c6eadffa33fcdf37@2026-12-06T09:52:26+02:00"),
        ("checkpoint", "other@2026-12-06T09:52:26+02:00"),
    ]
    assert requests[0].reason == "alert KPONoLearnerProgress"
    assert requests[0].summary == "no learner step for 15 minutes"
    assert observer.take_alerts() == requests  # unanswered: asked again
    # The driver answers the pause: it is not asked again, here nor of a restarted driver.
    observer.on_event(ACTION_EVENT, {"action": "pause", "alert": requests[0].key})
    assert observer.take_alerts() == requests[1:]
    restarted = StoreObserver(store, run.id, total_steps=10)
    assert restarted.take_alerts() == requests[1:]
    # A new firing of the same alert (another start) asks again.
    store.append_event(run.id, ALERT_EVENT, firing("pause", starts_at="2026-12-06T11:00:00+02:00"))
    assert [r.key for r in restarted.take_alerts()] == [
        "other@2026-12-06T09:52:26+02:00",
        "c6eadffa33fcdf37@2026-12-06T11:00:00+02:00",
    ]
