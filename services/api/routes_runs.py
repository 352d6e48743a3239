"""/v1/runs: create, list, get, cancel; resume a run the stability guard paused, and its guard's
state; metrics history, live events and log tail of a run."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Header, HTTPException, Query, Request, status
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.api.client_identity import client_key
from services.api.deps import (
    InputsDirDep,
    LauncherDep,
    ReadAccess,
    SettingsDep,
    StoreDep,
    WriteAccess,
)
from services.api.spec_paths import confined_spec
from services.api.sse import EventStreams, SlotResponse, run_events
from services.jobs.interface import RunLauncher
from services.pipeline.pause import RESUME_EVENT, GuardEvents, guard_events
from services.spec import SPEC_PATCH_KEYS, RunSpec, SpecPatchError, flatten_patch
from services.store import (
    TERMINAL_STATUSES,
    InvalidTransition,
    QuotaExceeded,
    RunNotFound,
    RunRecord,
    RunStatus,
    Store,
    Transition,
)
from services.store.base import RUN_ID_PATTERN

log = logging.getLogger(__name__)
T = TypeVar("T")

router = APIRouter(prefix="/v1/runs", tags=["runs"])

# Only ids the store can have made reach it: no traversal, encoded slash or NUL gets further
# than this 422 (pydantic's patterns are searches, hence the anchors).
RunId = Annotated[
    str,
    PathParam(pattern=f"^{RUN_ID_PATTERN.pattern}$", description="`run-` and 12 hex digits"),
]


class RunSummary(BaseModel):
    """A run as the list shows it: the record without its spec (a page holds up to 100 runs, and
    a spec is kilobytes; `GET /v1/runs/{id}` has it), with the spec's few fields a list shows."""

    id: str
    status: RunStatus
    name: str | None  # spec.name
    model: str | None  # spec.model
    estimator: str | None  # spec.algorithm.estimator.name
    mode: str | None  # spec.pipeline.mode: async or sync
    steps: int | None  # spec.pipeline.steps
    created_at: datetime
    transitions: tuple[Transition, ...]
    error: str | None

    @classmethod
    def of(cls, run: RunRecord) -> RunSummary:
        spec = run.spec
        return cls(
            id=run.id,
            status=run.status,
            name=_field(spec, str, "name"),
            model=_field(spec, str, "model"),
            estimator=_field(spec, str, "algorithm", "estimator", "name"),
            mode=_field(spec, str, "pipeline", "mode"),
            steps=_field(spec, int, "pipeline", "steps"),
            created_at=run.created_at,
            transitions=run.transitions,
            error=run.error,
        )


def _field(spec: Mapping[str, Any], kind: type[T], *path: str) -> T | None:
    """The value at `path` in a stored spec if it is a `kind`; None otherwise (a run stored
    with another spec: the store keeps any mapping)."""
    value: Any = spec
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


class RunPage(BaseModel):
    runs: list[RunSummary]
    next_cursor: str | None


class MetricsPage(BaseModel):
    run_id: str
    records: list[dict[str, Any]]
    last_step: int | None


class LogTail(BaseModel):
    run_id: str
    lines: list[str]


class ResumeBody(BaseModel):
    """The body of `POST /v1/runs/{id}/resume` (none, or {}: resume unchanged)."""

    model_config = ConfigDict(extra="forbid")

    spec_patch: dict[str, Any] = Field(
        default_factory=dict,
        description="spec-shaped changes the run resumes with; only "
        + ", ".join(SPEC_PATCH_KEYS)
        + ' (an estimator object, e.g. {"algorithm": {"estimator": {"name": "token"}}})',
    )


class GuardState(BaseModel):
    """A run's stability guard, as its events tell it. paused: the pause the run waits in (its
    action's step, objective, key, value, bound, message, and `checkpoint`), while it runs;
    actions: actions the guard decided; rollbacks: the run's rollbacks; last_action: the
    newest action."""

    run_id: str
    enabled: bool | None  # spec.stability.enabled
    action: str | None  # spec.stability.action
    paused: dict[str, Any] | None
    actions: int
    rollbacks: int
    last_action: dict[str, Any] | None


