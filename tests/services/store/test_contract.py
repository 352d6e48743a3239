"""The store contract: every backend passes these (see `open_test_store` in conftest)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from services.store import (
    IdempotencyConflict,
    InvalidCursor,
    InvalidTransition,
    QuotaExceeded,
    RunNotFound,
    RunStatus,
    Store,
    event_id_order,
)
from tests.services.store.support import StoreOpener, snapshot

Q, R, S, F, C = (
    RunStatus.QUEUED,
    RunStatus.RUNNING,
    RunStatus.SUCCEEDED,
    RunStatus.FAILED,
    RunStatus.CANCELLED,
)
# The lifecycle, written out by hand (not read from the code under test).
LEGAL_MOVES = {(Q, R), (Q, F), (Q, C), (R, S), (R, F), (R, C)}
# How to bring a new run to each status.
PATH_TO = {Q: [], R: [R], S: [R, S], F: [R, F], C: [R, C]}

SPEC = {"model": "tiny", "learner": {"lr": 1e-3, "steps": 10}, "tags": ["a", "b"]}


def run_in(store: Store, status: RunStatus, spec: dict[str, Any] | None = None) -> str:
    run_id = store.create_run(spec or SPEC).id
    for step in PATH_TO[status]:
        store.transition(run_id, step)
    return run_id


# --- runs ------------------------------------------------------------------------------------


def test_create_returns_a_queued_run_that_get_returns(store: Store) -> None:
    before = datetime.now(UTC)
    run = store.create_run(SPEC)
    after = datetime.now(UTC)

    assert re.fullmatch(r"run-[0-9a-f]{12}", run.id)
    assert run.status == Q
    assert run.spec == SPEC
    assert run.error is None
    assert before - timedelta(milliseconds=1) <= run.created_at <= after
    assert [(t.status, t.at) for t in run.transitions] == [(Q, run.created_at)]
    assert store.get_run(run.id) == run
    assert store.create_run(SPEC).id != run.id


def test_unknown_runs_are_not_found(store: Store) -> None:
    store.create_run(SPEC)
    for run_id in ["run-000000000000", "nonsense", "run-x:metrics", ""]:
        with pytest.raises(RunNotFound, match="no run with id"):
            store.get_run(run_id)
    missing = "run-000000000000"
    calls: list[Callable[[], object]] = [
        lambda: store.transition(missing, R),
        lambda: store.request_cancel(missing),
        lambda: store.append_metrics(missing, [{"step": 0}]),
        lambda: store.read_metrics(missing),
        lambda: store.append_event(missing, "note", {}),
        lambda: store.read_events(missing),
        lambda: store.append_logs(missing, ["x"]),
        lambda: store.tail_logs(missing),
        lambda: store.tail_logs(missing, 0),
    ]
    for call in calls:
        with pytest.raises(RunNotFound):
            call()


def test_list_is_newest_first_in_stable_pages(store: Store) -> None:
    created = [store.create_run({"i": i}).id for i in range(7)]

    first, cursor = store.list_runs(limit=3)
    assert [r.id for r in first] == created[::-1][:3]
    assert cursor is not None
    # A run created between pages does not shift the pages already being read.
    newest = store.create_run({"i": 7}).id
    second, cursor = store.list_runs(limit=3, cursor=cursor)
    assert [r.id for r in second] == created[::-1][3:6]
    third, cursor = store.list_runs(limit=3, cursor=cursor)
    assert [r.id for r in third] == created[:1]
    assert cursor is None

    everything, cursor = store.list_runs(limit=100)
    assert [r.id for r in everything] == [newest, *created[::-1]]
    assert cursor is None
    # A page that ends exactly at the last run says so.
    exact, cursor = store.list_runs(limit=8)
    assert len(exact) == 8 and cursor is None


def test_list_filters_by_status(store: Store) -> None:
    by_status = {status: [run_in(store, status) for _ in range(2)] for status in RunStatus}
    for status, ids in by_status.items():
        runs, cursor = store.list_runs(status=status)
        assert [r.id for r in runs] == ids[::-1]
        assert all(r.status == status for r in runs)
        assert cursor is None
    runs, cursor = store.list_runs(status="running", limit=1)
    assert [r.id for r in runs] == [by_status[R][1]]
    runs, cursor = store.list_runs(status="running", limit=1, cursor=cursor)
    assert [r.id for r in runs] == [by_status[R][0]]


def test_list_refuses_bad_arguments(store: Store) -> None:
    with pytest.raises(ValueError, match="valid statuses: queued, running"):
        store.list_runs(status="done")
    for cursor in ["abc", "-1", "0", "", "1.5"]:
        with pytest.raises(InvalidCursor):
            store.list_runs(cursor=cursor)
    for limit in [0, -1, 10**9]:
        with pytest.raises(ValueError, match="limit"):
            store.list_runs(limit=limit)


def test_same_idempotency_key_and_spec_returns_the_same_run(store: Store) -> None:
    first = store.create_run(SPEC, idempotency_key="key-1")
    reordered = {"tags": ["a", "b"], "learner": {"steps": 10, "lr": 1e-3}, "model": "tiny"}
    second = store.create_run(reordered, idempotency_key="key-1")

    assert second == first
    assert [r.id for r in store.list_runs()[0]] == [first.id]
    # Another key is another run.
    assert store.create_run(SPEC, idempotency_key="key-2").id != first.id


def test_same_idempotency_key_with_another_spec_conflicts(store: Store) -> None:
    first = store.create_run(SPEC, idempotency_key="key-1")
    with pytest.raises(IdempotencyConflict, match=f"already created run '{first.id}'"):
        store.create_run({**SPEC, "model": "other"}, idempotency_key="key-1")
    assert len(store.list_runs()[0]) == 1


def test_an_idempotency_key_expires_once_its_run_has_been_finished_that_long(
    store: Store,
) -> None:
    ttl_s = 1.0
    finished = store.create_run(SPEC, idempotency_key="done", idempotency_ttl_s=ttl_s)
    active = store.create_run(SPEC, idempotency_key="active", idempotency_ttl_s=ttl_s)
    store.transition(finished.id, R)
    finished_at = store.transition(finished.id, S).transitions[-1].at
    # Just finished: the key still names its run, conflicts included.
    with pytest.raises(IdempotencyConflict):
        store.create_run({**SPEC, "model": "other"}, idempotency_key="done", idempotency_ttl_s=1)
    # A resend returns the finished run until the key expires; then it makes a new run.
    deadline = time.monotonic() + 10
    while (again := store.create_run(SPEC, "done", idempotency_ttl_s=ttl_s)).id == finished.id:
        assert time.monotonic() < deadline, "the key of a finished run never expired"
        time.sleep(0.05)
    # (a few ms of slack: the two timestamps are taken on either side of a store call)
    assert again.created_at - finished_at >= timedelta(seconds=ttl_s - 0.05)
    assert again.status == Q and store.get_run(finished.id).status == S
    assert store.create_run(SPEC, "done", idempotency_ttl_s=ttl_s).id == again.id
    # The key of a run that has not finished holds, however long ago the run was made.
    assert store.create_run(SPEC, "active", idempotency_ttl_s=ttl_s).id == active.id


def test_concurrent_creates_never_make_more_active_runs_than_allowed(
    open_test_store: StoreOpener,
) -> None:
    limit, extra = 6, 5
    first = open_test_store()
    run_in(first, S)  # finished runs do not count
    stores = [open_test_store() for _ in range(limit + extra)]  # one client per caller
    start = threading.Barrier(len(stores))

    def create(index: int) -> str | QuotaExceeded:
        start.wait(timeout=30)
        try:
            return stores[index].create_run({"i": index}, max_active=limit).id
        except QuotaExceeded as refused:
            return refused

    with ThreadPoolExecutor(len(stores)) as pool:
        outcomes = list(pool.map(create, range(len(stores))))
    made = [outcome for outcome in outcomes if isinstance(outcome, str)]
    refused = [outcome for outcome in outcomes if isinstance(outcome, QuotaExceeded)]
    assert len(made) == limit and len(refused) == extra
    assert all(error.limit == limit and f"{limit} runs" in str(error) for error in refused)
    assert {run.id for run in first.list_runs(status=Q, limit=100)[0]} == set(made)
    # Running runs count too; a finished one frees its place.
    first.transition(made[0], R)
    with pytest.raises(QuotaExceeded):
        first.create_run(SPEC, max_active=limit)
    first.transition(made[0], C)
    assert first.create_run(SPEC, max_active=limit).status == Q


def test_a_resend_returns_its_run_when_no_new_run_is_allowed(store: Store) -> None:
    keyed = store.create_run(SPEC, idempotency_key="key-1", max_active=2)
    store.create_run(SPEC, max_active=2)
    with pytest.raises(QuotaExceeded):
        store.create_run(SPEC, idempotency_key="key-2", max_active=2)
    assert store.create_run(SPEC, idempotency_key="key-1", max_active=2) == keyed
    with pytest.raises(ValueError, match="max_active"):
        store.create_run(SPEC, max_active=0)


# --- lifecycle -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [[R, S], [R, F], [R, C], [F], [C]])
def test_legal_paths_are_recorded_with_timestamps(store: Store, path: list[RunStatus]) -> None:
    run = store.create_run(SPEC)
    for status in path:
        updated = store.transition(run.id, status)
        assert updated.status == status
    final = store.get_run(run.id)
    assert final == updated
    assert [t.status for t in final.transitions] == [Q, *path]
    times = [t.at for t in final.transitions]
    assert times == sorted(times)
    assert times[0] == final.created_at


@pytest.mark.parametrize("current", list(RunStatus))
def test_every_move_the_lifecycle_forbids_is_refused(store: Store, current: RunStatus) -> None:
    for requested in RunStatus:
        if (current, requested) in LEGAL_MOVES:
            continue
        run_id = run_in(store, current)
        before = store.get_run(run_id)
        with pytest.raises(InvalidTransition, match=f"is {current}; it cannot become {requested}"):
            store.transition(run_id, requested)
        assert store.get_run(run_id) == before


def test_a_failed_run_keeps_its_error(open_test_store: StoreOpener) -> None:
    store = open_test_store()
    failed = run_in(store, R)
    run = store.transition(failed, "failed", error="CUDA out of memory at step 12")
    assert run.status == F
    assert run.error == "CUDA out of memory at step 12"
    cancelled = store.transition(run_in(store, Q), C, error="cancelled by alice")
    assert cancelled.error == "cancelled by alice"
    with pytest.raises(ValueError, match="only with failed or cancelled"):
        store.transition(run_in(store, R), S, error="not an error")
    assert open_test_store().get_run(failed).error == "CUDA out of memory at step 12"


# --- cancel requests -------------------------------------------------------------------------


@pytest.mark.parametrize("status", [Q, R])
def test_a_cancel_request_is_stamped_once_and_outlives_the_instance(
    open_test_store: StoreOpener, status: RunStatus
) -> None:
    store = open_test_store()
    run = store.get_run(run_in(store, status))
    assert run.cancel_requested_at is None
    before = datetime.now(UTC)
    requested = store.request_cancel(run.id)
    after = datetime.now(UTC)

    assert requested.cancel_requested_at is not None
    assert before - timedelta(milliseconds=1) <= requested.cancel_requested_at <= after
    # Only the request is recorded: the run's driver records `cancelled` once it has stopped.
    assert requested == run.model_copy(
        update={"cancel_requested_at": requested.cancel_requested_at}
    )
    assert store.get_run(run.id) == requested
    assert [e.kind for e in store.read_events(run.id)] == ["status"] * len(run.transitions)
    # A second request (a resent cancel, another replica's) keeps the first one's time.
    assert store.request_cancel(run.id) == requested
    assert open_test_store().get_run(run.id) == requested
    # The request stays on the run through its last transition.
    cancelled = store.transition(run.id, C, error="cancelled by alice")
    assert cancelled.cancel_requested_at == requested.cancel_requested_at


@pytest.mark.parametrize("status", [S, F, C])
def test_a_cancel_request_leaves_a_finished_run_as_it_is(store: Store, status: RunStatus) -> None:
    run = store.get_run(run_in(store, status))
    assert store.request_cancel(run.id) == run
    assert store.get_run(run.id) == run


def test_concurrent_cancel_requests_agree_on_one_time(open_test_store: StoreOpener) -> None:
    # A store per thread, as replicas of the control plane each have their own.
    stores = [open_test_store() for _ in range(8)]
    run_id = run_in(stores[0], R)
    barrier = threading.Barrier(len(stores))

    def request(store: Store) -> datetime | None:
        barrier.wait()
        return store.request_cancel(run_id).cancel_requested_at

    with ThreadPoolExecutor(len(stores)) as pool:
        times = set(pool.map(request, stores))
    assert len(times) == 1 and None not in times
    assert stores[0].get_run(run_id).cancel_requested_at in times


# --- driver restarts -------------------------------------------------------------------------


def test_the_driver_restart_count_only_rises_and_outlives_the_instance(
    open_test_store: StoreOpener,
) -> None:
    store = open_test_store()
    run = store.get_run(run_in(store, R))
    assert run.driver_restarts == 0
    once = store.record_driver_restarts(run.id, 1)
    assert once == run.model_copy(update={"driver_restarts": 1})
    # A retry, or a second control plane restarting the same lost driver, counts nothing more;
    # a lower count (from a control plane that read the run before) takes nothing back.
    assert store.record_driver_restarts(run.id, 1) == once
    assert store.record_driver_restarts(run.id, 0) == once
    assert store.record_driver_restarts(run.id, 3).driver_restarts == 3
    assert open_test_store().get_run(run.id).driver_restarts == 3
    # The count stays on the run through its last transition, and is not an event.
    assert [e.kind for e in store.read_events(run.id)] == ["status"] * len(run.transitions)
    assert store.transition(run.id, S).driver_restarts == 3
    with pytest.raises(ValueError, match="never negative"):
        store.record_driver_restarts(run.id, -1)
    with pytest.raises(RunNotFound):
        store.record_driver_restarts("run-000000000000", 1)


@pytest.mark.parametrize("status", [S, F, C])
def test_a_finished_runs_restart_count_is_left_as_it_is(store: Store, status: RunStatus) -> None:
    run = store.get_run(run_in(store, status))
    assert store.record_driver_restarts(run.id, 2) == run


def test_concurrent_restart_counts_end_at_the_highest(open_test_store: StoreOpener) -> None:
    stores = [open_test_store() for _ in range(8)]
    run_id = run_in(stores[0], R)
    barrier = threading.Barrier(len(stores))

    def record(pair: tuple[int, Store]) -> int:
        count, store = pair
        barrier.wait()
        return store.record_driver_restarts(run_id, count).driver_restarts

    with ThreadPoolExecutor(len(stores)) as pool:
        seen = list(pool.map(record, enumerate(stores, start=1)))
    # Each caller sees at least its own count, and the run ends at the highest of them.
    assert all(count >= own for own, count in enumerate(seen, start=1))
    assert stores[0].get_run(run_id).driver_restarts == len(stores)


# --- metrics ---------------------------------------------------------------------------------


def test_metrics_are_stored_once_in_step_order(store: Store) -> None:
    run_id = run_in(store, R)
    store.append_metrics(run_id, [{"step": 0, "loss": 1.5}, {"step": 1, "loss": 1.25}])
    # Resent after a retry, with a new record behind: only step 2 is new. A resent record's
    # content is not used, even if it changed.
    store.append_metrics(run_id, [{"step": 1, "loss": 99.0}, {"step": 2, "loss": 1.0}])
    # Out of order within a batch: 4 is stored, then 3 is behind it and ignored.
    store.append_metrics(run_id, [{"step": 4, "loss": 0.5}, {"step": 3, "loss": 0.75}])
    store.append_metrics(run_id, [])

    assert store.read_metrics(run_id) == [
        {"step": 0, "loss": 1.5},
        {"step": 1, "loss": 1.25},
        {"step": 2, "loss": 1.0},
        {"step": 4, "loss": 0.5},
    ]


def test_read_metrics_since_a_step_and_up_to_a_limit(store: Store) -> None:
    run_id = run_in(store, R)
    store.append_metrics(run_id, [{"step": s, "reward": s / 10} for s in range(0, 20, 2)])

    assert [r["step"] for r in store.read_metrics(run_id, since_step=9)] == [10, 12, 14, 16, 18]
    assert [r["step"] for r in store.read_metrics(run_id, since_step=10)] == [12, 14, 16, 18]
    assert [r["step"] for r in store.read_metrics(run_id, since_step=-1, limit=2)] == [0, 2]
    assert store.read_metrics(run_id, since_step=18) == []
    assert store.read_metrics(run_in(store, R)) == []
    with pytest.raises(ValueError, match="since_step"):
        store.read_metrics(run_id, since_step=-2)


def test_a_rewind_drops_the_records_after_its_step_and_the_steps_done_again_replace_them(
    store: Store,
) -> None:
    run_id = run_in(store, R)
    store.append_metrics(run_id, [{"step": s, "attempt": 1} for s in range(1, 8)])
    store.rewind_metrics(run_id, 3)
    assert store.read_metrics(run_id) == [{"step": s, "attempt": 1} for s in (1, 2, 3)]
    # The steps trained again are stored, though the first attempt had reached step 7.
    store.append_metrics(run_id, [{"step": s, "attempt": 2} for s in range(4, 10)])
    assert store.read_metrics(run_id) == [
        *({"step": s, "attempt": 1} for s in (1, 2, 3)),
        *({"step": s, "attempt": 2} for s in range(4, 10)),
    ]
    assert [r["step"] for r in store.read_metrics(run_id, since_step=5, limit=2)] == [6, 7]
    # At or above the last step a rewind changes nothing and tells nothing; to 0 drops all.
    store.rewind_metrics(run_id, 9)
    store.rewind_metrics(run_id, 12)
    kinds = [(e.kind, e.data) for e in store.read_events(run_id) if e.kind != "metrics"]
    assert kinds[-1] == ("metrics.rewound", {"step": 3})
    assert [k for k, _ in kinds].count("metrics.rewound") == 1
    store.rewind_metrics(run_id, 0)
    assert store.read_metrics(run_id) == []
    store.append_metrics(run_id, [{"step": 1, "attempt": 3}])
    assert store.read_metrics(run_id) == [{"step": 1, "attempt": 3}]
    # The rewinds sit in order among the metrics events that the dashboard replays.
    told = [
        (e.kind, e.data.get("step"))
        for e in store.read_events(run_id)
        if e.kind.startswith("metrics")
    ]
    assert told == [
        *(("metrics", s) for s in range(1, 8)),
        ("metrics.rewound", 3),
        *(("metrics", s) for s in range(4, 10)),
        ("metrics.rewound", 0),
        ("metrics", 1),
    ]


def test_a_rewind_of_an_unknown_run_or_to_a_bad_step_is_refused(store: Store) -> None:
    with pytest.raises(RunNotFound):
        store.rewind_metrics("run-000000000000", 3)
    run_id = run_in(store, R)
    for bad in (-1, True, 2.0, "3"):
        with pytest.raises(ValueError, match="a rewind's step must be an integer"):
            store.rewind_metrics(run_id, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="written by the store itself"):
        store.append_event(run_id, "metrics.rewound", {"step": 0})


@pytest.mark.parametrize(
    "record", [{"loss": 1.0}, {"step": True}, {"step": -1}, {"step": 1.0}, {"step": "3"}]
)
def test_metrics_need_an_integer_step(store: Store, record: dict[str, Any]) -> None:
    run_id = run_in(store, R)
    with pytest.raises(ValueError, match="'step' must be an integer"):
        store.append_metrics(run_id, [{"step": 0}, record])
    assert store.read_metrics(run_id) == []  # a batch is checked whole before any is stored


# --- events ----------------------------------------------------------------------------------


def test_events_tell_status_changes_and_metrics_in_order(store: Store) -> None:
    run_id = store.create_run(SPEC).id
    store.transition(run_id, R)
    store.append_metrics(run_id, [{"step": 0, "loss": 2.0}, {"step": 1, "loss": 1.0}])
    store.append_metrics(run_id, [{"step": 1, "loss": 1.0}])  # a resend: no new event
    note_id = store.append_event(run_id, "checkpoint", {"path": "/ckpt/1"})
    store.transition(run_id, F, error="boom")

    events = store.read_events(run_id)
    assert [(e.kind, e.data) for e in events] == [
        ("status", {"status": "queued", "error": None}),
        ("status", {"status": "running", "error": None}),
        ("metrics", {"step": 0, "loss": 2.0}),
        ("metrics", {"step": 1, "loss": 1.0}),
        ("checkpoint", {"path": "/ckpt/1"}),
        ("status", {"status": "failed", "error": "boom"}),
    ]
    assert events[4].id == note_id
    orders = [event_id_order(e.id) for e in events]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)
    run = store.get_run(run_id)
    assert [e.at for e in events if e.kind == "status"] == [t.at for t in run.transitions]


def test_events_resume_after_an_id(store: Store) -> None:
    run_id = run_in(store, R)
    store.append_metrics(run_id, [{"step": s} for s in range(5)])
    events = store.read_events(run_id)
    assert len(events) == 7  # queued, running, 5 metrics

    for k, event in enumerate(events):
        assert store.read_events(run_id, after_id=event.id) == events[k + 1 :]
    assert store.read_events(run_id, after_id=events[1].id, limit=2) == events[2:4]
    # New events follow the last one a client saw.
    store.append_metrics(run_id, [{"step": 5}])
    newer = store.read_events(run_id, after_id=events[-1].id)
    assert [(e.kind, e.data) for e in newer] == [("metrics", {"step": 5})]
    assert event_id_order(newer[0].id) > event_id_order(events[-1].id)


def test_events_refuse_bad_kinds_and_ids(store: Store) -> None:
    run_id = run_in(store, R)
    for kind in ["status", "metrics"]:
        with pytest.raises(ValueError, match="written by the store itself"):
            store.append_event(run_id, kind, {})
    for kind in ["", "two words", "line\nbreak", "x" * 65]:
        with pytest.raises(ValueError, match="event kind"):
            store.append_event(run_id, kind, {})
    for after_id in ["abc", "1-2-3", "-1", "1 "]:
        with pytest.raises(InvalidCursor):
            store.read_events(run_id, after_id=after_id)


# --- logs ------------------------------------------------------------------------------------


def test_logs_keep_a_bounded_tail(open_test_store: StoreOpener) -> None:
    store = open_test_store(max_log_lines=5)
    run_id = run_in(store, R)
    other = run_in(store, R)
    store.append_logs(run_id, ["a", "b", "c"])
    store.append_logs(other, ["other"])
    assert store.tail_logs(run_id, 10) == ["a", "b", "c"]
    store.append_logs(run_id, ["d", "e", "f", "g"])

    assert store.tail_logs(run_id, 10) == ["c", "d", "e", "f", "g"]
    assert store.tail_logs(run_id, 2) == ["f", "g"]
    assert store.tail_logs(run_id, 0) == []
    assert store.tail_logs(other) == ["other"]
    # Batches bigger than the bound keep their own tail.
    store.append_logs(run_id, [f"line {i}" for i in range(3000)])
    assert store.tail_logs(run_id) == [f"line {i}" for i in range(2995, 3000)]
    with pytest.raises(TypeError, match="not one string"):
        store.append_logs(run_id, "abc")


# --- restart ---------------------------------------------------------------------------------


def test_a_new_instance_finds_everything(open_test_store: StoreOpener) -> None:
    store = open_test_store()
    done = run_in(store, S, {"n": 1})
    failed = store.transition(run_in(store, R, {"n": 2}), F, error="diverged").id
    keyed = store.create_run({"n": 3}, idempotency_key="k")
    store.append_metrics(done, [{"step": s, "reward": s * 0.5} for s in range(10)])
    store.append_event(done, "checkpoint", {"step": 9})
    store.append_logs(done, ["hello", "world"])
    before = snapshot(store, [done, failed, keyed.id])
    store.close()

    reopened = open_test_store()
    assert snapshot(reopened, [done, failed, keyed.id]) == before
    # The idempotency key and the metrics high-water mark survived too.
    assert reopened.create_run({"n": 3}, idempotency_key="k") == keyed
    reopened.append_metrics(done, [{"step": 9}, {"step": 10}])
    assert [r["step"] for r in reopened.read_metrics(done, since_step=8)] == [9, 10]


def test_ping_and_records_as_json(store: Store) -> None:
    assert store.ping() is True
    run = store.create_run(SPEC)
    dumped = run.model_dump(mode="json")
    assert dumped["status"] == "queued"
    assert dumped["cancel_requested_at"] is None
    assert dumped["transitions"][0]["status"] == "queued"
    assert store.pending_writes == 0
    assert store.flush() is True
