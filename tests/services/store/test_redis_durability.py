"""Redis restarts: nothing acknowledged is lost, nothing is stored twice, nothing is reordered.

Each test runs its own redis-server (AOF, `appendfsync always`), which it stops or kills.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from services.store import (
    BufferFull,
    RedisStore,
    RetryPolicy,
    RunStatus,
    StoreUnavailable,
)
from tests.services.store.redis_server import RedisServer
from tests.services.store.support import snapshot

# Short deadlines keep the tests fast; the behaviour is the same at the default 2 s.
FAST = RetryPolicy(deadline_s=0.3, first_delay_s=0.01, max_delay_s=0.05)


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_acknowledged_writes_survive_kill_9(own_redis_server: RedisServer) -> None:
    store = RedisStore.from_url(own_redis_server.url, prefix="p", policy=FAST)
    run_ids = [store.create_run({"i": i}, idempotency_key=f"k{i}").id for i in range(4)]
    for i, run_id in enumerate(run_ids):
        store.transition(run_id, RunStatus.RUNNING)
        for step in range(0, 30, 5):
            store.append_metrics(run_id, [{"step": s, "i": i} for s in range(step, step + 5)])
        store.append_event(run_id, "checkpoint", {"i": i})
        store.append_logs(run_id, [f"run {i} line {n}" for n in range(10)])
    store.transition(run_ids[0], RunStatus.SUCCEEDED)
    store.transition(run_ids[1], RunStatus.FAILED, error="diverged")
    before = snapshot(store, run_ids)

    own_redis_server.kill()
    own_redis_server.start()

    with RedisStore.from_url(own_redis_server.url, prefix="p") as fresh:
        assert snapshot(fresh, run_ids) == before
        assert fresh.create_run({"i": 2}, idempotency_key="k2").id == run_ids[2]
    # The instance that was connected when Redis died reconnects by itself.
    assert snapshot(store, run_ids) == before
    store.close()


def test_a_writer_through_a_kill_9_stores_every_step_once(own_redis_server: RedisServer) -> None:
    """Writes in flight when Redis dies (applied or not, acknowledged or not) end up stored once."""
    store = RedisStore.from_url(own_redis_server.url, prefix="p", policy=FAST)
    run_id = store.create_run({}).id
    stop = threading.Event()
    written: list[int] = []  # steps whose calls returned, stored or buffered

    def write() -> None:
        step = 0
        while not stop.is_set():
            store.append_metrics(run_id, [{"step": step}])
            store.append_event(run_id, "tick", {"step": step})
            written.append(step)
            step += 1

    def stored() -> int:
        return len(store.read_metrics(run_id, limit=10_000))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        wait_for(lambda: stored() > 50)
        own_redis_server.kill()
        time.sleep(0.2)
        own_redis_server.start()
        # Let the writer go on a while after the restart, through the drain of its buffer.
        after_restart = len(written)
        wait_for(lambda: stored() > after_restart + 50)
    finally:
        stop.set()
        writer.join(timeout=30)
    assert store.flush(timeout_s=10)

    steps = list(range(len(written)))
    assert [r["step"] for r in store.read_metrics(run_id, limit=10_000)] == steps
    ticks = [e.data["step"] for e in store.read_events(run_id, limit=10_000) if e.kind == "tick"]
    assert ticks == steps
    store.close()


@pytest.mark.parametrize("flushed_by", ["background", "next_write"])
def test_writes_during_an_outage_are_buffered_and_arrive_once_in_order(
    own_redis_server: RedisServer, flushed_by: str
) -> None:
    store = RedisStore.from_url(
        own_redis_server.url,
        prefix="p",
        policy=FAST,
        flush_interval_s=0.05 if flushed_by == "background" else 3600.0,
    )
    run_id = store.create_run({"model": "tiny"}).id
    store.transition(run_id, RunStatus.RUNNING)
    store.append_metrics(run_id, [{"step": s, "loss": 1.0} for s in range(5)])

    own_redis_server.stop()
    started = time.monotonic()
    for step in range(5, 40):
        # Each batch resends the previous step, as a client retrying at its own level would.
        store.append_metrics(
            run_id, [{"step": step - 1, "loss": -1.0}, {"step": step, "loss": 1.0}]
        )
        store.append_logs(run_id, [f"step {step}"])
    assert store.append_event(run_id, "checkpoint", {"step": 39}) is None
    assert store.transition(run_id, RunStatus.SUCCEEDED, buffer=True) is None
    # One retry deadline, then each call queues at once (72 deadlines would take 21 s).
    assert time.monotonic() - started < 5.0
    assert store.pending_writes == 72

    assert store.ping() is False
    with pytest.raises(StoreUnavailable):
        store.get_run(run_id)
    with pytest.raises(StoreUnavailable):
        store.create_run({"model": "other"})
    with pytest.raises(StoreUnavailable):  # not buffered: the caller needs the outcome now
        store.transition(run_id, RunStatus.CANCELLED)

    own_redis_server.start()
    if flushed_by == "background":
        wait_for(lambda: store.pending_writes == 0)
    else:
        store.append_logs(run_id, ["after the outage"])
        assert store.pending_writes == 0

    with RedisStore.from_url(own_redis_server.url, prefix="p") as fresh:
        assert fresh.read_metrics(run_id) == [{"step": s, "loss": 1.0} for s in range(40)]
        events = fresh.read_events(run_id)
        assert [(e.kind, e.data.get("step", e.data.get("status"))) for e in events] == [
            ("status", "queued"),
            ("status", "running"),
            *[("metrics", s) for s in range(40)],
            ("checkpoint", 39),
            ("status", "succeeded"),
        ]
        logs = [f"step {s}" for s in range(5, 40)]
        if flushed_by == "next_write":
            logs.append("after the outage")
        assert fresh.tail_logs(run_id, 1000) == logs
        run = fresh.get_run(run_id)
        assert [t.status for t in run.transitions] == ["queued", "running", "succeeded"]
    store.close()


def test_a_call_that_cannot_be_buffered_stores_the_buffered_writes_first(
    own_redis_server: RedisServer,
) -> None:
    store = RedisStore.from_url(
        own_redis_server.url, prefix="p", policy=FAST, flush_interval_s=3600.0
    )
    run_id = store.create_run({}).id
    store.transition(run_id, RunStatus.RUNNING)
    own_redis_server.stop()
    store.append_metrics(run_id, [{"step": 0}, {"step": 1}])
    own_redis_server.start()

    assert store.transition(run_id, RunStatus.SUCCEEDED).status == RunStatus.SUCCEEDED
    assert store.pending_writes == 0
    kinds = [(e.kind, e.data.get("status")) for e in store.read_events(run_id)]
    assert kinds == [
        ("status", "queued"),
        ("status", "running"),
        ("metrics", None),
        ("metrics", None),
        ("status", "succeeded"),
    ]
    store.close()


def test_a_full_buffer_refuses_writes_and_keeps_what_it_accepted(
    own_redis_server: RedisServer,
) -> None:
    store = RedisStore.from_url(
        own_redis_server.url, prefix="p", policy=FAST, buffer_capacity=3, flush_interval_s=3600.0
    )
    run_id = store.create_run({}).id
    own_redis_server.stop()
    for step in range(3):
        store.append_metrics(run_id, [{"step": step}])
    with pytest.raises(BufferFull, match="this write was not accepted"):
        store.append_metrics(run_id, [{"step": 3}])
    assert store.pending_writes == 3

    own_redis_server.start()
    assert store.flush()
    assert store.read_metrics(run_id) == [{"step": 0}, {"step": 1}, {"step": 2}]
    store.close()


def test_close_reports_writes_it_could_not_store(own_redis_server: RedisServer) -> None:
    store = RedisStore.from_url(own_redis_server.url, prefix="p", policy=FAST)
    run_id = store.create_run({}).id
    own_redis_server.stop()
    store.append_logs(run_id, ["lost if the process ends now"])
    with pytest.raises(StoreUnavailable, match="1 buffered writes could not be stored"):
        store.close()


def test_a_buffered_transition_that_became_illegal_is_rejected_when_applied(
    own_redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    driver = RedisStore.from_url(
        own_redis_server.url, prefix="p", policy=FAST, flush_interval_s=3600.0
    )
    run_id = driver.create_run({}).id
    driver.transition(run_id, RunStatus.RUNNING)
    own_redis_server.stop()
    assert driver.transition(run_id, RunStatus.SUCCEEDED, buffer=True) is None
    own_redis_server.start()
    with RedisStore.from_url(own_redis_server.url, prefix="p") as api:
        api.transition(run_id, RunStatus.CANCELLED)  # the user cancelled meanwhile

    assert driver.flush()
    assert "it cannot become succeeded" in caplog.text
    assert driver.get_run(run_id).status == RunStatus.CANCELLED
    driver.close()


# Keeps the server busy (it serves nobody else meanwhile) for ARGV[1] microseconds.
BUSY_SCRIPT = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - start > tonumber(ARGV[1])
"""


