"""What a run reports as it goes, and the interface of whoever listens.

The driver reports each state change and each metrics record to its `RunObserver`s: the run
directory and the progress line (services.pipeline.outputs), the control plane's store
(services.pipeline.store_observer) and the experiment trackers (services.tracking). Declared
here, below all of them, so that a tracker need not import the driver it observes.

Optional capabilities, which an observer has when it has their method (checked with
`isinstance`, so `RunObserver` itself is unchanged and every observer that predates them still
is one): an `EventObserver` also receives the run's events (the stability guard's actions, its
pause and resume), a `RewindObserver` hears that the records after a step no longer hold (the
run resumed from an earlier checkpoint and trains those steps again), and a `ResumeSource`
answers a run that the guard paused with the operator's resume request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

RunState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
MetricsRecord = dict[str, Any]  # one learner step's record (keys: services.metrics)


class RunObserver(Protocol):
    """Receives a run's status changes and metrics records, in order."""

    def on_status(self, state: RunState, error: str | None = None, **details: Any) -> None: ...

    def on_metrics(self, record: MetricsRecord) -> None: ...


@runtime_checkable
class EventObserver(Protocol):
    """Receives a run's events: `kind` matches [A-Za-z0-9_.:-]{1,64}, `data` is JSON-ready."""

    def on_event(self, kind: str, data: dict[str, Any]) -> None: ...


@runtime_checkable
class RewindObserver(Protocol):
    """Hears that the run resumed from its checkpoint of `step`: the records it received after
    `step` are replaced by those of the steps trained again, which follow. `record` is the
    checkpointed step's own record (None at step 0): the keeper holds it afterwards, also where
    the driver that wrote it was killed before it reached this keeper."""

    def on_metrics_rewound(self, step: int, record: MetricsRecord | None) -> None: ...


@dataclass(frozen=True)
class ResumeRequest:
    """An operator's answer to a paused run. spec_patch: spec-shaped, the keys of
    services.spec.SPEC_PATCH_KEYS only ({} resumes unchanged); request_id: the source's name of
    it (a store event's id, a file's path); requested_at: when it was made (epoch seconds);
    problem: why what the source holds is no request it can read (the driver refuses it)."""

    spec_patch: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""
    requested_at: float | None = None
    problem: str | None = None


@runtime_checkable
class ResumeSource(Protocol):
    """Where the resume request of a paused run comes from (the store, the run directory)."""

    def take_resume(self, paused_at: int) -> ResumeRequest | None:
        """The request that answers the pause whose checkpoint is of step `paused_at`; None
        while there is none. The same request each time it is asked, in this process or in a
        driver restarted later: a driver that resumed from that checkpoint again (its learner
        died before the next one) resumes as it did."""
        ...

    def refuse(self, request: ResumeRequest, reason: str) -> None:
        """The driver cannot apply `request` (`reason`): it is no longer the answer."""
        ...


@dataclass(frozen=True)
class AlertRequest:
    """An alert's request of a running run (Alertmanager's webhook, services/api/alerts.py).
    action: what it asks; key: the alert's identity (fingerprint and start), one request per
    firing however often Alertmanager resends it; reason: `alert <alertname>` (the action's
    reason, a Prometheus label); summary: the alert's summary annotation, for the log."""

    action: Literal["checkpoint", "pause"]
    key: str
    reason: str
    summary: str = ""


@runtime_checkable
class AlertSource(Protocol):
    """Where a running run's alert requests come from (the control plane's store)."""

    def take_alerts(self) -> list[AlertRequest]:
        """The requests not answered yet, oldest first: those no `guard.action` event of the
        run names (`alert`), so a restarted driver does not answer one twice."""
        ...
