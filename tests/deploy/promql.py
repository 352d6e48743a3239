"""What the dashboard and the rules query: their PromQL expressions and the metric names in them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from tests.deploy.manifests import REPO

DASHBOARD = REPO / "deploy" / "grafana" / "kpo-stability.json"
RULES = REPO / "deploy" / "prometheus" / "rules.yaml"
# Series Prometheus makes itself for every target (not in any /metrics output).
SYNTHETIC = frozenset({"up"})
# Grafana's built-in variables for the live queries: windows long enough to hold every scrape of
# the test's run however slowly the tests before them ran (it is scraped every second).
GRAFANA_BUILTINS = {"__rate_interval": "5m", "__interval": "15s", "__range": "1h"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
# A metric name: ours all start with kpo_ (recorded ones with a `level:` prefix), or are `up`.
_METRIC = re.compile(r"(?<![\w:])((?:[a-z_]+:)?kpo_[a-z0-9_:]*|up)(?![\w:(])")
_VARIABLE = re.compile(r"\$\{?(\w+)\}?")


@dataclass(frozen=True)
class PanelQuery:
    panel: str  # the panel's title
    ref_id: str
    expr: str  # as written in the dashboard, with Grafana variables

    def resolved(self, variables: dict[str, str]) -> str:
        """The expression with `$name` / `${name}` replaced (Grafana's built-ins included)."""
        values = {**GRAFANA_BUILTINS, **variables}

        def value(match: re.Match[str]) -> str:
            name = match.group(1)
            assert name in values, f"{self.panel}: unknown variable ${name}"
            return values[name]

        return _VARIABLE.sub(value, self.expr)


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (label values and strings left out)."""
    return set(_METRIC.findall(_STRING.sub('""', expr)))


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def panels(board: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    for panel in (board or dashboard())["panels"]:
        yield panel
        yield from panel.get("panels", [])


def panel_queries() -> list[PanelQuery]:
    return [
        PanelQuery(panel["title"], target["refId"], target["expr"])
        for panel in panels()
        for target in panel.get("targets", [])
    ]


def rules() -> list[dict[str, Any]]:
    """Every rule of deploy/prometheus/rules.yaml, each with its group's name under `group`."""
    loaded = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [
        {**rule, "group": group["name"]} for group in loaded["groups"] for rule in group["rules"]
    ]


def recorded_names() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}
