"""Every PromQL expression of the dashboard and of the rules, evaluated by a real Prometheus that
scrapes a real control plane holding a finished tiny run (the `live` fixture, tests/deploy/live.py).

Dashboard queries must return finite data. Recording rules must return data too; alert
expressions must evaluate without error (a healthy run fires none), and each metric an alert
reads must have series. Prometheus' own view of the rule groups must report every rule healthy.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.deploy.live import SCRAPE_JOB, LiveStack
from tests.deploy.promql import PanelQuery, metric_names, panel_queries, recorded_names, rules

QUERIES = panel_queries()
RULES = rules()


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    values = [float(sample["value"][1]) for sample in result]
    return [value for value in values if math.isfinite(value)]


@pytest.mark.parametrize("query", QUERIES, ids=[f"{q.panel}-{q.ref_id}" for q in QUERIES])
def test_dashboard_query_returns_data(live: LiveStack, query: PanelQuery) -> None:
    expr = query.resolved({"run_id": live.run_id, "datasource": "prometheus"})
    result = live.query(expr)
    assert result, f"{query.panel}: no data for {expr}"
    assert finite_values(result), f"{query.panel}: only NaN/Inf for {expr}: {result}"


def test_run_variable_lists_the_run(live: LiveStack) -> None:
    found = live.api("label/run_id/values", **{"match[]": "kpo_policy_version"})
    assert live.run_id in found


@pytest.mark.parametrize("rule", RULES, ids=[r.get("record") or r.get("alert") for r in RULES])
def test_rule_expression_evaluates(live: LiveStack, rule: dict[str, Any]) -> None:
    result = live.query(rule["expr"])  # fails on any evaluation error
    if "record" in rule:
        assert finite_values(result), f"{rule['record']}: no data"
    for name in metric_names(rule["expr"]):
        # Recorded series carry only run_id; scraped ones must come from the control plane.
        selector = name if name in recorded_names() else f'{name}{{job="{SCRAPE_JOB}"}}'
        assert live.query(selector), f"{rule.get('alert') or rule['record']}: {name} has no series"


def test_prometheus_loaded_every_rule_and_reports_it_healthy(live: LiveStack) -> None:
    groups = live.api("rules")["groups"]
    loaded = {(g["name"], r["name"]): r for g in groups for r in g["rules"]}
    expected = {(r["group"], r.get("record") or r.get("alert")) for r in RULES}
    assert set(loaded) == expected
    for key, rule in loaded.items():
        assert rule["health"] == "ok" and not rule.get("lastError"), (key, rule)


def test_a_healthy_finished_run_fires_no_alert(live: LiveStack) -> None:
    active = [a for a in live.api("alerts")["alerts"] if a["labels"]["alertname"].startswith("KPO")]
    assert active == []
