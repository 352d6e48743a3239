"""POST /v1/alerts: Alertmanager's webhook (services/api/alerts.py), served only with
KPO_ALERT_TOKEN (or KPO_ALERT_TOKEN_FILE) set, and guarded by that token, not the API's.

Every alert of a notification is answered with what it did. An alert that names no run, an
unknown or finished one, or an unknown action is ignored with the reason (a 200 all the same:
Alertmanager would resend a refused notification forever, and a stale alert of a deleted run
must not block the ones after it); a payload that is not Alertmanager's is a 422.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request

from services.api.alerts import (
    RUN_LABEL,
    Alert,
    AlertAction,
    AlertmanagerPayload,
    AlertOutcome,
    AlertsAnswer,
    alert_event,
    requested_action,
)
from services.api.auth import BearerAuth
from services.api.deps import LauncherDep, SettingsDep, StoreDep
from services.api.routes_runs import cancel_run
from services.jobs.interface import RunLauncher
from services.pipeline.pause import ALERT_EVENT
from services.store import TERMINAL_STATUSES, RunNotFound, RunStatus, Store
from services.store.base import RUN_ID_PATTERN

log = logging.getLogger(__name__)

ALERTS_PATH = "/v1/alerts"
UNAUTHORIZED_ALERT = "missing or wrong alert token: send `Authorization: Bearer <KPO_ALERT_TOKEN>`"

router = APIRouter(tags=["alerts"])


@router.post(ALERTS_PATH, response_model=AlertsAnswer)
def receive_alerts(
    payload: AlertmanagerPayload,
    request: Request,
    store: StoreDep,
    launcher: LauncherDep,
    settings: SettingsDep,
) -> AlertsAnswer:
    """Act on each alert of an Alertmanager notification for the run its `run_id` names."""
    auth: BearerAuth = request.app.state.alert_auth
    auth.check(request, write=True)
    default = settings.alert_default_action
    return AlertsAnswer(
        outcomes=[_act(alert, default, store, launcher) for alert in payload.alerts]
    )


def _act(alert: Alert, default: AlertAction, store: Store, launcher: RunLauncher) -> AlertOutcome:
    run_id = alert.labels.get(RUN_LABEL)
    outcome = AlertOutcome(
        alertname=alert.labels.get("alertname"), run_id=run_id, status=alert.status
    )
    if run_id is None:
        return outcome.model_copy(update={"ignored": f"no {RUN_LABEL} label"})
    if not RUN_ID_PATTERN.fullmatch(run_id):
        return outcome.model_copy(update={"ignored": f"{RUN_LABEL} is not a run id"})
    try:
        run = store.get_run(run_id)
    except RunNotFound:
        return outcome.model_copy(update={"ignored": "no such run"})
    try:
        action = requested_action(alert, default)
    except ValueError as problem:
        store.append_event(run_id, ALERT_EVENT, alert_event(alert, None))
        return outcome.model_copy(update={"ignored": str(problem)})
    if alert.status == "resolved":
        store.append_event(run_id, ALERT_EVENT, alert_event(alert, None))
        return outcome.model_copy(update={"ignored": "resolved"})
    if run.status in TERMINAL_STATUSES:
        return outcome.model_copy(update={"ignored": f"the run is {run.status.value}"})
    if action in ("checkpoint", "pause") and run.status == RunStatus.QUEUED:
        return outcome.model_copy(update={"ignored": f"the run is queued: nothing to {action}"})
    store.append_event(run_id, ALERT_EVENT, alert_event(alert, action))
    if action == "cancel":
        cancel_run(run_id, store, launcher)
    log.warning("alert %s on run %s: %s", outcome.alertname or "(unnamed)", run_id, action)
    return outcome.model_copy(update={"action": action})