@router.post(
    "", status_code=status.HTTP_201_CREATED, response_model=RunRecord, dependencies=[WriteAccess]
)
def create_run(
    spec: RunSpec,
    store: StoreDep,
    launcher: LauncherDep,
    inputs: InputsDirDep,
    settings: SettingsDep,
    idempotency_key: Annotated[
        str | None, Header(min_length=1, max_length=255, description="resend-safe key")
    ] = None,
) -> RunRecord:
    """Queue a run of `spec` and launch it as a Ray job.

    With an `Idempotency-Key`, sending the same key and body again returns the same run; the
    same key with another body is a 409. A key holds until its run has been finished for
    `KPO_IDEMPOTENCY_TTL_S` (a day). While `KPO_MAX_ACTIVE_RUNS` runs are queued or running, or
    have a Ray job that has not ended yet (a cancelled run's included), a new run is a 429 with
    `Retry-After` (a resend of a key still returns its run, unless Ray holds that many jobs of
    finished runs).

    Paths (`model` unless built-in, `task.path`, `generation.options.tokenizer`) are read from
    the server's inputs folder, `KPO_DATA_DIR/inputs`: give them relative to it (the stored spec
    holds the absolute path). Absolute paths elsewhere, `..` and `~` are a 422.
    """
    data = confined_spec(spec, inputs, settings.allowlist())
    max_active = None
    if settings.max_active_runs:
        max_active = settings.max_active_runs - len(_lingering_jobs(store, launcher))
        if max_active < 1:
            raise QuotaExceeded(settings.max_active_runs)
    run = store.create_run(
        data, idempotency_key, max_active=max_active, idempotency_ttl_s=settings.idempotency_ttl_s
    )
    if run.status == RunStatus.QUEUED:
        try:
            launcher.submit(run)
        except Exception as error:
            # The run stays queued: the launcher's reconciler submits queued runs again.
            log.warning("could not launch %s yet: %s", run.id, error)
    return run


def _lingering_jobs(store: Store, launcher: RunLauncher) -> set[str]:
    """Runs finished in the store whose Ray job has not ended: a cancelled run's job that Ray
    still holds (one stopped before its driver started stays queued until Ray places it). Each
    holds a driver slot as an active run does, so the cap counts it: otherwise a loop of creates
    and cancels would fill Ray's queue. Without Ray's job server, none is known (the store's
    count alone holds, and the run waits queued for the reconciler)."""
    try:
        live = launcher.live_runs()
    except Exception as error:
        log.warning("could not list the Ray jobs for the cap on active runs: %s", error)
        return set()
    lingering = set()
    for run_id in live:
        try:
            status = store.get_run(run_id).status
        except RunNotFound:  # another control plane's run on the same cluster: its cap's
            continue
        if status in TERMINAL_STATUSES:
            lingering.add(run_id)
    return lingering


