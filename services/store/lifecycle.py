"""The run lifecycle: which status may follow which. The only copy; both backends use it.

    queued -> running -> succeeded | failed | cancelled
    queued -> failed | cancelled      (a run that never started: launch error, or cancelled early)

Terminal statuses have no successor, so cancelling a finished run is an `InvalidTransition`
(a 409 at the API). Moving to the status a run already has is not allowed either: the writers that
must survive a retry (the Redis store's) make each call idempotent by other means.
"""

from __future__ import annotations

from services.store.errors import InvalidTransition
from services.store.records import RunStatus

NEXT_STATUSES: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.QUEUED: frozenset({RunStatus.RUNNING, RunStatus.FAILED, RunStatus.CANCELLED}),
    RunStatus.RUNNING: frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED}),
    RunStatus.SUCCEEDED: frozenset(),
    RunStatus.FAILED: frozenset(),
    RunStatus.CANCELLED: frozenset(),
}

TERMINAL_STATUSES = frozenset(status for status, nxt in NEXT_STATUSES.items() if not nxt)
# Runs that hold (or wait for) cluster resources: what a cap on active runs counts.
ACTIVE_STATUSES = frozenset(NEXT_STATUSES) - TERMINAL_STATUSES

# Statuses that may carry an error message: why a run failed, or why it was cancelled.
STATUSES_WITH_ERROR = frozenset({RunStatus.FAILED, RunStatus.CANCELLED})


def predecessors(status: RunStatus) -> frozenset[RunStatus]:
    """The statuses from which a run may move to `status` (what a server-side check needs)."""
    return frozenset(prev for prev, nxt in NEXT_STATUSES.items() if status in nxt)


def check_transition(run_id: str, current: RunStatus, requested: RunStatus) -> None:
    """Raise `InvalidTransition` unless a run that is `current` may become `requested`."""
    allowed = NEXT_STATUSES[current]
    if requested not in allowed:
        raise InvalidTransition(run_id, current.value, requested.value, sorted(allowed))


def parse_status(value: str | RunStatus) -> RunStatus:
    """A status from its name, failing with the list of valid names."""
    try:
        return RunStatus(value)
    except ValueError:
        valid = ", ".join(s.value for s in RunStatus)
        raise ValueError(f"unknown run status {value!r}; valid statuses: {valid}") from None
