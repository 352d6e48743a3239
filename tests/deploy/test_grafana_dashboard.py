"""deploy/grafana/kpo-stability.json: a structural check of the dashboard, and every metric it
names (its panels' and its annotations' queries) checked against services/metrics.py and the
control plane's real /metrics output (the live stack of conftest.py). That each panel's query
returns data is checked in test_promql_live.py."""

from __future__ import annotations

import re
from itertools import combinations
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from services.metrics import RECORD, Kind
from tests.deploy.live import LiveStack
from tests.deploy.promql import (
    SYNTHETIC,
    PanelQuery,
    dashboard,
    metric_names,
    panel_queries,
    panels,
)

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


# The Prometheus names services/metrics.py declares, each with the labels of its series.
DECLARED = {m.prometheus: ("run_id", *m.event_labels) for m in RECORD if m.prometheus is not None}
HISTOGRAMS = {m.prometheus for m in RECORD if m.kind is Kind.HISTOGRAM}
# Counters exported from the run's events (one series per label values): only runs with such
# events have their series.
FROM_EVENTS = {m.prometheus for m in RECORD if m.prometheus is not None and m.event_labels}
GUARD_ACTIONS = "kpo_guard_actions_total"
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def annotation_list() -> list[dict[str, Any]]:
    """The dashboard's annotation queries (Grafana's built-in one left out)."""
    return [a for a in dashboard()["annotations"]["list"] if not a.get("builtIn")]


def queries() -> list[PanelQuery]:
    """Every PromQL expression of the dashboard: its panels', then its annotations'."""
    marked = [PanelQuery(f"annotation {a['name']}", "Anno", a["expr"]) for a in annotation_list()]
    return [*panel_queries(), *marked]


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
    for query in queries():
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
    for query in queries():
        selected = set(_SELECTOR.findall(re.sub(r'"[^"]*"', '""', query.expr)))
        assert selected <= metric_names(query.expr), f"{query.panel}: {selected}"


def test_every_per_run_metric_is_declared_in_services_metrics() -> None:
    """Offline, what the live check below finds in /metrics: each per-run metric a panel or an
    annotation names is one services/metrics.py exports (a histogram by its series' names)."""
    for query in queries():
        for name in filter(_per_run, metric_names(query.expr)):
            base, _, suffix = name.rpartition("_")
            histogram = suffix in ("bucket", "count", "sum") and base in HISTOGRAMS
            assert name in DECLARED or histogram, f"{query.panel}: {name} is not exported"


def test_the_guards_actions_are_annotated() -> None:
    """An annotation marks when the stability guard (or an alert that acts) acted on a run picked
    in `$run_id`: each action and its reason, from services/metrics.py's event counter."""
    found = [a for a in annotation_list() if GUARD_ACTIONS in metric_names(a["expr"])]
    assert len(found) == 1, annotation_list()
    guard = found[0]
    assert guard["datasource"] == DATASOURCE  # the dashboard's data source variable
    assert guard["enable"] and not guard["hide"] and guard["name"]
    assert guard["step"] == "60s" and not guard["useValueForTime"]
    listed = dashboard()["annotations"]["list"]
    others = [a["iconColor"] for a in listed if a["name"] != guard["name"]]
    assert len(others) == len(listed) - 1
    assert guard["iconColor"] not in others
    expr = guard["expr"]
    assert metric_names(expr) == {GUARD_ACTIONS}
    # Every selector of it follows the run picker: as many run matchers as selectors.
    selectors = re.findall(rf"{GUARD_ACTIONS}\s*\{{([^}}]*)\}}", expr)
    assert len(selectors) == expr.count(GUARD_ACTIONS), expr
    assert all(s.strip() == 'run_id=~"$run_id"' for s in selectors), expr
    # An action is an increment, or the series' first sample (a run's first action of a reason).
    assert re.search(r"changes\(\s*" + GUARD_ACTIONS, expr) and " unless " in expr, expr
    labels = set(DECLARED[GUARD_ACTIONS])
    assert labels == {"run_id", "reason", "action"}
    assert set(guard["tagKeys"].split(",")) == {"action", "reason"}
    title = set(_PLACEHOLDER.findall(guard["titleFormat"]))
    text = set(_PLACEHOLDER.findall(guard["textFormat"]))
    assert {"action", "reason"} <= title and {"action", "reason", "run_id"} <= text
    assert title | text <= labels, title | text


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
    families = list(text_string_to_metric_families(live.metrics_text()))
    samples = {sample.name for family in families for sample in family.samples}
    # The live run took no guard action: a counter of events is there without series (the
    # parser names a counter's family without its `_total`).
    declared = {f"{f.name}_total" if f.type == "counter" else f.name for f in families}
    for query in queries():
        unknown = metric_names(query.expr) - samples - SYNTHETIC
        unknown -= FROM_EVENTS & declared
        assert not unknown, f"{query.panel}: not in /metrics: {unknown}"


def test_every_annotation_query_runs_in_prometheus(live: LiveStack) -> None:
    """Prometheus evaluates each annotation's expression for the live run (which took no guard
    action: nothing to mark, but no error either)."""
    for annotation in annotation_list():
        query = PanelQuery(f"annotation {annotation['name']}", "Anno", annotation["expr"])
        result = live.query(query.resolved({"run_id": live.run_id}))
        assert result == [], f"{query.panel}: {result}"
