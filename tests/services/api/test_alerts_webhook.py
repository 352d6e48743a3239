"""POST /v1/alerts over real HTTP: Alertmanager's webhook payload (format version 4, as its
documentation gives it) acts on the run its alerts name, with a token of its own."""

from __future__ import annotations

import copy
import json
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from services.pipeline.pause import ALERT_EVENT
from services.store import RunStatus
from tests.services.api.conftest import TOKEN, Api, ApiFactory

ALERT_TOKEN = "alert-token-abcdef0123456789"
TINY = {"name": "t", "pipeline": {"steps": 3}, "generation": {"group_size": 4}}


def notification(run_id: str, status: str = "firing", **labels: str) -> dict[str, Any]:
    """A webhook notification as Alertmanager sends it, for one alert of a KPO rule."""
    alert_labels = {
        "alertname": "KPOEntropyCollapse",
        "run_id": run_id,
        "severity": "warning",
        **labels,
    }
    return {
        "version": "4",
        "groupKey": '{}:{alertname="KPOEntropyCollapse"}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "kpo",
        "groupLabels": {"alertname": "KPOEntropyCollapse"},
        "commonLabels": alert_labels,
        "commonAnnotations": {"summary": f"Run {run_id}: policy entropy collapsed"},
        "externalURL": "http://alertmanager.monitoring:9093",
        "alerts": [
            {
                "status": status,
                "labels": alert_labels,
                "annotations": {"summary": f"Run {run_id}: policy entropy collapsed"},
                "startsAt": "2026-12-06T09:52:26.739266876+02:00",
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "http://prometheus.monitoring:9090/graph?g0.expr=kpo",
                "fingerprint": "c6eadffa33fcdf37",
            }
        ],
    }


@pytest.fixture
def alerting(api_factory: ApiFactory) -> Iterator[Api]:
    with api_factory(KPO_API_TOKEN=TOKEN, KPO_ALERT_TOKEN=ALERT_TOKEN) as running:
        yield running


def post(api: Api, body: Any, token: str | None = ALERT_TOKEN) -> Any:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return api.client.post("/v1/alerts", json=body, headers=headers)


def running_run(api: Api) -> str:
    run = api.store.create_run(TINY)
    api.store.transition(run.id, RunStatus.RUNNING)
    return run.id


def alert_events(api: Api, run_id: str) -> list[dict[str, Any]]:
    return [e.data for e in api.store.read_events(run_id) if e.kind == ALERT_EVENT]


def test_a_pause_alert_is_recorded_on_its_run_for_the_driver(alerting: Api) -> None:
    run_id = running_run(alerting)
    answer = post(alerting, notification(run_id, kpo_action="pause"))
    assert answer.status_code == 200, answer.text
    assert answer.json()["outcomes"] == [
        {
            "alertname": "KPOEntropyCollapse",
            "run_id": run_id,
            "status": "firing",
            "action": "pause",
            "ignored": None,
        }
    ]
    [event] = alert_events(alerting, run_id)
    assert event["action"] == "pause" and event["alertname"] == "KPOEntropyCollapse"
    assert event["fingerprint"] == "c6eadffa33fcdf37"
    assert event["summary"] == f"Run {run_id}: policy entropy collapsed"
    assert alerting.store.get_run(run_id).status == RunStatus.RUNNING


def test_without_kpo_action_the_default_applies(api_factory: ApiFactory) -> None:
    env = {"KPO_ALERT_TOKEN": ALERT_TOKEN, "KPO_ALERT_DEFAULT_ACTION": "checkpoint"}
    with api_factory(**env) as api:
        run_id = running_run(api)
        assert post(api, notification(run_id)).json()["outcomes"][0]["action"] == "checkpoint"
        assert [e["action"] for e in alert_events(api, run_id)] == ["checkpoint"]


def test_a_cancel_alert_cancels_the_run_as_the_api_does(alerting: Api) -> None:
    run_id = running_run(alerting)
    answer = post(alerting, notification(run_id, kpo_action="cancel"))
    assert answer.json()["outcomes"][0]["action"] == "cancel"
    assert alerting.store.get_run(run_id).cancel_requested_at is not None
    assert alerting.launcher.stopped == [run_id]


