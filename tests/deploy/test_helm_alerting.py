"""The chart's Alertmanager webhook (`alerting.*`), rendered with the real `helm template`: off by
default, nothing of it in any release; on, the webhook's own token from its Secret to the file
the control plane reads (`KPO_ALERT_TOKEN_FILE`) and to the AlertmanagerConfig that hands it to
Alertmanager, the AlertmanagerConfig validated against the Prometheus Operator's own CRD schema
and routing exactly the alerts about a run to the API's Service, the NetworkPolicy admitting
Alertmanager (evaluated by tests/deploy/network_policy.py), `ruleActions` labelling exactly the
rules it names, and the values the schema or the chart refuse. docs/deploy.md ("Alerts that
act") explains what each action does; its snippets are checked here too.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from services.api.alerts import ACTION_LABEL, ALERT_ACTIONS, RUN_LABEL, Alert, requested_action
from services.api.settings import ApiSettings
from tests.deploy.manifests import (
    CHART,
    CI_VALUES,
    NAMESPACE,
    REPO,
    Manifest,
    env_of,
    helm_template,
    named,
    one,
    render,
    validate,
)
from tests.deploy.network_policy import Pod, admitted
from tests.deploy.test_helm_chart import (
    CONTROL_PLANE,
    OUTSIDERS,
    PROMETHEUS,
    control_plane_container,
    release_pods,
)

RULES = REPO / "deploy" / "prometheus" / "rules.yaml"
DOCS = REPO / "docs" / "deploy.md"
ALERTMANAGER_CONFIG = "kpo-alerts"
TOKEN_SECRET = "kpo-alert-token"
TOKEN_KEY = "alert-token"
# The webhook on, with the chart's PrometheusRule (which ruleActions label).
ON = ["alerting.enabled=true", "monitoring.prometheusRule.enabled=true"]
# Alertmanager's pods as the Prometheus Operator labels them, in kube-prometheus-stack's namespace.
ALERTMANAGER = Pod.of(
    "alertmanager-main-0",
    "monitoring",
    {"app.kubernetes.io/name": "alertmanager", "app.kubernetes.io/instance": "main"},
)


def source_rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def run_alerts() -> list[str]:
    """The alerts of rules.yaml about one run: their summary names the run (`$labels.run_id`)."""
    return [
        rule["alert"]
        for rule in source_rules()
        if "alert" in rule and "$labels.run_id" in rule["annotations"]["summary"]
    ]


def rendered_alerts(manifests: list[Manifest]) -> dict[str, dict[str, Any]]:
    """The alert rules of the release's PrometheusRule, by name."""
    rule = one(manifests, "PrometheusRule")
    return {
        r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r
    }


def matches(matchers: list[dict[str, str]], labels: dict[str, str]) -> bool:
    """Whether an alert's labels satisfy an AlertmanagerConfig route's matchers, as Alertmanager
    reads them: a missing label is the empty string, regular expressions are anchored."""
    for matcher in matchers:
        value, wanted = labels.get(matcher["name"], ""), matcher["value"]
        kind = matcher.get("matchType", "=")
        regex = kind in ("=~", "!~")
        hit = re.fullmatch(wanted, value) is not None if regex else value == wanted
        if hit != (kind in ("=", "=~")):
            return False
    return True


@pytest.fixture(scope="module")
def alerting_on(helm: str) -> list[Manifest]:
    # The token the chart generates: followed from its Secret to every reader.
    return render(helm, sets=ON, secrets="generated")


# --- off by default ------------------------------------------------------------------------------


