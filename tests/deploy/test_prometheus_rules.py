"""deploy/prometheus/rules.yaml: `promtool check rules`, its unit tests (`promtool test rules`
deploy/prometheus/rules.test.yaml), and its metric names against the control plane's exporter.
The live evaluation of every expression is in test_promql_live.py."""

from __future__ import annotations

import subprocess

from services.api.prometheus import RUN_COUNTERS, RUN_GAUGES, RUN_HISTOGRAMS, STAGE_GAUGES
from tests.deploy.promql import RULES, SYNTHETIC, metric_names, recorded_names, rules

TESTS = RULES.with_name("rules.test.yaml")
# What services/api/prometheus.py exports: gauges as they are, histograms as their series.
EXPORTED = (
    {m.name for m in (*RUN_GAUGES, *STAGE_GAUGES, *RUN_COUNTERS)}
    | {f"{h.name}_{suffix}" for h in RUN_HISTOGRAMS for suffix in ("bucket", "count", "sum")}
    | {"kpo_store_up", "kpo_runs", "kpo_build_info"}
)
ALERTS = {
    "KPOEntropyCollapse",
    "KPOClipFractionSpike",
    "KPORewardDrop",
    "KPONoLearnerProgress",
    "KPOControlPlaneDown",
    "KPOStoreUnreachable",
}


def promtool_ok(promtool: str, *args: str) -> None:
    result = subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_rules(promtool: str) -> None:
    promtool_ok(promtool, "check", "rules", str(RULES))


def test_promtool_unit_tests(promtool: str) -> None:
    promtool_ok(promtool, "test", "rules", str(TESTS))


def test_the_issues_alerts_exist_and_each_is_unit_tested() -> None:
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert alerts == ALERTS
    tested = TESTS.read_text(encoding="utf-8")
    for alert in alerts:
        assert f"alertname: {alert}" in tested, f"{alert} has no promtool test"
    for record in recorded_names():
        assert f"expr: {record}" in tested, f"{record} has no promtool test"


def test_rules_read_only_metrics_the_control_plane_exports() -> None:
    for rule in rules():
        unknown = metric_names(rule["expr"]) - EXPORTED - recorded_names() - SYNTHETIC
        assert not unknown, f"{rule.get('alert') or rule.get('record')}: {unknown}"
