"""The local store's SQLite schema and connection settings.

WAL mode lets readers in any process read a consistent snapshot while one writer writes;
`synchronous=FULL` makes every committed transaction survive a power cut, not only a process
crash (WAL's default, NORMAL, may lose the last commits on power loss), because the store
promises that nothing acknowledged is lost. Writers in several processes queue on SQLite's lock
for up to the busy timeout.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

DB_FILE_NAME = "kpo-store.sqlite3"
# The files SQLite keeps beside it in WAL mode.
SIDE_FILE_NAMES = (f"{DB_FILE_NAME}-wal", f"{DB_FILE_NAME}-shm")

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order: the list order and the cursor
    id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL,
    spec TEXT NOT NULL,                     -- canonical JSON
    spec_hash TEXT NOT NULL,                -- what idempotency compares
    idempotency_key TEXT UNIQUE,
    created_at REAL NOT NULL,
    transitions TEXT NOT NULL,              -- JSON array of [status, at]
    error TEXT,
    last_step INTEGER NOT NULL DEFAULT -1,  -- highest stored metrics step
    cancel_requested_at REAL,               -- when a cancel was first asked for; NULL: never
    driver_restarts INTEGER NOT NULL DEFAULT 0  -- drivers started again after one was lost
);
CREATE INDEX IF NOT EXISTS runs_by_status ON runs (status, seq);

CREATE TABLE IF NOT EXISTS metrics (
    run_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (run_id, step)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,   -- never reused, so ids increase within every run
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_run ON events (run_id, id);

CREATE TABLE IF NOT EXISTS logs (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    line TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS logs_by_run ON logs (run_id, id);
"""


def connect(path: Path, busy_timeout_s: float) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are begun explicitly) with WAL on."""
    # check_same_thread=False only so that `close()` may close every thread's connection; each
    # connection is otherwise used by the one thread that opened it.
    conn = sqlite3.connect(
        path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
    )
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


# Columns added to `runs` after its first release, with their definitions: a file made before
# gets them when it is next opened (CREATE TABLE IF NOT EXISTS leaves an existing table as it is).
ADDED_RUN_COLUMNS = {
    "cancel_requested_at": "REAL",
    "driver_restarts": "INTEGER NOT NULL DEFAULT 0",
}


def create_schema(conn: sqlite3.Connection) -> None:
    """Create the tables if missing and add the columns an older file lacks, each in one
    transaction so that concurrent openers agree (the second finds the work done)."""
    conn.executescript(f"BEGIN IMMEDIATE;{SCHEMA}COMMIT;")
    conn.execute("BEGIN IMMEDIATE")
    try:
        present = {row["name"] for row in conn.execute("PRAGMA table_info(runs)")}
        for name, definition in ADDED_RUN_COLUMNS.items():
            if name not in present:
                conn.execute(f"ALTER TABLE runs ADD COLUMN {name} {definition}")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
