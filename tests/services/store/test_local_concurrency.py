"""The local store with one writer process and concurrent reader processes on the same file."""

from __future__ import annotations

import multiprocessing
import traceback
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

from services.store import LocalStore, RunStatus, event_id_order

STEPS = 300
READERS = 2


def write_run(directory: Path, run_id: str) -> None:
    """The writer: the run's whole life, one metrics record per step, in small transactions."""
    store = LocalStore(directory)
    store.transition(run_id, RunStatus.RUNNING)
    for step in range(0, STEPS, 3):
        # Each batch resends the previous record, as a retrying client would.
        batch = [{"step": s, "loss": 1 / (s + 1)} for s in range(max(step - 1, 0), step + 3)]
        store.append_metrics(run_id, batch)
        store.append_logs(run_id, [f"step {step}"])
    store.transition(run_id, RunStatus.SUCCEEDED)
    store.close()


def read_until_done(directory: Path, run_id: str, ready: Queue[Any], results: Queue[Any]) -> None:
    """A reader: checks every snapshot it sees until the run has succeeded; reports what it saw
    (or the traceback of the first inconsistency)."""
    try:
        store = LocalStore(directory)
        ready.put(True)
        reads = 0
        partial_reads = 0
        while True:
            run = store.get_run(run_id)
            steps = [r["step"] for r in store.read_metrics(run_id, limit=10_000)]
            # Whatever moment it reads, a reader sees a whole prefix of the history, in order.
            assert steps == list(range(len(steps))), steps
            events = store.read_events(run_id, limit=10_000)
            orders = [event_id_order(e.id) for e in events]
            assert orders == sorted(orders)
            metric_steps = [e.data["step"] for e in events if e.kind == "metrics"]
            assert metric_steps == list(range(len(metric_steps)))
            reads += 1
            partial_reads += 0 < len(steps) < STEPS
            if run.status == RunStatus.SUCCEEDED:
                # Once it has succeeded, everything written before is there.
                assert steps == list(range(STEPS))
                assert len(metric_steps) == STEPS
                break
        store.close()
        results.put(("ok", reads, partial_reads))
    except BaseException:
        results.put(("error", traceback.format_exc(), 0))


def test_readers_see_consistent_snapshots_while_a_writer_writes(tmp_path: Path) -> None:
    directory = tmp_path / "data"
    with LocalStore(directory) as store:
        run_id = store.create_run({"model": "tiny"}).id

    # spawn, not fork: each process opens the SQLite file itself, as separate programs would.
    context = multiprocessing.get_context("spawn")
    ready: Queue[Any] = context.Queue()
    results: Queue[Any] = context.Queue()
    readers = [
        context.Process(target=read_until_done, args=(directory, run_id, ready, results))
        for _ in range(READERS)
    ]
    for reader in readers:
        reader.start()
    # The writer starts once every reader is reading, so that reads overlap the writes.
    for _ in readers:
        ready.get(timeout=60)
    writer = context.Process(target=write_run, args=(directory, run_id))
    writer.start()

    outcomes = [results.get(timeout=60) for _ in readers]
    writer.join(timeout=60)
    for reader in readers:
        reader.join(timeout=10)
    assert writer.exitcode == 0
    for outcome in outcomes:
        assert outcome[0] == "ok", outcome[1]
    # The readers really overlapped the writer (a test that only ever read the end would pass
    # without concurrency).
    assert sum(outcome[2] for outcome in outcomes) > 0

    with LocalStore(directory) as store:
        assert [r["step"] for r in store.read_metrics(run_id, limit=10_000)] == list(range(STEPS))
        assert store.tail_logs(run_id, 1) == [f"step {STEPS - 3}"]
