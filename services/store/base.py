"""The store interface every backend implements, and the argument checks they all share.

A store keeps, per run: the run record (spec, status, timestamped transitions, error), the metrics
history (one record per learner step, append-only, ordered by step, each stored exactly once),
an event log for server-sent events (ids increase, so a client resumes after the last id it saw)
and a bounded tail of log lines.

The public methods here check and encode their arguments once; backends implement the
underscored methods and receive arguments already checked (statuses parsed, records validated and
encoded as canonical JSON, timestamps taken at the call).

Writes the Redis backend may buffer while its server is down (see `services.store.write_buffer`):
`append_metrics`, `append_event`, `append_logs`, and `transition(..., buffer=True)`. A buffered
call returns before the write is stored, so it cannot return what storing produces:
`append_event` then returns None instead of the event id, and `transition(..., buffer=True)`
returns None instead of the updated run. A buffered transition that turns out to be illegal when
it is finally applied (the run was cancelled meanwhile) is rejected then, and logged. Every other
call either completes or raises (`StoreUnavailable` when the server cannot be reached).
"""

from __future__ import annotations

import math
import re
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, ClassVar, Literal, NamedTuple, overload

from services.store.codec import dump_json, fingerprint
from services.store.errors import InvalidCursor
from services.store.lifecycle import STATUSES_WITH_ERROR, parse_status
from services.store.records import Event, RunRecord, RunStatus

# Log lines kept per run; older lines are dropped as new ones arrive.
MAX_LOG_LINES = 10_000
# Largest page any read returns, so that one request cannot pull a whole history into memory.
MAX_READ_LIMIT = 10_000
# Steps are stored as Redis stream ids and read by Lua, whose numbers are doubles.
MAX_STEP = 2**53 - 1
MAX_IDEMPOTENCY_KEY_LENGTH = 255
# How long an idempotency key still returns its run once the run has finished: a client resending
# a request gets its run back for a day, and a key does not hold forever.
IDEMPOTENCY_TTL_S = 86_400.0
# Event kinds the store writes itself; callers may not forge them.
STATUS_EVENT = "status"
METRICS_EVENT = "metrics"
# {"step": N}: the records after step N were dropped (`rewind_metrics`); those that follow
# replace them.
METRICS_REWOUND_EVENT = "metrics.rewound"
RESERVED_EVENT_KINDS = frozenset({STATUS_EVENT, METRICS_EVENT, METRICS_REWOUND_EVENT})
# What `new_run_id` makes; the Redis store builds key names from run ids, so it accepts no other.
RUN_ID_PATTERN = re.compile(r"run-[0-9a-f]{12}")
# An event kind becomes the SSE `event:` field, which cannot hold spaces or line breaks.
_EVENT_KIND = re.compile(r"[A-Za-z0-9_.:-]{1,64}")

# A metrics record as backends receive it: its step and its canonical JSON text.
EncodedRecord = tuple[int, str]


class NewRunLimits(NamedTuple):
    """What `create_run` checks besides the key, as backends receive it (already validated)."""

    max_active: int | None  # most runs queued or running at once; None: no limit
    idempotency_ttl_s: float  # how long a key outlives its run's end


