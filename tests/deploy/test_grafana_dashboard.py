"""deploy/grafana/kpo-stability.json: a structural check of the dashboard, and every metric it
names checked against the control plane's real /metrics output (the live stack of conftest.py).
That each query returns data is checked in test_promql_live.py."""

from __future__ import annotations

import re
from itertools import combinations
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.live import LiveStack
from tests.deploy.promql import SYNTHETIC, dashboard, metric_names, panel_queries, panels

PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "text", "heatmap"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_COLUMNS = 24
# What the issue asks the dashboard to show, by the metric that shows it.
REQUIRED = {
    "reward": "kpo_reward_mean",
    "entropy": "kpo_entropy_nats",
    "clip fraction": "kpo_clip_fraction_ratio",
    "KL": "kpo_kl_nats",
    "staleness": "kpo_staleness_mean",
    "ratio switch frequency": "kpo_ratio_switch_frequency_ratio",
    "low-frequency ratio": "kpo_ratio_low_frequency_ratio",
    "throughput": "kpo_tokens_generated_total",
    "rollouts dropped": "kpo_rollouts_dropped_stale_total",
    "step latency": "kpo_learner_step_seconds_bucket",
}
_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)\s*[{\[]")
# A PromQL aggregation, with its `by` or `without` and their labels if it has them.
_AGGREGATION = re.compile(
    r"\b(?:sum|avg|min|max|count|group|stddev|stdvar|topk|bottomk|quantile|count_values)"
    r"\s*(?:(by|without)\s*\(([^)]*)\))?\s*\("
)


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def test_dashboard_identity() -> None:
    board = dashboard()
    assert board["uid"] == "kpo-stability" and board["title"]
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    assert board["time"]["from"].startswith("now-")


def test_datasource_and_run_variables() -> None:
    found = variables()
    datasource = found["datasource"]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    run = found["run_id"]
    assert run["type"] == "query" and run["datasource"] == DATASOURCE
    query = run["query"]["query"] if isinstance(run["query"], dict) else run["query"]
    assert re.fullmatch(r"label_values\((kpo_\w+), run_id\)", query), query
    assert run["multi"] and run["includeAll"] and run["allValue"] == ".*"


def test_panels_are_valid_and_laid_out_without_overlap() -> None:
    all_panels = list(panels())
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    boxes = []
    for panel in all_panels:
        assert panel["type"] in PANEL_TYPES, panel["type"]
        assert panel["title"], panel
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0 and grid["y"] >= 0
        assert grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        boxes.append((panel["title"], grid))
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel.get("description"), f"{panel['title']}: say what it shows"
        targets = panel["targets"]
        assert targets, panel["title"]
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in targets:
            assert target["expr"].strip() and target["datasource"] == DATASOURCE
    for (a, ga), (b, gb) in combinations(boxes, 2):
        overlap = (
            ga["x"] < gb["x"] + gb["w"]
            and gb["x"] < ga["x"] + ga["w"]
            and ga["y"] < gb["y"] + gb["h"]
            and gb["y"] < ga["y"] + ga["h"]
        )
        assert not overlap, f"panels {a!r} and {b!r} overlap"


def _per_run(name: str) -> bool:
    """Per-run metrics follow the run picker; the others are the control plane's own."""
    return name not in SYNTHETIC and not name.startswith(("kpo_api_", "kpo_runs", "kpo_store_up"))


def test_every_query_is_filtered_by_the_run_or_the_job() -> None:
    for query in panel_queries():
        for name in metric_names(query.expr):
            wanted = 'run_id=~"$run_id"' if _per_run(name) else 'job="kpo-control-plane"'
            assert wanted in query.expr, f"{query.panel}: {query.expr}"


def test_every_per_run_panel_overlays_the_runs_picked() -> None:
    """Several runs picked in `$run_id` (Grafana writes them as `(a|b)`) give one series per run
    on every per-run panel: each matcher is a regex one, no aggregation folds the runs together,
    and each series' legend names its run."""
    shown: set[str] = set()
    for panel in panels():
        targets = panel.get("targets", [])
        names = [metric_names(t["expr"]) for t in targets]
        if not any(_per_run(name) for found in names for name in found):
            continue
        for target, found in zip(targets, names, strict=True):
            expr, where = target["expr"], f"{panel['title']} {target['refId']}"
            assert all(_per_run(name) for name in found), f"{where}: mixes in other metrics"
            matchers = re.findall(r'run_id\s*(=~|!~|!=|=)\s*"([^"]*)"', expr)
            assert matchers and set(matchers) == {("=~", "$run_id")}, f"{where}: {expr}"
            for grouping, labels in _AGGREGATION.findall(expr):
                kept = {label.strip() for label in labels.split(",")}
                assert grouping == "by" and "run_id" in kept, f"{where}: folds the runs: {expr}"
            assert "{{run_id}}" in target.get("legendFormat", ""), f"{where}: legend without run"
            shown |= found
        if panel["type"] == "timeseries":
            assert panel["options"]["legend"]["showLegend"], panel["title"]
        if panel["type"] == "stat":  # one value per run, each with its name
            assert panel["options"]["textMode"] in ("auto", "value_and_name"), panel["title"]
            assert not panel["options"]["reduceOptions"]["values"], panel["title"]
    assert set(REQUIRED.values()) <= shown


def test_every_selector_is_a_known_metric_name() -> None:
    """A misspelt metric (not starting with kpo_) would escape metric_names(); catch it here."""
    for query in panel_queries():
        selected = set(_SELECTOR.findall(re.sub(r'"[^"]*"', '""', query.expr)))
        assert selected <= metric_names(query.expr), f"{query.panel}: {selected}"


def test_dashboard_shows_what_the_issue_asks_for() -> None:
    named = set().union(*(metric_names(q.expr) for q in panel_queries()))
    missing = {topic: metric for topic, metric in REQUIRED.items() if metric not in named}
    assert not missing, missing
    quantiles = {
        q.expr.split(",")[0] for q in panel_queries() if "kpo_learner_step_seconds_bucket" in q.expr
    }
    assert quantiles == {
        "histogram_quantile(0.5",
        "histogram_quantile(0.9",
        "histogram_quantile(0.99",
    }


def test_every_metric_named_is_in_the_control_planes_metrics(live: LiveStack) -> None:
    samples = {
        sample.name
        for family in text_string_to_metric_families(live.metrics_text())
        for sample in family.samples
    }
    for query in panel_queries():
        unknown = metric_names(query.expr) - samples - SYNTHETIC
        assert not unknown, f"{query.panel}: not in /metrics: {unknown}"
