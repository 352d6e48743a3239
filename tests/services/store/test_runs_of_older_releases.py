"""Runs stored before the store kept cancel requests and driver restarts read back with none,
and can get them.

The local store's file of an older release has no `cancel_requested_at` or `driver_restarts`
column: opening it adds them. A Redis hash has no such field until a cancel is requested or a
driver restarted, which is how every hash of an older release looks.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from pathlib import Path

import redis

from services.store import LocalStore, RedisStore, RunStatus
from services.store.redis_keys import RedisKeys
from services.store.sqlite_schema import DB_FILE_NAME, SCHEMA
from tests.services.store.redis_server import RedisServer

# The `runs` table as the releases before cancel requests made it.
OLD_RUNS_TABLE = """
CREATE TABLE runs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL,
    spec TEXT NOT NULL,
    spec_hash TEXT NOT NULL,
    idempotency_key TEXT UNIQUE,
    created_at REAL NOT NULL,
    transitions TEXT NOT NULL,
    error TEXT,
    last_step INTEGER NOT NULL DEFAULT -1
);
"""


def test_a_local_store_file_of_an_older_release_is_opened_and_gains_the_columns(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "data"
    directory.mkdir()
    old = sqlite3.connect(directory / DB_FILE_NAME)
    # The other tables are unchanged: the current schema makes them as the old one did.
    old.executescript(OLD_RUNS_TABLE + SCHEMA)
    transitions = json.dumps([["queued", 1_700_000_000.5], ["running", 1_700_000_001.25]])
    old.execute(
        "INSERT INTO runs (id, status, spec, spec_hash, created_at, transitions)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        ("run-0123456789ab", "running", '{"name":"old"}', "h", 1_700_000_000.5, transitions),
    )
    old.commit()
    old.close()

    store = LocalStore(directory)
    try:
        run = store.get_run("run-0123456789ab")
        assert run.status == RunStatus.RUNNING and run.spec == {"name": "old"}
        assert run.cancel_requested_at is None and run.driver_restarts == 0
        assert store.record_driver_restarts(run.id, 1).driver_restarts == 1
        requested = store.request_cancel(run.id)
        assert requested.cancel_requested_at is not None
    finally:
        store.close()
    # A second opening finds the columns there and changes nothing.
    again = LocalStore(directory)
    try:
        assert again.get_run(run.id) == requested
    finally:
        again.close()


def test_a_redis_run_hash_without_the_fields_reads_back_with_none(
    redis_server: RedisServer,
) -> None:
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    store = RedisStore.from_url(redis_server.url, prefix=prefix)
    raw = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        run = store.create_run({"name": "old"})
        store.transition(run.id, RunStatus.RUNNING)
        hash_key = RedisKeys(prefix).run(run.id)
        # What a run's hash held before cancel requests and restarts were kept: no field for
        # them.
        assert "cancel_requested_at" not in raw.hkeys(hash_key)
        assert store.get_run(run.id).cancel_requested_at is None
        assert store.request_cancel(run.id).cancel_requested_at is not None
        assert "cancel_requested_at" in raw.hkeys(hash_key)
        assert "driver_restarts" not in raw.hkeys(hash_key)
        assert store.get_run(run.id).driver_restarts == 0
        assert store.record_driver_restarts(run.id, 2).driver_restarts == 2
    finally:
        raw.close()
        store.close()
