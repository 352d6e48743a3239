"""The local store's connections: one per thread, closed when its thread has ended.

A server's worker threads come and go (anyio's idle ones exit after seconds); a connection kept
for each would hold its files open for the life of the control plane."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from services.store import LocalStore, RunStatus

THREADS = 50


def open_store_files(store: LocalStore) -> int:
    """File descriptors of this process on the store's files (the database, its WAL, its shm)."""
    prefix = str(store.path)
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(prefix)
        except OSError:  # the fd listing itself, closed since
            continue
    return count


def in_a_thread_of_its_own(store: LocalStore, run_id: str) -> None:
    seen: list[RunStatus] = []
    thread = threading.Thread(target=lambda: seen.append(store.get_run(run_id).status))
    thread.start()
    thread.join()
    assert seen == [RunStatus.QUEUED]


def test_threads_that_have_ended_leave_no_connection_open(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    run = store.create_run({"steps": 1})
    for _ in range(3):
        in_a_thread_of_its_own(store, run.id)
    after_a_few = open_store_files(store)
    for _ in range(THREADS):
        in_a_thread_of_its_own(store, run.id)
    # Each connection holds two or three files (SQLite may keep one of them a while longer):
    # with every ended thread's kept, 50 threads later there would be 100 more.
    assert open_store_files(store) <= after_a_few
    # The main thread's connection was left alone and still works.
    assert store.get_run(run.id).status == RunStatus.QUEUED
    store.close()
    assert open_store_files(store) == 0


def test_a_live_threads_connection_is_not_closed_under_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    run = store.create_run({"steps": 1})
    opened, others_done, statuses = threading.Event(), threading.Event(), []

    def long_lived() -> None:
        statuses.append(store.get_run(run.id).status)
        opened.set()
        others_done.wait()
        statuses.append(store.get_run(run.id).status)  # the same connection, after the pruning

    worker = threading.Thread(target=long_lived)
    worker.start()
    opened.wait()
    for _ in range(5):
        in_a_thread_of_its_own(store, run.id)
    others_done.set()
    worker.join()
    assert statuses == [RunStatus.QUEUED, RunStatus.QUEUED]
    store.close()
