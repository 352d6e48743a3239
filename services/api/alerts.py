"""Alertmanager's webhook payload, and what each of its alerts asks of a run.

Alertmanager POSTs a notification per alert group (its `webhook_config` receiver; the payload
format is version 4 of Alertmanager's documentation): the group's status and labels, and its
alerts, each with its own status, labels and annotations. KPO's rules
(deploy/prometheus/rules.yaml) carry the run's `run_id` as a label, as every per-run metric
does. The action an alert asks for is its `kpo_action` label (a rule sets it), else the API's
default (KPO_ALERT_DEFAULT_ACTION, `warn`):

Every alert of a run is recorded as its `alert` event (ALERT_EVENT); the run's driver answers a
firing one's checkpoint or pause (services/pipeline/pause.py):

- `warn`: the event only (the run's event stream and the dashboard show it);
- `checkpoint`: the run writes a checkpoint at its next learner step;
- `pause`: the run checkpoints and waits, holding no GPUs, for `POST /v1/runs/{id}/resume`;
- `cancel`: as `POST /v1/runs/{id}/cancel`.

Only firing alerts act; a resolved one is recorded as an event. Alerts the payload truncated
(`truncatedAlerts`) are not seen: Alertmanager sends them again with the next notification.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from services.spec.bounds import MAX_LIST_ITEMS, NameText

AlertAction = Literal["warn", "checkpoint", "pause", "cancel"]
ALERT_ACTIONS: tuple[AlertAction, ...] = ("warn", "checkpoint", "pause", "cancel")
ACTION_LABEL = "kpo_action"  # the rule label that names an alert's action
RUN_LABEL = "run_id"
# Alertmanager groups at most a few alerts per notification by default; a payload of more than
# this many is not one it sends.
MAX_ALERTS = 1000
MAX_LABEL_CHARS = 4096

LabelSet = dict[str, str]


class _Payload(BaseModel):
    # Alertmanager adds fields between versions: unknown ones are ignored, known ones checked.
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class Alert(_Payload):
    """One alert of a notification."""

    status: Literal["firing", "resolved"]
    labels: LabelSet = Field(default_factory=dict, max_length=MAX_LIST_ITEMS)
    annotations: LabelSet = Field(default_factory=dict, max_length=MAX_LIST_ITEMS)
    starts_at: datetime | None = Field(None, alias="startsAt")
    ends_at: datetime | None = Field(None, alias="endsAt")
    generator_url: str | None = Field(None, alias="generatorURL", max_length=MAX_LABEL_CHARS)
    fingerprint: str | None = Field(None, max_length=64)


class AlertmanagerPayload(_Payload):
    """A webhook notification (Alertmanager's format version 4)."""

    version: Literal["4"]
    group_key: str = Field(alias="groupKey", max_length=MAX_LABEL_CHARS)
    truncated_alerts: int = Field(0, ge=0, alias="truncatedAlerts")
    status: Literal["firing", "resolved"]
    receiver: NameText
    group_labels: LabelSet = Field(default_factory=dict, alias="groupLabels")
    common_labels: LabelSet = Field(default_factory=dict, alias="commonLabels")
    common_annotations: LabelSet = Field(default_factory=dict, alias="commonAnnotations")
    external_url: str | None = Field(None, alias="externalURL", max_length=MAX_LABEL_CHARS)
    alerts: list[Alert] = Field(max_length=MAX_ALERTS)


class AlertOutcome(BaseModel):
    """What one alert of a notification did: `action` on `run_id`, or why nothing (`ignored`)."""

    alertname: str | None
    run_id: str | None
    status: Literal["firing", "resolved"]
    action: AlertAction | None = None
    ignored: str | None = None


class AlertsAnswer(BaseModel):
    """The answer to a notification: one outcome per alert, in order."""

    outcomes: list[AlertOutcome]


def requested_action(alert: Alert, default: AlertAction) -> AlertAction:
    """The action `alert` asks for; ValueError naming its `kpo_action` label if unknown."""
    named = alert.labels.get(ACTION_LABEL)
    if named is None:
        return default
    for action in ALERT_ACTIONS:
        if named == action:
            return action
    raise ValueError(f"unknown {ACTION_LABEL} {named!r}; valid: {', '.join(ALERT_ACTIONS)}")


def alert_event(alert: Alert, action: AlertAction | None) -> dict[str, object]:
    """The run event that records `alert` (and, when it acts, its action)."""
    return {
        "alertname": alert.labels.get("alertname"),
        "status": alert.status,
        "action": action,
        "severity": alert.labels.get("severity"),
        "summary": alert.annotations.get("summary"),
        "fingerprint": alert.fingerprint,
        "starts_at": None if alert.starts_at is None else alert.starts_at.isoformat(),
    }
