"""The embedded store: one SQLite file under the data directory, no server.

Safe for a writer and concurrent readers across processes (SQLite WAL; more writers take turns
on SQLite's lock), and it survives restarts: every call commits before it returns. Each thread of
each process gets its own connection (SQLite connections must not be shared between threads, nor
carried across a fork). There is no outage to ride out, so nothing is buffered: `buffer=True`
changes nothing here.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from services.store.base import (
    MAX_LOG_LINES,
    METRICS_EVENT,
    METRICS_REWOUND_EVENT,
    STATUS_EVENT,
    EncodedRecord,
    NewRunLimits,
    Store,
    status_event_data,
)
from services.store.codec import append_transition, decode_event, decode_run, transition_entry
from services.store.errors import IdempotencyConflict, InvalidCursor, QuotaExceeded, RunNotFound
from services.store.lifecycle import ACTIVE_STATUSES, TERMINAL_STATUSES, check_transition
from services.store.private_files import private_directory, private_file
from services.store.records import Event, RunRecord, RunStatus
from services.store.sqlite_schema import DB_FILE_NAME, SIDE_FILE_NAMES, connect, create_schema

_RUN_COLUMNS = (
    "seq, id, status, spec, created_at, transitions, error, cancel_requested_at, driver_restarts"
)
_ACTIVE_VALUES = tuple(sorted(status.value for status in ACTIVE_STATUSES))
_ACTIVE_PLACEHOLDERS = ", ".join("?" * len(_ACTIVE_VALUES))


class LocalStore(Store):
    """A store in `<directory>/kpo-store.sqlite3`."""

    backend = "local"

    def __init__(
        self,
        directory: Path | str,
        *,
        max_log_lines: int = MAX_LOG_LINES,
        busy_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(max_log_lines)
        self.directory = private_directory(Path(directory).expanduser())
        self.path = self.directory / DB_FILE_NAME
        # Before SQLite opens it: SQLite gives the WAL and shared-memory files it makes the
        # database file's mode, so 0600 here keeps all three private. Side files made by an
        # earlier release (under the umask) are tightened too.
        private_file(self.path)
        for name in SIDE_FILE_NAMES:
            private_file(self.directory / name, create=False)
        self._busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        # Every connection opened, with the thread and process that opened it: `close` closes
        # them all, and a thread that has ended has its connection closed when the next one opens
        # (servers' worker threads come and go; each would otherwise keep a connection and its
        # files open for the life of the process).
        self._all_connections: list[tuple[threading.Thread, int, sqlite3.Connection]] = []
        self._connections_lock = threading.Lock()
        create_schema(self._connection())

    # --- connections and transactions --------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        """This thread's connection, opened on first use (and again in a forked child)."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():
            conn = connect(self.path, self._busy_timeout_s)
            self._local.conn, self._local.pid = conn, os.getpid()
            with self._connections_lock:
                self._close_connections_of_ended_threads()
                self._all_connections.append((threading.current_thread(), os.getpid(), conn))
        return conn

    def _close_connections_of_ended_threads(self) -> None:
        """Under `_connections_lock`. A forked child leaves its parent's connections alone."""
        kept = []
        for thread, pid, conn in self._all_connections:
            if pid == os.getpid() and not thread.is_alive():
                conn.close()
            else:
                kept.append((thread, pid, conn))
        self._all_connections = kept

    @contextmanager
    def _transaction(self, write: bool) -> Iterator[sqlite3.Connection]:
        """A transaction: IMMEDIATE for writes (takes the write lock at once, so a check and the
        write that depends on it cannot interleave with another writer), deferred for reads (one
        consistent snapshot across several queries)."""
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    # --- runs --------------------------------------------------------------------------------

    def _create_run(
        self,
        run_id: str,
        spec_json: str,
        spec_fingerprint: str,
        idempotency_key: str | None,
        now: float,
        limits: NewRunLimits,
    ) -> RunRecord:
        # One IMMEDIATE transaction: no other writer, in any process, runs between the key
        # lookup, the count of active runs and the insert.
        with self._transaction(write=True) as conn:
            if idempotency_key is not None:
                existing = self._run_of_key(conn, idempotency_key, now, limits.idempotency_ttl_s)
                if existing is not None:
                    if existing["spec_hash"] != spec_fingerprint:
                        raise IdempotencyConflict(idempotency_key, existing["id"])
                    return decode_run(dict(existing))
            if limits.max_active is not None:
                (active,) = conn.execute(
                    f"SELECT count(*) FROM runs WHERE status IN ({_ACTIVE_PLACEHOLDERS})",
                    _ACTIVE_VALUES,
                ).fetchone()
                if active >= limits.max_active:
                    raise QuotaExceeded(limits.max_active)
            conn.execute(
                "INSERT INTO runs (id, status, spec, spec_hash, idempotency_key, created_at,"
                " transitions) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    RunStatus.QUEUED.value,
                    spec_json,
                    spec_fingerprint,
                    idempotency_key,
                    now,
                    f"[{transition_entry(RunStatus.QUEUED, now)}]",
                ),
            )
            self._insert_event(
                conn, run_id, STATUS_EVENT, status_event_data(RunStatus.QUEUED, None), now
            )
            return self._fetch_run(conn, run_id)

    @staticmethod
    def _run_of_key(
        conn: sqlite3.Connection, key: str, now: float, ttl_s: float
    ) -> sqlite3.Row | None:
        """The row of the run `key` made, or None when none did or the key has expired.

        Expired keys are deleted here, lazily, when they are next used: a key expires once its
        run has been finished for `ttl_s` (the last transition of a finished run is its end).
        """
        row: sqlite3.Row | None = conn.execute(
            f"SELECT {_RUN_COLUMNS}, spec_hash FROM runs WHERE idempotency_key = ?", (key,)
        ).fetchone()
        if row is None or RunStatus(row["status"]) not in TERMINAL_STATUSES:
            return row
        _, finished_at = json.loads(row["transitions"])[-1]
        if now < finished_at + ttl_s:
            return row
        conn.execute("UPDATE runs SET idempotency_key = NULL WHERE seq = ?", (row["seq"],))
        return None

    def get_run(self, run_id: str) -> RunRecord:
        with self._transaction(write=False) as conn:
            return self._fetch_run(conn, run_id)

    def _list_runs(
        self, status: RunStatus | None, limit: int, before_seq: int | None
    ) -> tuple[list[RunRecord], int | None]:
        # One more row than asked tells whether another page follows.
        rows = (
            self._connection()
            .execute(
                f"SELECT {_RUN_COLUMNS} FROM runs WHERE seq < ? AND (? IS NULL OR status = ?)"
                " ORDER BY seq DESC LIMIT ?",
                (
                    before_seq if before_seq is not None else 2**63 - 1,
                    status and status.value,
                    status and status.value,
                    limit + 1,
                ),
            )
            .fetchall()
        )
        page = rows[:limit]
        more = len(rows) > limit
        return [decode_run(dict(row)) for row in page], (page[-1]["seq"] if more else None)

    def _transition(
        self, run_id: str, status: RunStatus, error: str | None, now: float, buffer: bool
    ) -> RunRecord:
        with self._transaction(write=True) as conn:
            row = conn.execute(
                "SELECT status, transitions FROM runs WHERE id = ?", (run_id,)
            ).fetchone()
            if row is None:
                raise RunNotFound(run_id)
            check_transition(run_id, RunStatus(row["status"]), status)
            conn.execute(
                "UPDATE runs SET status = ?, transitions = ?, error = coalesce(?, error)"
                " WHERE id = ?",
                (
                    status.value,
                    append_transition(row["transitions"], transition_entry(status, now)),
                    error,
                    run_id,
                ),
            )
            self._insert_event(conn, run_id, STATUS_EVENT, status_event_data(status, error), now)
            return self._fetch_run(conn, run_id)

    def _request_cancel(self, run_id: str, now: float) -> RunRecord:
        # One statement in one write transaction: the status check and the write cannot
        # interleave with a transition or another request, and a request already made (or a
        # finished run) matches no row, so nothing changes.
        with self._transaction(write=True) as conn:
            conn.execute(
                "UPDATE runs SET cancel_requested_at = ? WHERE id = ?"
                f" AND cancel_requested_at IS NULL AND status IN ({_ACTIVE_PLACEHOLDERS})",
                (now, run_id, *_ACTIVE_VALUES),
            )
            return self._fetch_run(conn, run_id)

    def _record_driver_restarts(self, run_id: str, restarts: int) -> RunRecord:
        # As for a cancel request: one statement, so the check and the write cannot interleave
        # with another control plane's; a count at or above `restarts` matches no row.
        with self._transaction(write=True) as conn:
            conn.execute(
                "UPDATE runs SET driver_restarts = ? WHERE id = ? AND driver_restarts < ?"
                f" AND status IN ({_ACTIVE_PLACEHOLDERS})",
                (restarts, run_id, restarts, *_ACTIVE_VALUES),
            )
            return self._fetch_run(conn, run_id)

    # --- metrics, events, logs ---------------------------------------------------------------

    def _append_metrics(self, run_id: str, records: list[EncodedRecord], now: float) -> None:
        with self._transaction(write=True) as conn:
            last_step = self._last_step(conn, run_id)
            for step, record_json in records:
                if step <= last_step:
                    continue  # already stored: a resend after a retry
                conn.execute(
                    "INSERT INTO metrics (run_id, step, record) VALUES (?, ?, ?)",
                    (run_id, step, record_json),
                )
                self._insert_event(conn, run_id, METRICS_EVENT, record_json, now)
                last_step = step
            conn.execute("UPDATE runs SET last_step = ? WHERE id = ?", (last_step, run_id))

    def _rewind_metrics(self, run_id: str, step: int, event_json: str, now: float) -> None:
        with self._transaction(write=True) as conn:
            if self._last_step(conn, run_id) <= step:
                return
            conn.execute("DELETE FROM metrics WHERE run_id = ? AND step > ?", (run_id, step))
            conn.execute("UPDATE runs SET last_step = ? WHERE id = ?", (step, run_id))
            self._insert_event(conn, run_id, METRICS_REWOUND_EVENT, event_json, now)

    def _read_metrics(self, run_id: str, since_step: int, limit: int) -> list[dict[str, Any]]:
        with self._transaction(write=False) as conn:
            self._last_step(conn, run_id)
            rows = conn.execute(
                "SELECT record FROM metrics WHERE run_id = ? AND step > ? ORDER BY step LIMIT ?",
                (run_id, since_step, limit),
            ).fetchall()
        return [json.loads(row[0]) for row in rows]

    def _append_event(self, run_id: str, kind: str, data_json: str, now: float) -> str:
        with self._transaction(write=True) as conn:
            self._last_step(conn, run_id)
            return self._insert_event(conn, run_id, kind, data_json, now)

    def _read_events(self, run_id: str, after_id: str | None, limit: int) -> list[Event]:
        after = _parse_event_id(after_id) if after_id is not None else 0
        with self._transaction(write=False) as conn:
            self._last_step(conn, run_id)
            rows = conn.execute(
                "SELECT id, kind, data, at FROM events WHERE run_id = ? AND id > ?"
                " ORDER BY id LIMIT ?",
                (run_id, after, limit),
            ).fetchall()
        return [decode_event(str(row["id"]), row["kind"], row["data"], row["at"]) for row in rows]

    def _append_logs(self, run_id: str, lines: list[str]) -> None:
        with self._transaction(write=True) as conn:
            self._last_step(conn, run_id)
            conn.executemany(
                "INSERT INTO logs (run_id, line) VALUES (?, ?)", [(run_id, line) for line in lines]
            )
            # Drop everything up to the newest line beyond the limit.
            conn.execute(
                "DELETE FROM logs WHERE run_id = ? AND id <= (SELECT id FROM logs WHERE"
                " run_id = ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                (run_id, run_id, self.max_log_lines),
            )

    def _tail_logs(self, run_id: str, n: int) -> list[str]:
        with self._transaction(write=False) as conn:
            self._last_step(conn, run_id)
            rows = conn.execute(
                "SELECT line FROM (SELECT id, line FROM logs WHERE run_id = ?"
                " ORDER BY id DESC LIMIT ?) ORDER BY id",
                (run_id, n),
            ).fetchall()
        return [row[0] for row in rows]

    # --- the store itself --------------------------------------------------------------------

    def ping(self) -> bool:
        try:
            self._connection().execute("SELECT 1 FROM runs LIMIT 1").fetchall()
        except sqlite3.Error:
            return False
        return True

    def close(self) -> None:
        with self._connections_lock:
            for _, _, conn in self._all_connections:
                conn.close()
            self._all_connections.clear()
        self._local = threading.local()

    # --- helpers -----------------------------------------------------------------------------

    @staticmethod
    def _fetch_run(conn: sqlite3.Connection, run_id: str) -> RunRecord:
        row = conn.execute(f"SELECT {_RUN_COLUMNS} FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise RunNotFound(run_id)
        return decode_run(dict(row))

    @staticmethod
    def _last_step(conn: sqlite3.Connection, run_id: str) -> int:
        """The run's highest stored step (-1 before any); `RunNotFound` for an unknown run."""
        row = conn.execute("SELECT last_step FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise RunNotFound(run_id)
        return int(row[0])

    @staticmethod
    def _insert_event(
        conn: sqlite3.Connection, run_id: str, kind: str, data_json: str, now: float
    ) -> str:
        cursor = conn.execute(
            "INSERT INTO events (run_id, kind, data, at) VALUES (?, ?, ?, ?)",
            (run_id, kind, data_json, now),
        )
        return str(cursor.lastrowid)


def _parse_event_id(event_id: str) -> int:
    if not (event_id.isascii() and event_id.isdigit()):
        raise InvalidCursor(
            f"invalid event id {event_id!r}: this store's event ids are integers "
            "(pass the id of an event it returned)"
        )
    return int(event_id)
