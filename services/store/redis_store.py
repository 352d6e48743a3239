"""The production store: Redis, via redis-py, against a single Redis server (not Redis Cluster).

Keys are laid out as `redis_keys` says. Every write is one Lua script (`redis_scripts`), so it is
atomic and idempotent under retry. With AOF persistence and `appendfsync always`, a write is on
disk before Redis replies to it.

While the server is unreachable: writes retry with backoff until the `RetryPolicy` deadline, then
`append_metrics`, `append_event`, `append_logs` and `transition(..., buffer=True)` are queued in
memory, in order, and stored once the server is back (see `write_buffer` for the bounds);
`create_run` and `transition()` raise `StoreUnavailable`; reads retry until the deadline, then
raise `StoreUnavailable`. A read made while writes are queued first tries to store them, but
does not wait for them: it may not see them yet.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

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
from services.store.codec import decode_event, decode_run, transition_entry
from services.store.errors import (
    IdempotencyConflict,
    InvalidCursor,
    QuotaExceeded,
    RunNotFound,
    StoreUnavailable,
)
from services.store.lifecycle import TERMINAL_STATUSES, check_transition, predecessors
from services.store.records import Event, RunRecord, RunStatus
from services.store.redis_keys import RedisKeys
from services.store.redis_scripts import (
    APPEND_EVENT,
    APPEND_LOGS,
    APPEND_METRICS,
    CREATE_RUN,
    RECORD_DRIVER_RESTARTS,
    REQUEST_CANCEL,
    REWIND_METRICS,
    TRANSITION,
)
from services.store.retry import RetryPolicy, call_with_retry
from services.store.write_buffer import WriteBuffer

T = TypeVar("T")

# Errors after which the same call may succeed: the server is down, restarting (a LOADING reply
# is a ConnectionError in redis-py), slow, or a replica that was just demoted.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
)
# How long a made write is remembered, so that its retries change nothing.
OP_TOKEN_TTL_S = 86_400
_STREAM_ID = re.compile(r"[0-9]+-[0-9]+")


class RedisStore(Store):
    """A store in one Redis database, under a key prefix; it owns (and closes) its client."""

    backend = "redis"

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = "kpo",
        policy: RetryPolicy | None = None,
        buffer_capacity: int = 10_000,
        flush_interval_s: float = 0.5,
        max_log_lines: int = MAX_LOG_LINES,
    ) -> None:
        super().__init__(max_log_lines)
        self._client = client
        self._keys = RedisKeys(prefix)
        self._policy = policy or RetryPolicy()
        self._writes = WriteBuffer(
            self._policy, TRANSIENT_ERRORS, buffer_capacity, flush_interval_s
        )
        self._scripts: dict[str, Script] = {
            name: client.register_script(source)
            for name, source in [
                ("create", CREATE_RUN),
                ("transition", TRANSITION),
                ("cancel", REQUEST_CANCEL),
                ("restarts", RECORD_DRIVER_RESTARTS),
                ("metrics", APPEND_METRICS),
                ("rewind", REWIND_METRICS),
                ("event", APPEND_EVENT),
                ("logs", APPEND_LOGS),
            ]
        }

    @classmethod
    def from_url(cls, url: str, *, socket_timeout_s: float = 5.0, **options: Any) -> RedisStore:
        """A store on the server at `url` (`redis://`, `rediss://` or `unix://`).

        The client's own retries are turned off: this store retries (and buffers) itself, with
        idempotent writes, which redis-py's blind command retries are not.
        """
        client = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=min(socket_timeout_s, 2.0),
            retry=Retry(NoBackoff(), 0),
        )
        return cls(client, **options)

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
        keys = [
            self._keys.new_op(),
            self._keys.run(run_id),
            self._keys.runs,
            self._keys.by_status(RunStatus.QUEUED),
            self._keys.seq,
            self._keys.events(run_id),
            self._keys.by_status(RunStatus.RUNNING),
        ]
        if idempotency_key is not None:
            keys.append(self._keys.idempotency(idempotency_key))
        args: list[str | int] = [
            OP_TOKEN_TTL_S,
            run_id,
            spec_json,
            spec_fingerprint,
            repr(now),
            f"[{transition_entry(RunStatus.QUEUED, now)}]",
            status_event_data(RunStatus.QUEUED, None),
            self._keys.run_prefix,
            RunStatus.QUEUED.value,
            STATUS_EVENT,
            limits.max_active or 0,
            max(1, round(limits.idempotency_ttl_s * 1000)),
        ]

        def write() -> RunRecord:
            try:
                created = self._scripts["create"](keys=keys, args=args)
            except redis.exceptions.ResponseError as error:
                code, detail = _script_error(error)
                if code == "KPO_CONFLICT" and idempotency_key is not None:
                    raise IdempotencyConflict(idempotency_key, detail) from None
                if code == "KPO_QUOTA":
                    raise QuotaExceeded(int(detail)) from None
                raise
            return self._fetch_run(str(created))

        return self._writes.write_now(write)

    def get_run(self, run_id: str) -> RunRecord:
        key = self._keys.run(run_id)
        return self._read(lambda: self._fetch_run(run_id, key))

    def _list_runs(
        self, status: RunStatus | None, limit: int, before_seq: int | None
    ) -> tuple[list[RunRecord], int | None]:
        index = self._keys.runs if status is None else self._keys.by_status(status)
        upper = "+inf" if before_seq is None else f"({before_seq}"

        def read() -> tuple[list[tuple[str, float]], list[dict[str, str]]]:
            # One more than asked tells whether another page follows.
            found = cast(
                list[tuple[str, float]],
                self._client.zrevrangebyscore(
                    index, upper, "-inf", start=0, num=limit + 1, withscores=True
                ),
            )
            pipe = self._client.pipeline(transaction=False)
            for run_id, _ in found[:limit]:
                pipe.hgetall(self._keys.run(run_id))
            return found, pipe.execute()

        found, rows = self._read(read)
        # A run may change status between the index read and its hash read; keep the filter
        # honest rather than return a run that no longer matches.
        runs = [
            run
            for run in (decode_run(row) for row in rows if row)
            if status is None or run.status == status
        ]
        return runs, (int(found[limit - 1][1]) if len(found) > limit else None)

    def _transition(
        self, run_id: str, status: RunStatus, error: str | None, now: float, buffer: bool
    ) -> RunRecord | None:
        keys = [self._keys.new_op(), self._keys.run(run_id), self._keys.events(run_id)]
        args: list[str | int] = [
            OP_TOKEN_TTL_S,
            status.value,
            transition_entry(status, now),
            error or "",
            self._keys.status_prefix,
            status_event_data(status, error),
            repr(now),
            STATUS_EVENT,
            "1" if status in TERMINAL_STATUSES else "0",
            *sorted(previous.value for previous in predecessors(status)),
        ]

        def write() -> RunRecord:
            try:
                fields = self._scripts["transition"](keys=keys, args=args)
            except redis.exceptions.ResponseError as failure:
                code, detail = _script_error(failure, run_id)
                if code == "KPO_ILLEGAL":
                    # Raises with the lifecycle's own message: the script refused the same move.
                    check_transition(run_id, RunStatus(detail), status)
                raise
            return decode_run(_hash_from_list(fields))

        if buffer:
            return self._writes.write_or_buffer(write)
        return self._writes.write_now(write)

    def _request_cancel(self, run_id: str, now: float) -> RunRecord:
        keys = [self._keys.run(run_id)]
        args: list[str | int] = [repr(now), *sorted(status.value for status in TERMINAL_STATUSES)]
        # Never buffered: the API must know the request is stored before it says so.
        fields = self._writes.write_now(lambda: self._run_script("cancel", run_id, keys, args))
        return decode_run(_hash_from_list(fields))

    def _record_driver_restarts(self, run_id: str, restarts: int) -> RunRecord:
        keys = [self._keys.run(run_id)]
        args: list[str | int] = [restarts, *sorted(status.value for status in TERMINAL_STATUSES)]
        # Never buffered: the reconciler reads the count back to decide the next restart.
        fields = self._writes.write_now(lambda: self._run_script("restarts", run_id, keys, args))
        return decode_run(_hash_from_list(fields))

    # --- metrics, events, logs ---------------------------------------------------------------

    def _append_metrics(self, run_id: str, records: list[EncodedRecord], now: float) -> None:
        keys = [self._keys.run(run_id), self._keys.metrics(run_id), self._keys.events(run_id)]
        args: list[str | int] = [repr(now), METRICS_EVENT]
        for step, record_json in records:
            args += [step, record_json]
        self._writes.write_or_buffer(lambda: self._run_script("metrics", run_id, keys, args))

    def _rewind_metrics(self, run_id: str, step: int, event_json: str, now: float) -> None:
        keys = [
            self._keys.new_op(),
            self._keys.run(run_id),
            self._keys.metrics(run_id),
            self._keys.events(run_id),
        ]
        args: list[str | int] = [OP_TOKEN_TTL_S, step, METRICS_REWOUND_EVENT, event_json, repr(now)]
        self._writes.write_or_buffer(lambda: self._run_script("rewind", run_id, keys, args))

    def _read_metrics(self, run_id: str, since_step: int, limit: int) -> list[dict[str, Any]]:
        run_key, stream = self._keys.run(run_id), self._keys.metrics(run_id)
        entries = self._read(
            lambda: self._existing(
                run_id, run_key, lambda pipe: pipe.xrange(stream, f"{since_step + 1}-0", "+", limit)
            )
        )
        return [json.loads(fields["r"]) for _, fields in entries]

    def _append_event(self, run_id: str, kind: str, data_json: str, now: float) -> str | None:
        keys = [self._keys.new_op(), self._keys.run(run_id), self._keys.events(run_id)]
        args: list[str | int] = [OP_TOKEN_TTL_S, kind, data_json, repr(now)]
        event_id = self._writes.write_or_buffer(
            lambda: self._run_script("event", run_id, keys, args)
        )
        return None if event_id is None else str(event_id)

    def _read_events(self, run_id: str, after_id: str | None, limit: int) -> list[Event]:
        if after_id is not None and not _STREAM_ID.fullmatch(after_id):
            raise InvalidCursor(
                f"invalid event id {after_id!r}: this store's event ids look like "
                "'1712345678901-0' (pass the id of an event it returned)"
            )
        run_key, stream = self._keys.run(run_id), self._keys.events(run_id)
        start = "-" if after_id is None else f"({after_id}"
        entries = self._read(
            lambda: self._existing(
                run_id, run_key, lambda pipe: pipe.xrange(stream, start, "+", limit)
            )
        )
        return [
            decode_event(entry_id, fields["k"], fields["d"], fields["t"])
            for entry_id, fields in entries
        ]

    def _append_logs(self, run_id: str, lines: list[str]) -> None:
        keys = [self._keys.new_op(), self._keys.run(run_id), self._keys.logs(run_id)]
        args: list[str | int] = [OP_TOKEN_TTL_S, self.max_log_lines, *lines]
        self._writes.write_or_buffer(lambda: self._run_script("logs", run_id, keys, args))

    def _tail_logs(self, run_id: str, n: int) -> list[str]:
        run_key, logs = self._keys.run(run_id), self._keys.logs(run_id)
        if n == 0:
            self.get_run(run_id)  # still a 404 for an unknown run
            return []
        lines: list[str] = self._read(
            lambda: self._existing(run_id, run_key, lambda pipe: pipe.lrange(logs, -n, -1))
        )
        return lines

    # --- the store itself --------------------------------------------------------------------

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except redis.exceptions.RedisError:
            return False

    @property
    def pending_writes(self) -> int:
        return self._writes.pending

    def flush(self, timeout_s: float | None = None) -> bool:
        return self._writes.flush(self._policy.deadline_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        try:
            self._writes.close(self._policy.deadline_s)
        finally:
            self._client.close()

    # --- helpers -----------------------------------------------------------------------------

    def _read(self, read: Callable[[], T]) -> T:
        """Run a read, retrying through a short outage; `StoreUnavailable` past the deadline."""
        if self._writes.pending:
            self._writes.flush(0.0)  # one quick try, so that reads see writes once Redis is back
        try:
            return call_with_retry(read, self._policy, TRANSIENT_ERRORS)
        except TRANSIENT_ERRORS as error:
            raise StoreUnavailable(f"cannot reach Redis: {error}") from error

    def _fetch_run(self, run_id: str, key: str | None = None) -> RunRecord:
        # The client decodes replies (decode_responses=True), which its types cannot express.
        fields = cast(dict[str, str], self._client.hgetall(key or self._keys.run(run_id)))
        if not fields:
            raise RunNotFound(run_id)
        return decode_run(fields)

    def _existing(
        self, run_id: str, run_key: str, read: Callable[[redis.client.Pipeline], object]
    ) -> Any:
        """The result of `read` on a run's data, in one transaction with the check that the run
        exists (an unknown run is a `RunNotFound`, not an empty history)."""
        pipe = self._client.pipeline(transaction=True)
        pipe.exists(run_key)
        read(pipe)
        exists, result = pipe.execute()
        if not exists:
            raise RunNotFound(run_id)
        return result

    def _run_script(
        self, name: str, run_id: str, keys: Sequence[str], args: Sequence[str | int]
    ) -> Any:
        """Run one of the write scripts, turning its `KPO_NOT_FOUND` into `RunNotFound`."""
        try:
            return self._scripts[name](keys=keys, args=args)
        except redis.exceptions.ResponseError as error:
            _script_error(error, run_id)
            raise


def _script_error(error: redis.exceptions.ResponseError, run_id: str = "") -> tuple[str, str]:
    """The code and detail of a script's `KPO_<CODE> detail` reply; raises `RunNotFound` for
    `KPO_NOT_FOUND`, and re-raises any reply that is not a script's own."""
    code, _, detail = str(error).partition(" ")
    if code == "KPO_NOT_FOUND":
        raise RunNotFound(run_id) from None
    if not code.startswith("KPO_"):
        raise error
    return code, detail


def _hash_from_list(flat: list[str]) -> dict[str, str]:
    """A hash from the flat [field, value, ...] list that HGETALL returns inside Lua."""
    return dict(zip(flat[::2], flat[1::2], strict=True))
