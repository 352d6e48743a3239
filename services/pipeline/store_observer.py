"""A run observer that reports into the control plane's store (see `services.store`).

The driver reports `running`, then one metrics record per learner step, then `succeeded`,
`failed` or `cancelled`. This observer writes each report with the store's buffered writes
(`transition(..., buffer=True)`, `append_metrics`, `append_logs`), so that a Redis restart in the
middle of a run delays the reports instead of losing them or stopping the run.

How the driver's reports map onto the store's lifecycle (`queued -> running -> final`):

- `running` from a resumed run (its Ray job restarted, or run again, from a checkpoint) finds
  the run already `running`. The lifecycle has no `running -> running`, so the transition is
  skipped and only a log line says that the run resumed.
- A report the lifecycle rejects because the run already finished (the control plane cancelled
  it while it was still queued, or the reconciler gave up on it) is logged and skipped; with
  `on_finished_elsewhere` the run is also asked to stop, since nobody is waiting for it.
- A write the store cannot accept now (`BufferFull`: Redis has been down for so long that the
  outage buffer filled up), or that it rejects for any other store reason, is logged and the run
  goes on. The run's own output directory still has every record.

It is also an `EventObserver` (the run's events go to the store's event log, which the API's
event stream serves), a `RewindObserver` (a run resumed from a checkpoint drops the store's
records after it, so the history holds the steps as finally trained) and a `ResumeSource`: a
run the stability guard paused takes the `resume` event that `POST /v1/runs/{id}/resume` stored
(services/pipeline/pause.py says which answers which pause). It reads the run's events on from
where it stopped, so each poll of a paused run reads only what is new.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from services.observers import AlertRequest, MetricsRecord, ResumeRequest, RunState
from services.pipeline.outputs import (
    format_progress_line,
    format_status_line,
    json_safe,
    json_safe_record,
)
from services.pipeline.pause import (
    PAUSED_EVENT,
    RESUMED_EVENT,
    GuardEvents,
    resume_request,
)
from services.store import InvalidTransition, RunStatus, Store, StoreError
from services.store.lifecycle import STATUSES_WITH_ERROR, TERMINAL_STATUSES

log = logging.getLogger(__name__)

FINAL_STATES: frozenset[RunState] = frozenset({"succeeded", "failed", "cancelled"})


class StoreObserver:
    """Writes a run's status changes, metrics records and progress lines into `store`."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        total_steps: int,
        on_finished_elsewhere: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.total_steps = total_steps
        self._on_finished_elsewhere = on_finished_elsewhere
        self.final_state: RunState | None = None  # the final state this observer reported
        self._events = GuardEvents()  # the run's events read so far (a paused run's)
        self._refused: set[str] = set()  # resume requests the driver could not apply
        self._unreadable = False  # the store could not be read at the last poll

    def on_status(self, state: RunState, error: str | None = None, **details: Any) -> None:
        if state in FINAL_STATES:
            self.final_state = state
        # The store keeps an error only with the statuses that may carry one.
        kept_error = error if RunStatus(state) in STATUSES_WITH_ERROR else None
        self._write(
            f"status {state}",
            lambda: self.store.transition(self.run_id, state, kept_error, buffer=True),
        )
        lines = [format_status_line(state, error)]
        resumed_from = details.get("resumed_from")
        if state == "running" and resumed_from is not None:
            lines.append(f"[kpo] resumed from the checkpoint of step {resumed_from}")
        self._write("log lines", lambda: self.store.append_logs(self.run_id, lines))

    def on_metrics(self, record: MetricsRecord) -> None:
        safe = json_safe_record(record)
        line = format_progress_line(safe, self.total_steps)
        self._write(f"metrics of step {safe['step']}", lambda: self._append_metrics(safe))
        self._write("log lines", lambda: self.store.append_logs(self.run_id, [line]))

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        safe = json_safe(data)
        self._write(f"event {kind}", lambda: self.store.append_event(self.run_id, kind, safe))
        line = None
        if kind == PAUSED_EVENT:
            line = (
                f"[kpo] paused by the stability guard at step {data.get('checkpoint')}: "
                f"{data.get('message')}; resume with POST /v1/runs/{self.run_id}/resume "
                f"(kpo resume-paused {self.run_id})"
            )
        elif kind == RESUMED_EVENT:
            line = f"[kpo] resumed from the pause at step {data.get('checkpoint')}"
        if line is not None:
            self._write("log lines", lambda: self.store.append_logs(self.run_id, [line]))

    def on_metrics_rewound(self, step: int, record: MetricsRecord | None) -> None:
        self._write(f"rewind to step {step}", lambda: self.store.rewind_metrics(self.run_id, step))
        if record is not None:  # the store ignores it where it holds that step already
            safe = json_safe_record(record)
            self._write(f"metrics of step {step}", lambda: self._append_metrics(safe))

    def take_resume(self, paused_at: int) -> ResumeRequest | None:
        if not self._read_events_on():
            return None
        event = self._events.answer(paused_at, self._refused)
        return None if event is None else resume_request(event)

    def take_alerts(self) -> list[AlertRequest]:
        return list(self._events.alerts.values()) if self._read_events_on() else []

    def _read_events_on(self) -> bool:
        """Read the run's events after those read; False in a store outage (the driver asks
        again at its next poll or step; the outage is logged once)."""
        try:
            self._events.read_on(self.store, self.run_id)
        except StoreError as error:
            if not self._unreadable:
                log.warning("run %s: cannot read its events yet: %s", self.run_id, error)
            self._unreadable = True
            return False
        self._unreadable = False
        return True

    def refuse(self, request: ResumeRequest, reason: str) -> None:
        self._refused.add(request.request_id)
        log.error("run %s: resume request %s refused: %s", self.run_id, request.request_id, reason)

    def _append_metrics(self, record: MetricsRecord) -> None:
        self.store.append_metrics(self.run_id, [record])

    def _write(self, what: str, write: Callable[[], object]) -> None:
        """Make one store write; a store error is logged, never raised into the run."""
        try:
            write()
        except InvalidTransition as error:
            self._on_rejected(error)
        except StoreError as error:  # BufferFull included: the run goes on without this write
            log.warning("run %s: %s not stored: %s", self.run_id, what, error)

    def _on_rejected(self, error: InvalidTransition) -> None:
        """A status report the lifecycle refused: a resume, or a run that finished elsewhere."""
        if error.current == error.requested == RunStatus.RUNNING.value:
            log.info("run %s resumed: it is running already", self.run_id)
            return
        log.warning("run %s: status report skipped: %s", self.run_id, error)
        finished = RunStatus(error.current) in TERMINAL_STATUSES
        if finished and error.requested == "running" and self._on_finished_elsewhere is not None:
            self._on_finished_elsewhere()