@router.get("", response_model=RunPage, dependencies=[ReadAccess])
def list_runs(
    store: StoreDep,
    status_filter: Annotated[RunStatus | None, Query(alias="status")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
) -> RunPage:
    """Runs, newest first, a page at a time (`next_cursor` fetches the next page); summaries
    without the spec (get one run for it)."""
    runs, next_cursor = store.list_runs(status_filter, limit, cursor)
    return RunPage(runs=[RunSummary.of(run) for run in runs], next_cursor=next_cursor)


@router.get("/{run_id}", response_model=RunRecord, dependencies=[ReadAccess])
def get_run(run_id: RunId, store: StoreDep) -> RunRecord:
    return store.get_run(run_id)


@router.post(
    "/{run_id}/cancel",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=RunRecord,
    dependencies=[WriteAccess],
)
def cancel_run(run_id: RunId, store: StoreDep, launcher: LauncherDep) -> RunRecord:
    """Stop a run: a queued one is cancelled at once; a running one finishes its learner step,
    writes a checkpoint and records `cancelled`. A finished run is a 409.

    A running run's request is stored (`cancel_requested_at`) before Ray is asked to stop its
    job: if its driver dies before it could record `cancelled` (or Ray cannot be reached now),
    the reconciler of every control plane, restarted ones included, records it `cancelled`
    instead of restarting it.
    """
    run = store.get_run(run_id)
    if run.status in TERMINAL_STATUSES:
        raise InvalidTransition(run_id, run.status.value, "cancelled", [])
    if run.status == RunStatus.QUEUED:
        run = store.transition(run_id, RunStatus.CANCELLED, "cancelled before it started")
    else:
        run = store.request_cancel(run_id)
    try:
        launcher.stop(run_id)
    except Exception as error:
        if run.status == RunStatus.CANCELLED:
            # Recorded already; the reconciler stops a job of a finished run when it can.
            log.warning("could not stop the job of cancelled run %s yet: %s", run_id, error)
            return run
        # The launcher's own words stay in the server's log: they name hosts and internals.
        log.warning("could not stop the job of run %s: %s", run_id, error)
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            f"could not reach the Ray job server to stop {run_id}; try again (the cancel is "
            "recorded: the run will not be restarted if its driver dies)",
        ) from None
    return run


def _paused(run: RunRecord, events: GuardEvents) -> dict[str, Any] | None:
    """The pause a running run waits in: its newest `guard.paused` event, if no `resume` or
    `guard.resumed` came after it."""
    return events.paused if run.status == RunStatus.RUNNING else None


@router.post(
    "/{run_id}/resume",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=RunRecord,
    dependencies=[WriteAccess],
)
def resume_run(run_id: RunId, store: StoreDep, body: ResumeBody | None = None) -> RunRecord:
    """Resume a run that its stability guard paused (`stability.action: pause`), with
    `spec_patch` applied: the keys of `learner.lr`, `pipeline.max_staleness` and
    `algorithm.estimator` only. The request is stored as the run's `resume` event; the run's
    driver takes it within a second and starts its actors again from the paused checkpoint.

    A run that is not running, or not paused, is a 409; a patch that sets any other key is a
    422 naming every such key, one that makes an invalid run spec a 422 naming the field.
    """
    run = store.get_run(run_id)
    paused = _paused(run, guard_events(store, run_id))
    if paused is None:
        state = "running but not paused" if run.status == RunStatus.RUNNING else run.status.value
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"run {run_id} is {state}: only a run its stability guard paused resumes",
        )
    patch = body.spec_patch if body is not None else {}
    _check_patch(run, patch)
    store.append_event(
        run_id,
        RESUME_EVENT,
        {"spec_patch": patch, "requested_at": time.time(), "checkpoint": paused.get("checkpoint")},
    )
    return run


def _check_patch(run: RunRecord, patch: dict[str, Any]) -> None:
    """A 422 naming each key of `patch` a resume may not set, or each field of the run spec the
    patch makes invalid (`spec_patch.<key>` for a key of the patch, `spec.<field>` for another
    that it conflicts with)."""
    try:
        flat = flatten_patch(patch)
    except SpecPatchError as refused:
        raise _patch_error(
            [(key.split("."), why, "spec_patch_key") for key, why in refused.problems]
        ) from None
    if not flat:
        return
    try:
        spec = RunSpec.model_validate(dict(run.spec))
    except ValidationError:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"run {run.id} holds a spec that is not a valid run spec: it cannot be patched",
        ) from None
    try:
        spec.patched(patch)
    except ValidationError as invalid:
        problems = []
        for error in invalid.errors():
            loc = [str(part) for part in error["loc"]]
            dotted = ".".join(loc)
            # A section's own check (pipeline: max_staleness against lead_batches) names the
            # patched keys in it.
            under = [key for key in flat if key.startswith(f"{dotted}.")]
            if any(dotted == key or dotted.startswith(f"{key}.") for key in flat):
                problems.append((loc, error["msg"], error["type"]))
            elif under:
                problems.extend((key.split("."), error["msg"], error["type"]) for key in under)
            else:
                problems.append((["spec", *loc], error["msg"], error["type"]))
        raise _patch_error(problems) from None