class Store(ABC):
    """Runs, metrics history, events and logs of the control plane; one instance per process."""

    backend: ClassVar[str]  # "local" or "redis"

    def __init__(self, max_log_lines: int = MAX_LOG_LINES) -> None:
        if max_log_lines < 1:
            raise ValueError(f"max_log_lines must be >= 1, got {max_log_lines}")
        self.max_log_lines = max_log_lines

    # --- runs -------------------------------------------------------------------------------

    def create_run(
        self,
        spec: Mapping[str, Any],
        idempotency_key: str | None = None,
        *,
        max_active: int | None = None,
        idempotency_ttl_s: float = IDEMPOTENCY_TTL_S,
    ) -> RunRecord:
        """Store a new run, `queued`, and return it.

        With an idempotency key, a second call with the same key and an equal spec returns the
        run the first call created; with a different spec it raises `IdempotencyConflict`. A key
        holds until its run has been finished (succeeded, failed, cancelled) for
        `idempotency_ttl_s`; after that the key is free and makes a new run.

        With `max_active`, the run is refused with `QuotaExceeded` while `max_active` runs are
        already queued or running (a resend of a key that made a run still returns that run).

        The key lookup, the count and the insert are one atomic step in both backends, so
        concurrent calls neither make two runs for one key nor overshoot `max_active`.
        """
        if not isinstance(spec, Mapping):
            raise TypeError(f"spec must be a mapping, got {type(spec).__name__}")
        if idempotency_key is not None and not 0 < len(idempotency_key) <= (
            MAX_IDEMPOTENCY_KEY_LENGTH
        ):
            raise ValueError(
                f"idempotency key must be 1 to {MAX_IDEMPOTENCY_KEY_LENGTH} characters long"
            )
        if max_active is not None and (isinstance(max_active, bool) or max_active < 1):
            raise ValueError(f"max_active must be an integer >= 1 or None, got {max_active!r}")
        if not 0 < idempotency_ttl_s < math.inf:
            raise ValueError(f"idempotency_ttl_s must be > 0 and finite, got {idempotency_ttl_s}")
        spec_json = dump_json(dict(spec))
        return self._create_run(
            new_run_id(),
            spec_json,
            fingerprint(spec_json),
            idempotency_key,
            time.time(),
            NewRunLimits(max_active, idempotency_ttl_s),
        )

    @abstractmethod
    def get_run(self, run_id: str) -> RunRecord:
        """The run with this id; `RunNotFound` if there is none."""

    def list_runs(
        self, status: RunStatus | str | None = None, limit: int = 50, cursor: str | None = None
    ) -> tuple[list[RunRecord], str | None]:
        """One page of runs, newest first, optionally only those with `status`.

        Returns the page and the cursor of the next page (None after the last page). Pages are
        stable: runs created after the first page was read never shift later pages.
        """
        wanted = parse_status(status) if status is not None else None
        _check_limit(limit)
        before = decode_cursor(cursor) if cursor is not None else None
        runs, last_seq = self._list_runs(wanted, limit, before)
        return runs, (encode_cursor(last_seq) if last_seq is not None else None)

    @overload
    def transition(
        self,
        run_id: str,
        status: RunStatus | str,
        error: str | None = None,
        *,
        buffer: Literal[False] = False,
    ) -> RunRecord: ...

    @overload
    def transition(
        self, run_id: str, status: RunStatus | str, error: str | None = None, *, buffer: bool
    ) -> RunRecord | None: ...

    def transition(
        self,
        run_id: str,
        status: RunStatus | str,
        error: str | None = None,
        *,
        buffer: bool = False,
    ) -> RunRecord | None:
        """Move a run to `status`, recording when; return the updated run.

        Raises `InvalidTransition` when the lifecycle forbids the move (checked and applied as one
        atomic step) and `RunNotFound` for an unknown run. `error` (failed or cancelled only) is
        kept on the run. With `buffer=True` (for the run driver, whose reports must survive a
        Redis restart) the Redis backend may buffer the call and return None; see the module
        docstring.
        """
        new = parse_status(status)
        if error is not None and new not in STATUSES_WITH_ERROR:
            raise ValueError(f"an error message goes only with failed or cancelled, not {new}")
        return self._transition(run_id, new, error or None, time.time(), buffer)

    def request_cancel(self, run_id: str) -> RunRecord:
        """Record that the run is to be cancelled (`cancel_requested_at`); return the run.

        The API calls this before it asks Ray to stop the run's job, so that the request
        outlives a job server it cannot reach and the control plane that received it: the
        reconciler of any control plane never restarts a run whose cancel was requested.
        Checked and applied as one atomic step: a run that is not finished and has no request yet
        gets one, stamped now; a second request keeps the first one's time, and a finished run
        is returned as it is (there is nothing left to cancel). `RunNotFound` for an unknown run.
        """
        return self._request_cancel(run_id, time.time())

    def record_driver_restarts(self, run_id: str, restarts: int) -> RunRecord:
        """Record that the run's driver has been started again `restarts` times in all; return
        the run.

        The count only rises (a lower or equal `restarts` changes nothing), so two control planes
        that restart the same lost driver, or one that retries, count it once; a finished run
        is left as it is. `RunNotFound` for an unknown run.
        """
        if restarts < 0:
            raise ValueError(f"a restart count is never negative, got {restarts}")
        return self._record_driver_restarts(run_id, restarts)

    # --- metrics, events, logs -------------------------------------------------------------

    def append_metrics(self, run_id: str, records: Sequence[Mapping[str, Any]]) -> None:
        """Append metrics records, each with an integer `step` >= 0, in order.

        A record whose step is not above the last stored step is ignored, so a batch resent after
        a retry stores each record exactly once. Each stored record also becomes a `metrics`
        event. May be buffered by the Redis backend.
        """
        encoded = encode_metrics(records)
        if encoded:
            self._append_metrics(run_id, encoded, time.time())

    def rewind_metrics(self, run_id: str, step: int) -> None:
        """Drop the stored records after `step`, in one write with a `metrics.rewound` event
        {"step": step}: the run resumed from its checkpoint of `step` (a driver restart, a
        rollback of the stability guard), trains the later steps again, and their new records
        replace the dropped ones. Nothing changes when no record is after `step`. May be
        buffered by the Redis backend, in order with the appends; a retried rewind applies
        once."""
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
            raise ValueError(f"a rewind's step must be an integer in [0, {MAX_STEP}], got {step!r}")
        self._rewind_metrics(run_id, step, dump_json({"step": step}), time.time())

    def read_metrics(
        self, run_id: str, since_step: int = -1, limit: int = 1000
    ) -> list[dict[str, Any]]:
        """Up to `limit` stored records with step > `since_step`, in step order."""
        if isinstance(since_step, bool) or not isinstance(since_step, int) or since_step < -1:
            raise ValueError(f"since_step must be an integer >= -1, got {since_step!r}")
        _check_limit(limit)
        return self._read_metrics(run_id, min(since_step, MAX_STEP), limit)

    def append_event(self, run_id: str, kind: str, data: Mapping[str, Any]) -> str | None:
        """Append an event; return its id, or None when the Redis backend buffered it."""
        if not _EVENT_KIND.fullmatch(kind):
            raise ValueError(
                f"event kind {kind!r}: use 1 to 64 letters, digits or '_.:-' (no spaces)"
            )
        if kind in RESERVED_EVENT_KINDS:
            raise ValueError(f"event kind {kind!r} is written by the store itself")
        return self._append_event(run_id, kind, dump_json(dict(data)), time.time())

    def read_events(
        self, run_id: str, after_id: str | None = None, limit: int = 1000
    ) -> list[Event]:
        """Up to `limit` events after the one with id `after_id` (from the first when None).

        `after_id` is an id this store returned (an SSE `Last-Event-ID`); anything else raises
        `InvalidCursor`.
        """
        _check_limit(limit)
        return self._read_events(run_id, after_id, limit)

    def append_logs(self, run_id: str, lines: Sequence[str]) -> None:
        """Append log lines; only the last `max_log_lines` per run are kept. May be buffered."""
        if isinstance(lines, str):
            raise TypeError("lines must be a sequence of strings, not one string")
        if lines:
            self._append_logs(run_id, [str(line) for line in lines])

    def tail_logs(self, run_id: str, n: int = 100) -> list[str]:
        """The last `n` log lines of a run, oldest first."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return self._tail_logs(run_id, min(n, self.max_log_lines))

    # --- lifecycle of the store itself -----------------------------------------------------

    @abstractmethod
    def ping(self) -> bool:
        """Whether the store can serve requests now (for a readiness probe); never raises."""

    @property
    def pending_writes(self) -> int:
        """Writes accepted but not yet stored (buffered during an outage)."""
        return 0

    def flush(self, timeout_s: float | None = None) -> bool:
        """Try to store every buffered write; return whether none is left."""
        return True

    @abstractmethod
    def close(self) -> None:
        """Release connections; buffered writes are stored first or reported as not stored."""

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- what backends implement -----------------------------------------------------------

    @abstractmethod
    def _create_run(
        self,
        run_id: str,
        spec_json: str,
        spec_fingerprint: str,
        idempotency_key: str | None,
        now: float,
        limits: NewRunLimits,
    ) -> RunRecord: ...

    @abstractmethod
    def _list_runs(
        self, status: RunStatus | None, limit: int, before_seq: int | None
    ) -> tuple[list[RunRecord], int | None]:
        """A page of runs with creation sequence below `before_seq`, and the last one's sequence
        number when more runs follow."""

    @abstractmethod
    def _transition(
        self, run_id: str, status: RunStatus, error: str | None, now: float, buffer: bool
    ) -> RunRecord | None: ...

    @abstractmethod
    def _request_cancel(self, run_id: str, now: float) -> RunRecord: ...

    @abstractmethod
    def _record_driver_restarts(self, run_id: str, restarts: int) -> RunRecord: ...

    @abstractmethod
    def _append_metrics(self, run_id: str, records: list[EncodedRecord], now: float) -> None: ...

    @abstractmethod
    def _rewind_metrics(self, run_id: str, step: int, event_json: str, now: float) -> None: ...

    @abstractmethod
    def _read_metrics(self, run_id: str, since_step: int, limit: int) -> list[dict[str, Any]]: ...

    @abstractmethod
    def _append_event(self, run_id: str, kind: str, data_json: str, now: float) -> str | None: ...

    @abstractmethod
    def _read_events(self, run_id: str, after_id: str | None, limit: int) -> list[Event]: ...

    @abstractmethod
    def _append_logs(self, run_id: str, lines: list[str]) -> None: ...

    @abstractmethod
    def _tail_logs(self, run_id: str, n: int) -> list[str]: ...


def new_run_id() -> str:
    """A fresh run id: `run-` and 12 random hex digits (48 bits)."""
    return f"run-{secrets.token_hex(6)}"


def status_event_data(status: RunStatus, error: str | None) -> str:
    """The JSON data of the `status` event a transition (or creation) writes."""
    return dump_json({"status": status.value, "error": error})


def encode_metrics(records: Sequence[Mapping[str, Any]]) -> list[EncodedRecord]:
    """Check that every record has an integer step in range; encode each as canonical JSON."""
    if isinstance(records, Mapping):
        raise TypeError("records must be a list of records, not one record")
    encoded = []
    for index, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise TypeError(f"metrics record {index} is a {type(record).__name__}, not a mapping")
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
            raise ValueError(
                f"metrics record {index}: 'step' must be an integer in [0, {MAX_STEP}], "
                f"got {step!r}"
            )
        encoded.append((step, dump_json(dict(record))))
    return encoded


def encode_cursor(seq: int) -> str:
    """The cursor handed out for the page after the run with creation sequence `seq`."""
    return str(seq)


def decode_cursor(cursor: str) -> int:
    """The creation sequence a cursor points below; `InvalidCursor` for one never handed out."""
    if not cursor.isdigit() or not cursor.isascii() or int(cursor) < 1:
        raise InvalidCursor(f"invalid cursor {cursor!r}: pass the next_cursor of a previous page")
    return int(cursor)


def _check_limit(limit: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_READ_LIMIT:
        raise ValueError(f"limit must be an integer in [1, {MAX_READ_LIMIT}], got {limit!r}")
