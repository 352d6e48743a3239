"""How runs, transitions, metrics and events are encoded for storage, the same in both backends.

Both backends store a run as one flat row of text fields (a SQLite row, a Redis hash) with the
spec and the list of transitions as JSON text, so one decoder serves both and a run reads back
identically whichever backend wrote it. Timestamps are float seconds since the epoch (exact
through `repr` and through SQLite REAL), returned as UTC datetimes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from services.store.records import Event, RunRecord, RunStatus, Transition


def dump_json(value: Any) -> str:
    """Canonical JSON: sorted keys, no spaces, so that equal data gives equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def fingerprint(canonical_json: str) -> str:
    """What decides whether two requests carried the same spec (idempotency)."""
    return hashlib.sha256(canonical_json.encode()).hexdigest()


def utc(timestamp: float) -> datetime:
    """A stored timestamp as an aware UTC datetime."""
    return datetime.fromtimestamp(timestamp, tz=UTC)


def transition_entry(status: RunStatus, at: float) -> str:
    """One element of the stored transitions array: `["running",1712345678.25]`."""
    return dump_json([status.value, at])


def append_transition(transitions_json: str, entry: str) -> str:
    """The transitions array with `entry` appended.

    The Redis backend's Lua script does the same by string surgery (it has no JSON encoder that
    keeps float precision), so this stays string surgery too: the stored text always ends in `]`
    and holds at least the creation entry.
    """
    return f"{transitions_json[:-1]},{entry}]"


def decode_run(fields: Mapping[str, Any]) -> RunRecord:
    """A run from its stored fields: id, status, spec, created_at, transitions, error,
    cancel_requested_at and driver_restarts.

    The last three may be missing (a Redis hash has no field until it is set, a run stored
    before cancel requests or restarts were kept has none) or empty (SQLite's NULL): both read
    as None (no restarts).
    """
    transitions = tuple(
        Transition(status=RunStatus(status), at=utc(at))
        for status, at in json.loads(fields["transitions"])
    )
    cancel_requested_at = fields.get("cancel_requested_at")
    return RunRecord(
        id=fields["id"],
        status=RunStatus(fields["status"]),
        spec=json.loads(fields["spec"]),
        created_at=utc(float(fields["created_at"])),
        transitions=transitions,
        error=fields.get("error") or None,
        cancel_requested_at=(
            utc(float(cancel_requested_at)) if cancel_requested_at not in (None, "") else None
        ),
        driver_restarts=int(fields.get("driver_restarts") or 0),
    )


def decode_event(event_id: str, kind: str, data_json: str, at: float | str) -> Event:
    """An event from its stored parts."""
    return Event(id=event_id, kind=kind, data=json.loads(data_json), at=utc(float(at)))
