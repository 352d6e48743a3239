"""The stability guard's pause, as a run's events tell it, and the run directory's resume file.

With `stability.action: pause` the driver answers the guard's pause by checkpointing the step,
stopping every actor and waiting for the operator's resume request (services/pipeline/driver.py).
The run's events say where it stands (kinds as the store and `RUN_DIR/events.jsonl` hold them):

    guard.action    an action the guard decided (data: the action, its step, objective, ...)
    guard.paused    the run holds no actors and waits (data: the pause's action and `checkpoint`,
                    the step of the checkpoint it resumes from)
    resume          an operator asked it to resume (data: `spec_patch`, `requested_at`); the
                    API writes it, only while the run is paused
    guard.resumed   the driver took a resume request and goes on (data: `checkpoint`,
                    `spec_patch` as requested, `in_force`: every resume's patches merged)
    guard.resume_refused   the driver could not apply a request (data: `reason`)
    alert           an alert of Alertmanager's webhook (services/api/alerts.py); a firing
                    one's `checkpoint` or `pause` is the driver's to answer, once per firing
                    (its `guard.action` names it: `alert`, the request's key)

A run is paused while its newest `guard.paused` event has no later `resume` or `guard.resumed`.
The request that answers the pause of checkpoint S is the first `resume` after the first
`guard.paused` of S (a restarted driver that announces the same pause again still finds it).

A run without the control plane (`kpo run`) takes its request from `RUN_DIR/resume.json`
(`ResumeFile`): `{"spec_patch": {...}}`, or `{}` to resume unchanged, written whole (to another
name, then renamed) or by `kpo resume-paused RUN_DIR`. The driver moves it to
`RUN_DIR/resumes/step-<S>.json` as it takes it, where a driver resumed from that checkpoint again
finds it; one it cannot apply goes to `RUN_DIR/resume.refused.json`.

Pure Python over the store's records: the API reads it too, without Ray.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.observers import AlertRequest, ResumeRequest
from services.store import Event, Store

log = logging.getLogger(__name__)

ACTION_EVENT = "guard.action"
PAUSED_EVENT = "guard.paused"
RESUMED_EVENT = "guard.resumed"
REFUSED_EVENT = "guard.resume_refused"
RESUME_EVENT = "resume"
ALERT_EVENT = "alert"  # an alert of Alertmanager's webhook (services/api/alerts.py)

RESUME_FILE = "resume.json"
RESUMES_DIR = "resumes"
REFUSED_FILE = "resume.refused.json"
EVENTS_FILE = "events.jsonl"

EVENTS_PAGE = 1000  # events read from the store per call


@dataclass
class GuardEvents:
    """What a run's events say of its stability guard, fed in order (`feed`).

    actions: actions the guard decided; last_action: the newest one's data (its `rollbacks`
    are the run's); paused: the data of the newest `guard.paused` while no `resume` or
    `guard.resumed` followed it; after: the id of the last event fed (to read on from)."""

    actions: int = 0
    last_action: dict[str, Any] | None = None
    paused: dict[str, Any] | None = None
    after: str | None = None
    # Alerts' requests (checkpoint, pause) by their key, in order; answered ones are left out.
    alerts: dict[str, AlertRequest] = field(default_factory=dict)
    answered_alerts: set[str] = field(default_factory=set)
    _seen: int = 0
    _pauses: dict[int, int] = field(default_factory=dict)  # checkpoint step -> its first pause
    _resumes: list[tuple[int, Event]] = field(default_factory=list)

    @property
    def rollbacks(self) -> int:
        return int((self.last_action or {}).get("rollbacks") or 0)

    def feed(self, events: Iterable[Event]) -> None:
        for event in events:
            self._seen += 1
            self.after = event.id
            if event.kind == ACTION_EVENT:
                self.actions += 1
                self.last_action = dict(event.data)
                answered = event.data.get("alert")
                if isinstance(answered, str):
                    self.answered_alerts.add(answered)
                    self.alerts.pop(answered, None)
            elif event.kind == ALERT_EVENT:
                request = alert_request(event)
                if request is not None and request.key not in self.answered_alerts:
                    self.alerts.setdefault(request.key, request)
            elif event.kind == PAUSED_EVENT:
                self.paused = dict(event.data)
                checkpoint = event.data.get("checkpoint")
                if isinstance(checkpoint, int):
                    self._pauses.setdefault(checkpoint, self._seen)
            elif event.kind == RESUME_EVENT:
                self.paused = None
                self._resumes.append((self._seen, event))
            elif event.kind == RESUMED_EVENT:
                self.paused = None

    def answer(self, paused_at: int, refused: Collection[str] = ()) -> Event | None:
        """The first `resume` event after the first pause of checkpoint `paused_at`, leaving
        out the ids in `refused`."""
        since = self._pauses.get(paused_at)
        if since is None:
            return None
        return next(
            (event for seen, event in self._resumes if seen > since and event.id not in refused),
            None,
        )

    def read_on(self, store: Store, run_id: str) -> None:
        """Feed the run's events after the last one fed (StoreError when it cannot be read)."""
        while True:
            page = store.read_events(run_id, self.after, EVENTS_PAGE)
            self.feed(page)
            if len(page) < EVENTS_PAGE:
                return