def _patch_error(problems: list[tuple[list[str], str, str]]) -> RequestValidationError:
    """The API's 422 (services/api/errors.py) for patch problems: each (loc, message, type)."""
    return RequestValidationError(
        [
            {
                "loc": ("body", *(loc if loc[0] == "spec" else ["spec_patch", *loc])),
                "msg": message,
                "type": kind,
            }
            for loc, message, kind in problems
        ]
    )


@router.get("/{run_id}/guard", response_model=GuardState, dependencies=[ReadAccess])
def get_guard(run_id: RunId, store: StoreDep) -> GuardState:
    """The run's stability guard: paused or not, its actions and rollbacks (from its events)."""
    run = store.get_run(run_id)
    events = guard_events(store, run_id)
    stability = run.spec.get("stability")
    enabled = stability.get("enabled") if isinstance(stability, Mapping) else None
    return GuardState(
        run_id=run_id,
        enabled=enabled if isinstance(enabled, bool) else None,
        action=_field(run.spec, str, "stability", "action"),
        paused=_paused(run, events),
        actions=events.actions,
        rollbacks=events.rollbacks,
        last_action=events.last_action,
    )


@router.get("/{run_id}/metrics", response_model=MetricsPage, dependencies=[ReadAccess])
def get_metrics(
    run_id: RunId,
    store: StoreDep,
    since_step: Annotated[int, Query(ge=-1, le=2**53 - 1)] = -1,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> MetricsPage:
    """Metrics records with step > `since_step`, in step order, at most `limit` of them."""
    store.get_run(run_id)  # 404 for an unknown run, not an empty history
    records = store.read_metrics(run_id, since_step, limit)
    last = records[-1]["step"] if records else None
    return MetricsPage(run_id=run_id, records=records, last_step=last)


@router.get(
    "/{run_id}/events",
    dependencies=[ReadAccess],
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "event stream"},
        429: {"description": "too many event streams are open (in all, or of this client)"},
    },
)
def stream_events(
    run_id: RunId,
    request: Request,
    store: StoreDep,
    last_event_id: Annotated[str | None, Header(max_length=100)] = None,
    last_event_id_query: Annotated[str | None, Query(alias="last_event_id", max_length=100)] = None,
) -> StreamingResponse:
    """Server-sent events: `status` changes and one `metrics` event per learner step.

    Resume after a reconnect with the `Last-Event-ID` header (or `?last_event_id=`). A stream
    ends after `KPO_STREAM_LIFETIME_S` (the client resumes after its `retry:`); a client past
    its share of open streams, or any past the server's, gets a 429.
    """
    store.get_run(run_id)
    after = last_event_id or last_event_id_query
    store.read_events(run_id, after, 1)  # a bad id is a 422 now, not a broken stream later
    streams: EventStreams = request.app.state.streams
    client = client_key(request, request.app.state.trusted_proxies)
    refused = streams.slots.acquire(client)
    if refused is not None:
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS, refused, headers={"Retry-After": "5"}
        )
    events = run_events(
        request, store, run_id, after, limiter=streams.limiter, lifetime_s=streams.lifetime_s
    )
    return SlotResponse(
        events,
        release=lambda: streams.slots.release(client),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/{run_id}/logs", response_model=LogTail, dependencies=[ReadAccess])
def tail_logs(
    run_id: RunId, store: StoreDep, tail: Annotated[int, Query(ge=0, le=10_000)] = 200
) -> LogTail:
    """The last `tail` lines the run's driver printed."""
    store.get_run(run_id)
    return LogTail(run_id=run_id, lines=store.tail_logs(run_id, tail))
