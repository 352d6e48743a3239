"""What a store returns: a run, one of its status transitions, one of its events.

These are frozen pydantic models so that the API can return them as they are. Metrics records and
log lines stay plain (`dict` and `str`): their content belongs to the learner, not to the store.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict


class RunStatus(StrEnum):
    """Where a run is in its lifecycle; see `services.store.lifecycle` for the allowed moves."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Transition(BaseModel):
    """One status a run entered, and when (UTC)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: RunStatus
    at: datetime


class RunRecord(BaseModel):
    """A run as stored. Filled by the store; read by the API, the CLI and the dashboard."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str  # "run-" + 12 hex digits
    status: RunStatus  # the last entry of `transitions`
    spec: dict[str, Any]  # the resolved run spec, as JSON-compatible data
    created_at: datetime  # UTC; equal to transitions[0].at
    transitions: tuple[Transition, ...]  # every status entered, oldest first, starting with queued
    error: str | None = None  # why the run failed (or was cancelled), when the caller said
    # When a cancel of the run was first asked for (UTC), kept in the store so that every
    # control plane (another replica, one restarted since) knows the run must not be restarted.
    cancel_requested_at: datetime | None = None
    # How many times a control plane started the run's driver again after it was lost (its job
    # failed without an outcome, or went with a restarted Ray cluster). Kept here because
    # Ray's own job history goes with its cluster, and the restart budget must not.
    driver_restarts: int = 0


class Event(BaseModel):
    """One entry of a run's event log, as sent to server-sent-event clients.

    Kinds the store writes itself: `status` (data: {"status", "error"}) on every transition and at
    creation, and `metrics` (data: the metrics record) for every stored metrics record.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str  # strictly increasing within a run (see `event_id_order`); the SSE `id:` field
    kind: str  # the SSE `event:` field
    data: dict[str, Any]
    at: datetime  # UTC, when the write was made


def event_id_order(event_id: str) -> tuple[int, ...]:
    """The key by which a run's event ids increase.

    The local store's ids are integers ("17"); Redis stream ids are "<ms>-<seq>" pairs
    ("1712345678901-0"). Both are dash-separated integers compared left to right, which string
    comparison would get wrong ("9" > "10").
    """
    return tuple(int(part) for part in event_id.split("-"))