def alerting_traces(manifests: list[Manifest]) -> list[str]:
    """Whatever of the webhook a release holds: its objects, variables, volumes and labels."""
    found = [
        f"AlertmanagerConfig/{m['metadata']['name']}"
        for m in named(manifests, "AlertmanagerConfig")
    ]
    found += [
        f"Secret/{m['metadata']['name']}"
        for m in named(manifests, "Secret")
        if m["metadata"]["labels"]["app.kubernetes.io/component"] == "alert-token"
    ]
    config = one(manifests, "ConfigMap", CONTROL_PLANE)["data"]
    container = control_plane_container(manifests)
    found += [name for name in (*config, *env_of(container)) if name.startswith("KPO_ALERT_")]
    deployment = one(manifests, "Deployment", CONTROL_PLANE)["spec"]["template"]
    found += [v["name"] for v in deployment["spec"]["volumes"] if v["name"] == "alert-token"]
    found += [k for k in deployment["metadata"]["annotations"] if k.endswith("alert-token")]
    for policy in named(manifests, "NetworkPolicy"):
        if "alertmanager" in yaml.safe_dump(policy):
            found.append(f"NetworkPolicy/{policy['metadata']['name']}")
    for rule in named(manifests, "PrometheusRule"):
        for alert in rendered_alerts([rule]).values():
            found += [k for k in alert.get("labels", {}) if k in (ACTION_LABEL, "namespace")]
    return found