def test_a_write_whose_reply_was_lost_is_applied_once(own_redis_server: RedisServer) -> None:
    """A write sent, then timed out and resent, is stored once, though Redis runs every copy.

    While the server is busy, the first attempt times out after 0.1 s with its command sent;
    once free, the server runs it, and the retry too. Only the op token tells the copies apart:
    the event, the log line and the transition have no step to deduplicate by.
    """
    store = RedisStore.from_url(
        own_redis_server.url,
        prefix="p",
        policy=RetryPolicy(deadline_s=10.0, first_delay_s=0.01, max_delay_s=0.02),
        socket_timeout_s=0.1,
    )
    run_id = store.create_run({}).id
    # Load every script first: a copy sent before its script is loaded would fail with NOSCRIPT
    # when the server gets to it, and so never be a second copy.
    store.append_event(run_id, "warm-up", {})
    store.append_logs(run_id, ["warm-up"])
    store.rewind_metrics(run_id, 0)
    store.transition(store.create_run({}).id, RunStatus.RUNNING)

    def keep_busy() -> None:
        with own_redis_server.client() as client:
            client.eval(BUSY_SCRIPT, 0, 400_000)

    store.append_metrics(run_id, [{"step": s} for s in range(1, 6)])
    writes: list[Callable[[], object]] = [
        lambda: store.append_event(run_id, "note", {"n": 1}),
        lambda: store.append_logs(run_id, ["once"]),
        lambda: store.transition(run_id, RunStatus.RUNNING),
        lambda: store.rewind_metrics(run_id, 2),
    ]
    for write in writes:
        blocker = threading.Thread(target=keep_busy)
        blocker.start()
        time.sleep(0.05)
        write()
        blocker.join()

    notes = [e for e in store.read_events(run_id) if e.kind == "note"]
    assert [e.data for e in notes] == [{"n": 1}]
    assert store.tail_logs(run_id) == ["warm-up", "once"]
    assert [t.status for t in store.get_run(run_id).transitions] == ["queued", "running"]
    rewinds = [e.data for e in store.read_events(run_id) if e.kind == "metrics.rewound"]
    assert rewinds == [{"step": 2}]
    # The second copy of the rewind found its op token: it drops none of the steps trained again.
    store.append_metrics(run_id, [{"step": 3, "again": True}])
    assert store.read_metrics(run_id) == [{"step": 1}, {"step": 2}, {"step": 3, "again": True}]
    store.close()