def alert_request(event: Event) -> AlertRequest | None:
    """The request a stored `alert` event makes of its run (services/api/alerts.py's
    `alert_event`): a firing alert's checkpoint or pause; None for anything else."""
    data = event.data
    action = data.get("action")
    if data.get("status") != "firing" or action not in ("checkpoint", "pause"):
        return None
    # One request per firing: Alertmanager resends a firing alert with each notification.
    key = f"{data.get('fingerprint') or data.get('alertname')}@{data.get('starts_at')}"
    summary = data.get("summary")
    return AlertRequest(
        "checkpoint" if action == "checkpoint" else "pause",
        key,
        f"alert {data.get('alertname')}",
        summary if isinstance(summary, str) else "",
    )


def guard_events(store: Store, run_id: str) -> GuardEvents:
    """Every event of the run, read from `store`, as the guard's summary."""
    events = GuardEvents()
    events.read_on(store, run_id)
    return events


def resume_request(event: Event) -> ResumeRequest:
    """The request a stored `resume` event holds."""
    patch = event.data.get("spec_patch")
    requested_at = event.data.get("requested_at")
    at = float(requested_at) if isinstance(requested_at, int | float) else None
    if patch is not None and not isinstance(patch, dict):
        return ResumeRequest({}, event.id, at, problem="its spec_patch is not a mapping")
    return ResumeRequest(patch or {}, event.id, at)


class ResumeFile:
    """The resume requests of the run directory `run_dir` (module doc), a `ResumeSource`."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._unreadable: tuple[float, int] | None = None  # the file last warned about

    @property
    def pending(self) -> Path:
        return self.run_dir / RESUME_FILE

    def taken(self, paused_at: int) -> Path:
        return self.run_dir / RESUMES_DIR / f"step-{paused_at:08d}.json"

    def take_resume(self, paused_at: int) -> ResumeRequest | None:
        taken = self.taken(paused_at)
        if not taken.exists():
            if not self._readable(self.pending):
                return None
            taken.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.pending, taken)
        try:
            body = read_resume_file(taken)
        except (OSError, ValueError) as error:  # changed after it was taken: not the answer
            return ResumeRequest({}, str(taken), problem=f"{taken} cannot be read: {error}")
        return ResumeRequest(body.get("spec_patch") or {}, str(taken), taken.stat().st_mtime)

    def refuse(self, request: ResumeRequest, reason: str) -> None:
        path = Path(request.request_id)
        if path.exists():
            os.replace(path, self.run_dir / REFUSED_FILE)
        log.error("%s refused (moved to %s): %s", RESUME_FILE, REFUSED_FILE, reason)

    def _readable(self, path: Path) -> bool:
        """Whether `path` holds a request; one that does not read as one (being written, or
        written wrong) is warned about once per version and left where it is."""
        try:
            stat = path.stat()
        except FileNotFoundError:
            return False
        try:
            read_resume_file(path)
        except (OSError, ValueError) as error:
            version = (stat.st_mtime, stat.st_size)
            if version != self._unreadable:
                self._unreadable = version
                log.warning("%s is not a resume request yet: %s", path, error)
            return False
        return True


def read_resume_file(path: Path) -> dict[str, Any]:
    """A resume file's request: a JSON object with at most `spec_patch`, a mapping."""
    body = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(body, dict) or set(body) - {"spec_patch"}:
        raise ValueError('expected {"spec_patch": {...}} (or {} to resume unchanged)')
    if not isinstance(body.get("spec_patch", {}), Mapping):
        raise ValueError("spec_patch must be a mapping")
    return body


def append_event_line(run_dir: Path, kind: str, data: Mapping[str, Any], at: float) -> None:
    """One event as a line of `RUN_DIR/events.jsonl`."""
    line = json.dumps({"kind": kind, "at": at, "data": dict(data)})
    with (run_dir / EVENTS_FILE).open("a", encoding="utf-8") as file:
        file.write(line + "\n")


def read_event_lines(run_dir: Path) -> list[dict[str, Any]]:
    """The events of `RUN_DIR/events.jsonl`, in order."""
    path = run_dir / EVENTS_FILE
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