def test_a_notification_without_the_alert_token_is_refused(alerting: Api) -> None:
    run_id = running_run(alerting)
    body = notification(run_id, kpo_action="cancel")
    for token in (None, "wrong-token-0123456789abc", TOKEN):  # the API's token is not its own
        answer = post(alerting, body, token)
        assert answer.status_code == 401, answer.text
        assert "KPO_ALERT_TOKEN" in answer.text
    assert alert_events(alerting, run_id) == []
    assert alerting.store.get_run(run_id).cancel_requested_at is None
    # The alert token opens nothing else: the API's writes still want the API token.
    refused = alerting.client.post(
        "/v1/runs", json=TINY, headers={"Authorization": f"Bearer {ALERT_TOKEN}"}
    )
    assert refused.status_code == 401


def test_without_an_alert_token_there_is_no_webhook(secured: Api) -> None:
    run_id = running_run(secured)
    answer = secured.admin.post("/v1/alerts", json=notification(run_id))
    assert answer.status_code == 404
    assert alert_events(secured, run_id) == []


def test_alerts_that_cannot_act_are_answered_with_the_reason(alerting: Api) -> None:
    running = running_run(alerting)
    finished = alerting.store.create_run(TINY).id
    alerting.store.transition(finished, RunStatus.CANCELLED, "by hand")
    queued = alerting.store.create_run(TINY).id
    body = notification(running, kpo_action="pause")
    first = body["alerts"][0]
    cases = {
        "no run_id label": {k: v for k, v in first["labels"].items() if k != "run_id"},
        "run_id is not a run id": {**first["labels"], "run_id": "../etc"},
        "no such run": {**first["labels"], "run_id": "run-000000000000"},
        "the run is cancelled": {**first["labels"], "run_id": finished},
        "the run is queued: nothing to pause": {**first["labels"], "run_id": queued},
        "unknown kpo_action 'reboot'; valid: warn, checkpoint, pause, cancel": {
            **first["labels"],
            "kpo_action": "reboot",
        },
    }
    body["alerts"] = [{**first, "labels": labels} for labels in cases.values()]
    resolved = copy.deepcopy(first)
    resolved["status"] = "resolved"
    body["alerts"].append(resolved)
    answer = post(alerting, body)
    assert answer.status_code == 200, answer.text
    outcomes = answer.json()["outcomes"]
    assert [o["ignored"] for o in outcomes] == [*cases, "resolved"]
    assert all(o["action"] is None for o in outcomes)
    # The run's unknown action and its resolved alert are on its record; nothing acted.
    assert [e["status"] for e in alert_events(alerting, running)] == ["firing", "resolved"]
    assert all(e["action"] is None for e in alert_events(alerting, running))
    assert alerting.store.get_run(queued).status == RunStatus.QUEUED


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"version": "3"}, "version"),
        ({"alerts": "none"}, "alerts"),
        ({"status": "burning"}, "status"),
    ],
)
def test_a_payload_that_is_not_alertmanagers_is_a_422_naming_the_field(
    alerting: Api, change: dict[str, Any], field: str
) -> None:
    answer = post(alerting, {**notification(running_run(alerting)), **change})
    assert answer.status_code == 422
    assert field in answer.text


def test_a_half_sent_notification_acts_on_nothing(api_factory: ApiFactory) -> None:
    # The body stops halfway and the connection stays open: answered 408 once the body
    # deadline passes, and nothing of it reaches the run.
    with api_factory(KPO_ALERT_TOKEN=ALERT_TOKEN, KPO_HEADER_TIMEOUT_S=1) as api:
        run_id = running_run(api)
        url = urlsplit(api.url)
        assert url.hostname is not None and url.port is not None
        body = json.dumps(notification(run_id, kpo_action="cancel")).encode()
        head = (
            f"POST /v1/alerts HTTP/1.1\r\nHost: {url.hostname}\r\n"
            f"Authorization: Bearer {ALERT_TOKEN}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            sock.sendall(head + body[: len(body) // 2])
            answer = sock.recv(4096).decode(errors="replace")
        assert answer.startswith("HTTP/1.1 408"), answer
        assert alert_events(api, run_id) == []
        assert api.store.get_run(run_id).cancel_requested_at is None