@pytest.mark.parametrize(
    "values", [path.name for path in CI_VALUES if path.name != "alerting-values.yaml"]
)
def test_off_by_default_in_every_ci_release(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    assert alerting_traces(rendered[values]) == []


def test_off_by_default_with_monitoring(helm: str) -> None:
    """The PrometheusRule, the ServiceMonitor and every other monitoring object on, alerting
    left at its default: no webhook, and the rules exactly as rules.yaml has them."""
    manifests = render(helm, [CHART / "ci" / "monitoring-values.yaml"])
    assert alerting_traces(manifests) == []
    assert one(manifests, "PrometheusRule")["spec"] == {
        "groups": yaml.safe_load(RULES.read_text())["groups"]
    }


# --- on: the token, the control plane, the AlertmanagerConfig ---------------------------------


def test_every_object_validates(alerting_on: list[Manifest]) -> None:
    """Core kinds by kubernetes-validate, the AlertmanagerConfig by the CRD's openAPIV3Schema."""
    assert named(alerting_on, "AlertmanagerConfig")
    for manifest in alerting_on:
        validate(manifest)


def test_the_token_is_generated_mounted_and_read_as_a_file(
    alerting_on: list[Manifest], tmp_path: Path
) -> None:
    secret = one(alerting_on, "Secret", TOKEN_SECRET)
    assert set(secret["data"]) == {TOKEN_KEY}
    token = base64.b64decode(secret["data"][TOKEN_KEY]).decode()
    api_token = base64.b64decode(one(alerting_on, "Secret", "kpo-api-token")["data"]["token"])
    assert len(token) >= 32 and token != api_token.decode()

    container = control_plane_container(alerting_on)
    env = env_of(container)
    pod = one(alerting_on, "Deployment", CONTROL_PLANE)["spec"]["template"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    # The Secret's one key, read-only, at the path KPO_ALERT_TOKEN_FILE names.
    assert volumes["alert-token"]["secret"] == {
        "secretName": TOKEN_SECRET,
        "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}],
    }
    assert mounts["alert-token"]["readOnly"] is True
    path = env["KPO_ALERT_TOKEN_FILE"]["value"]
    assert path == f"{mounts['alert-token']['mountPath']}/{TOKEN_KEY}"
    assert "KPO_ALERT_TOKEN" not in env  # a file, as the API token, never a variable
    config = one(alerting_on, "ConfigMap", CONTROL_PLANE)["data"]
    assert config["KPO_ALERT_DEFAULT_ACTION"] == "warn"
    # `kpo serve`'s settings read the token as the pod would find it, and the default action.
    token_file = tmp_path / TOKEN_KEY
    token_file.write_text(token)
    settings = ApiSettings.model_validate({**config, "KPO_ALERT_TOKEN_FILE": str(token_file)})
    assert settings.alert_token() == token
    assert settings.alert_default_action == "warn"
    # The pods roll when the token changes.
    digest = hashlib.sha256(
        f"{TOKEN_SECRET}/{TOKEN_KEY}:{secret['data'][TOKEN_KEY]}".encode()
    ).hexdigest()
    assert pod["metadata"]["annotations"]["checksum/secret-alert-token"] == digest


@pytest.mark.parametrize("action", ALERT_ACTIONS)
def test_default_action_reaches_the_settings(helm: str, action: str) -> None:
    manifests = render(helm, sets=[*ON, f"alerting.defaultAction={action}"], secrets="generated")
    config = one(manifests, "ConfigMap", CONTROL_PLANE)["data"]
    assert config["KPO_ALERT_DEFAULT_ACTION"] == action
    assert ApiSettings.model_validate(config).alert_default_action == action


def test_alertmanager_config_posts_to_the_api_service_with_the_token(
    alerting_on: list[Manifest],
) -> None:
    config = one(alerting_on, "AlertmanagerConfig", ALERTMANAGER_CONFIG)
    assert config["apiVersion"] == "monitoring.coreos.com/v1alpha1"
    spec = config["spec"]
    (receiver,) = spec["receivers"]
    assert set(receiver) == {"name", "webhookConfigs"}
    (webhook,) = receiver["webhookConfigs"]
    # The URL: the API's Service, in the release's namespace, on its API port, /v1/alerts.
    service = one(alerting_on, "Service", CONTROL_PLANE)
    ports = {port["name"]: port for port in service["spec"]["ports"]}
    url = urlsplit(webhook["url"])
    assert url.scheme == "http" and url.hostname == f"{CONTROL_PLANE}.{NAMESPACE}.svc"
    assert url.port == ports["http"]["port"] and url.path == "/v1/alerts"
    # ... whose target is the container port `kpo serve` listens on.
    container = control_plane_container(alerting_on)
    target = next(p for p in container["ports"] if p["name"] == ports["http"]["targetPort"])
    assert str(target["containerPort"]) in container["command"]
    # The bearer token, from the Secret the control plane reads.
    assert webhook["httpConfig"] == {
        "authorization": {
            "type": "Bearer",
            "credentials": {"name": TOKEN_SECRET, "key": TOKEN_KEY},
        }
    }
    assert TOKEN_KEY in one(alerting_on, "Secret", TOKEN_SECRET)["data"]
    assert webhook["sendResolved"] is True and webhook["maxAlerts"] == 0


def test_alertmanager_config_routes_exactly_the_alerts_about_a_run(
    alerting_on: list[Manifest],
) -> None:
    """The route, as the operator checks it (a root route names a receiver of the same object,
    groupBy without duplicates) and as Alertmanager evaluates it: each of the chart's alerts
    about a run, with the labels the PrometheusRule gives it, matches; the alerts that name no
    run, and another namespace's alerts, do not."""
    spec = one(alerting_on, "AlertmanagerConfig", ALERTMANAGER_CONFIG)["spec"]
    route = spec["route"]
    assert route["receiver"] in {receiver["name"] for receiver in spec["receivers"]}
    assert route["groupBy"] == ["alertname", RUN_LABEL]
    assert (route["groupWait"], route["groupInterval"], route["repeatInterval"]) == (
        "30s",
        "5m",
        "4h",
    )
    assert "routes" not in route
    alerts = rendered_alerts(alerting_on)
    for name, rule in alerts.items():
        labels = {"alertname": name, **rule["labels"]}
        # The operator adds `namespace=<the AlertmanagerConfig's>` to the route: the chart's
        # alerts carry it, since their expressions aggregate the scraped one away.
        assert labels["namespace"] == NAMESPACE, name
        # As it fires: an alert about a run keeps `run_id` from its series, the others have none.
        if name in run_alerts():
            labels[RUN_LABEL] = "20250101-abcdef"
        assert matches(route["matchers"], labels) == (name in run_alerts()), name
        assert not matches(route["matchers"], {**labels, "namespace": "other"}), name
        assert not matches(route["matchers"], {**labels, "alertname": "Watchdog"}), name
    assert set(run_alerts()) <= set(alerts)


def test_alertmanager_config_values(helm: str) -> None:
    manifests = render(
        helm,
        sets=[
            *ON,
            "alerting.alertmanagerConfig.labels.release=kube-prometheus-stack",
            "alerting.alertmanagerConfig.groupWait=10s",
            "alerting.alertmanagerConfig.groupInterval=1m",
            "alerting.alertmanagerConfig.repeatInterval=1h30m",
        ],
        secrets="generated",
    )
    config = one(manifests, "AlertmanagerConfig", ALERTMANAGER_CONFIG)
    validate(config)
    assert config["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    route = config["spec"]["route"]
    assert (route["groupWait"], route["groupInterval"], route["repeatInterval"]) == (
        "10s",
        "1m",
        "1h30m",
    )
    # Without the Prometheus Operator: the webhook, its token and its rule, no AlertmanagerConfig.
    plain = render(
        helm, sets=[*ON, "alerting.alertmanagerConfig.enabled=false"], secrets="generated"
    )
    assert not named(plain, "AlertmanagerConfig")
    assert one(plain, "Secret", TOKEN_SECRET)
    assert "KPO_ALERT_TOKEN_FILE" in env_of(control_plane_container(plain))


def test_existing_secret_is_used_and_none_created(helm: str) -> None:
    """`alerting.token.existingSecret`: the control plane and Alertmanager read that Secret's
    key, and the chart creates no Secret (with every other secret existing too, none at all)."""
    sets = [*ON, "alerting.token.existingSecret=kpo-alerts", "alerting.token.secretKey=webhook"]
    manifests = render(helm, sets=sets)
    assert not named(manifests, "Secret")
    for manifest in manifests:
        validate(manifest)
    pod = one(manifests, "Deployment", CONTROL_PLANE)["spec"]["template"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["alert-token"]["secret"] == {
        "secretName": "kpo-alerts",
        "items": [{"key": "webhook", "path": "webhook"}],
    }
    env = env_of(control_plane_container(manifests))
    assert env["KPO_ALERT_TOKEN_FILE"]["value"].endswith("/webhook")
    config = one(manifests, "AlertmanagerConfig", ALERTMANAGER_CONFIG)
    (webhook,) = config["spec"]["receivers"][0]["webhookConfigs"]
    assert webhook["httpConfig"]["authorization"]["credentials"] == {
        "name": "kpo-alerts",
        "key": "webhook",
    }
    # An existing Secret's checksum follows its name and key.
    assert pod["metadata"]["annotations"]["checksum/secret-alert-token"] == (
        hashlib.sha256(b"kpo-alerts/webhook").hexdigest()
    )
    # Two renders without the cluster are the same release.
    assert helm_template(helm, sets=sets).stdout == helm_template(helm, sets=sets).stdout


def test_require_existing_asks_for_the_alert_token(helm: str) -> None:
    """secrets.requireExisting (the default): the webhook's token is one more existing Secret to
    name, and the one command the message gives creates its key too."""
    result = helm_template(helm, sets=ON)
    assert result.returncode != 0
    assert "secrets.requireExisting is true, so set alerting.token.existingSecret:" in (
        result.stderr
    ), result.stderr
    keys = re.findall(r'--from-literal=([\w-]+)=\\?"\$\(openssl rand -hex 32\)', result.stderr)
    assert sorted(keys) == sorted(
        ["token", "redis-password", "auth_token", "sandbox-token", TOKEN_KEY]
    )


@pytest.mark.parametrize(
    ("secret", "key", "named_as"),
    [
        ("kpo-secrets", "token", "the API token"),
        ("kpo-secrets", "redis-password", "the Redis password"),
        ("kpo-secrets", "auth_token", "the Ray token"),
    ],
)
def test_the_alert_token_is_its_own(helm: str, secret: str, key: str, named_as: str) -> None:
    result = helm_template(
        helm,
        sets=[*ON, f"alerting.token.existingSecret={secret}", f"alerting.token.secretKey={key}"],
    )
    assert result.returncode != 0
    assert f"alerting.token names {named_as} (Secret {secret}, key {key})" in result.stderr, (
        result.stderr
    )
    # The same Secret with a key of its own is fine.
    same_secret = [*ON, "alerting.token.existingSecret=kpo-secrets"]
    assert helm_template(helm, sets=same_secret).returncode == 0


# --- the NetworkPolicy ---------------------------------------------------------------------------


def test_network_policy_admits_alertmanager_to_the_api_port(
    alerting_on: list[Manifest], helm: str, tmp_path: Path
) -> None:
    policies = named(alerting_on, "NetworkPolicy")
    control_plane = release_pods(alerting_on)[f"Deployment/{CONTROL_PLANE}"]
    api, metrics = control_plane.ports["http"], control_plane.ports["metrics"]

    def opens(source: Pod, port: int, among: list[Manifest] = policies) -> bool:
        return admitted(among, source, control_plane, port, NAMESPACE)

    assert opens(ALERTMANAGER, api) and not opens(ALERTMANAGER, metrics)
    assert opens(PROMETHEUS, metrics) and not opens(PROMETHEUS, api)  # unchanged
    for outsider in OUTSIDERS:
        assert not opens(outsider, api), outsider.name
    # Alertmanager's labels in another namespace are not enough.
    impostor = Pod.of("alertmanager-0", "elsewhere", dict(ALERTMANAGER.labels))
    assert not opens(impostor, api)
    # Off, Alertmanager is not admitted.
    off = named(render(helm, sets=["monitoring.prometheusRule.enabled=true"]), "NetworkPolicy")
    assert not opens(ALERTMANAGER, api, off)

    # The selectors follow their values (null removes a default: Helm merges maps); both null
    # admit no one.
    values = tmp_path / "alertmanager-values.yaml"
    selector = {"kubernetes.io/metadata.name": None, "team": "observability"}
    values.write_text(
        yaml.safe_dump(
            {
                "alerting": {
                    "alertmanager": {
                        "namespaceSelector": {"matchLabels": selector},
                        "podSelector": None,
                    }
                }
            }
        )
    )
    custom = render(helm, [values], sets=ON, secrets="generated")
    ours = Pod(
        "am-0",
        "obs",
        {"app": "am"},
        {"kubernetes.io/metadata.name": "obs", "team": "observability"},
    )
    assert admitted(named(custom, "NetworkPolicy"), ours, control_plane, api, NAMESPACE)
    assert not admitted(named(custom, "NetworkPolicy"), ALERTMANAGER, control_plane, api, NAMESPACE)
    nobody = render(
        helm,
        sets=[
            *ON,
            "alerting.alertmanager.namespaceSelector=null",
            "alerting.alertmanager.podSelector=null",
        ],
        secrets="generated",
    )
    cp_policy = one(named(nobody, "NetworkPolicy"), "NetworkPolicy", CONTROL_PLANE)
    assert len(cp_policy["spec"]["ingress"]) == len(
        one(off, "NetworkPolicy", CONTROL_PLANE)["spec"]["ingress"]
    )
    assert not named(
        render(helm, sets=[*ON, "networkPolicy.enabled=false"], secrets="generated"),
        "NetworkPolicy",
    )


# --- ruleActions ---------------------------------------------------------------------------------


def test_rule_actions_label_exactly_those_rules(helm: str, promtool: str, tmp_path: Path) -> None:
    actions = {"KPONoLearnerProgress": "pause", "KPORewardDrop": "checkpoint"}
    manifests = render(
        helm,
        sets=[*ON, *(f"alerting.ruleActions.{name}={action}" for name, action in actions.items())],
        secrets="generated",
    )
    rule = one(manifests, "PrometheusRule")
    validate(rule)
    # Every rule as rules.yaml has it, but for the alerts' `namespace` and `kpo_action` labels.
    source = yaml.safe_load(RULES.read_text())["groups"]
    rendered_groups = rule["spec"]["groups"]
    assert [g["name"] for g in rendered_groups] == [g["name"] for g in source]
    for group, original in zip(rendered_groups, source, strict=True):
        for got, want in zip(group["rules"], original["rules"], strict=True):
            if "alert" not in want:
                assert got == want
                continue
            labels = dict(want.get("labels", {}), namespace=NAMESPACE)
            if want["alert"] in actions:
                labels[ACTION_LABEL] = actions[want["alert"]]
            assert got == {**want, "labels": labels}, want["alert"]
    # The control plane reads each label as the action it names; the others do the default.
    for name, alert in rendered_alerts(manifests).items():
        fired = Alert(status="firing", labels={"alertname": name, **alert["labels"]})
        assert requested_action(fired, "warn") == actions.get(name, "warn"), name
    rendered_rules = tmp_path / "rules.yaml"
    rendered_rules.write_text(yaml.safe_dump(rule["spec"]))
    result = subprocess.run(
        [promtool, "check", "rules", str(rendered_rules)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_knows_the_alerts_about_a_run_and_the_actions() -> None:
    """values.schema.json's alert names are rules.yaml's alerts about a run, and its actions the
    control plane's."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    alerting = schema["properties"]["alerting"]
    assert set(alerting["properties"]["ruleActions"]["properties"]) == set(run_alerts())
    assert alerting["properties"]["ruleActions"]["additionalProperties"] is False
    assert schema["definitions"]["alertAction"]["enum"] == list(ALERT_ACTIONS)
    assert set(run_alerts()) == {
        "KPOEntropyCollapse",
        "KPOClipFractionSpike",
        "KPORewardDrop",
        "KPONoLearnerProgress",
    }


@pytest.mark.parametrize(
    ("assignment", "schema_says", "chart_says"),
    [
        (
            "alerting.ruleActions.KPOTypo=pause",
            "Additional property KPOTypo is not allowed",
            'alerting.ruleActions: unknown alert "KPOTypo"; the alerts about one run are '
            "KPOEntropyCollapse, KPOClipFractionSpike, KPORewardDrop, KPONoLearnerProgress",
        ),
        (
            "alerting.ruleActions.KPOControlPlaneDown=cancel",  # names no run
            "Additional property KPOControlPlaneDown is not allowed",
            'alerting.ruleActions: unknown alert "KPOControlPlaneDown"',
        ),
        (
            "alerting.ruleActions.KPORewardDrop=stop",
            "alerting.ruleActions.KPORewardDrop must be one of the following",
            'alerting.ruleActions.KPORewardDrop: unknown action "stop"; valid: warn, '
            "checkpoint, pause, cancel",
        ),
        (
            "alerting.defaultAction=stop",
            "alerting.defaultAction must be one of the following",
            'alerting.defaultAction: unknown action "stop"; valid: warn, checkpoint, pause, cancel',
        ),
    ],
)
def test_unknown_alert_or_action_fails_the_render(
    helm: str, assignment: str, schema_says: str, chart_says: str
) -> None:
    """The schema refuses them first, naming the value; the chart's own check (for a schema
    skipped, `--skip-schema-validation`) fails with the known names."""
    sets = [*ON, "alerting.token.existingSecret=kpo-alerts", assignment]
    result = helm_template(helm, sets=sets)
    assert result.returncode != 0 and schema_says in result.stderr, result.stderr
    unchecked = helm_template(helm, sets=sets, flags=["--skip-schema-validation"])
    assert unchecked.returncode != 0 and chart_says in unchecked.stderr, unchecked.stderr


@pytest.mark.parametrize(
    "assignment",
    [
        "alerting.alertmanagerConfig.groupWait=30 s",
        "alerting.alertmanagerConfig.repeatInterval=30s4h",  # the CRD wants units largest first
        "alerting.alertmanagerConfig.groupInterval=",
        "alerting.token.secretKey=",
        "alerting.typo=true",
        "alerting.alertmanagerConfig.typo=true",
    ],
)
def test_schema_refuses_bad_values(helm: str, assignment: str) -> None:
    result = helm_template(helm, sets=[*ON, "alerting.token.existingSecret=a", assignment])
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr


def test_rule_actions_need_the_webhook_and_the_rules(helm: str) -> None:
    action = "alerting.ruleActions.KPONoLearnerProgress=pause"
    off = helm_template(helm, sets=["monitoring.prometheusRule.enabled=true", action])
    assert off.returncode != 0
    assert "alerting.ruleActions: the actions are for the webhook of alerting.enabled=true" in (
        off.stderr
    ), off.stderr
    no_rules = helm_template(
        helm, sets=["alerting.enabled=true", "alerting.token.existingSecret=a", action]
    )
    assert no_rules.returncode != 0
    assert "monitoring.prometheusRule.enabled=false leaves out" in no_rules.stderr, no_rules.stderr


# --- docs/deploy.md ------------------------------------------------------------------------------


def docs_section() -> str:
    text = DOCS.read_text(encoding="utf-8")
    start = text.index("\n## Alerts that act\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def yaml_blocks(text: str) -> list[Any]:
    return [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", text, re.S)]


def test_docs_values_render_and_the_webhook_snippet_matches_the_chart(
    helm: str, tmp_path: Path
) -> None:
    section = docs_section()
    for action in ALERT_ACTIONS:
        assert f"`{action}`" in section
    assert "POST /v1/runs/{id}/resume" in section and "Only\nfiring alerts act" in section
    values, webhook = yaml_blocks(section)
    # The values the section gives render (with the install's existing Secrets, and the one its
    # command creates), every object valid.
    values_file = tmp_path / "alerting-values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    manifests = render(helm, [values_file])
    for manifest in manifests:
        validate(manifest)
    assert rendered_alerts(manifests)["KPONoLearnerProgress"]["labels"][ACTION_LABEL] == "pause"
    secret = values["alerting"]["token"]["existingSecret"]
    assert f"create secret generic {secret} --from-literal={TOKEN_KEY}=" in section
    config = one(manifests, "AlertmanagerConfig", ALERTMANAGER_CONFIG)
    (chart_webhook,) = config["spec"]["receivers"][0]["webhookConfigs"]
    assert chart_webhook["url"] in section
    # The snippet for an Alertmanager without the operator: the same URL and route, the token
    # from a file named by the same Secret and key.
    (receiver,) = webhook["receivers"]
    (snippet,) = receiver["webhook_configs"]
    assert snippet["url"] == chart_webhook["url"]
    assert snippet["send_resolved"] is True and snippet["max_alerts"] == 0
    authorization = snippet["http_config"]["authorization"]
    assert authorization["type"] == "Bearer"
    assert authorization["credentials_file"].endswith(f"/{secret}/{TOKEN_KEY}")
    (route,) = webhook["route"]["routes"]
    assert route["receiver"] == receiver["name"] and route["group_by"] == ["alertname", RUN_LABEL]
    assert route["continue"] is True
    chart_matchers = {
        (m["name"], m["matchType"], m["value"]) for m in config["spec"]["route"]["matchers"]
    }
    snippet_matchers = {
        re.fullmatch(r'(\w+)(=~|!~|!=|=)"(.*)"', matcher).groups()  # type: ignore[union-attr]
        for matcher in route["matchers"]
    }
    # The rules loaded by hand carry no namespace label: the snippet leaves that matcher out.
    assert snippet_matchers == {m for m in chart_matchers if m[0] != "namespace"}
