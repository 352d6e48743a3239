"""The Helm chart helm/kpo, checked offline with a real helm binary.

For every ci/*.yaml: `helm lint --strict` and `helm template`, and every rendered object
validated (tests/deploy/manifests.py: core kinds by kubernetes-validate --strict, KubeRay and
Prometheus Operator kinds by the project's schemas, Ray pod templates as core PodTemplates).
Then what the objects must mean: probes, secrets, the addresses the control plane is given,
selectors that select, references that resolve, and values the schema or the chart refuse.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from services.api.launcher import job_server_url
from services.api.settings import ApiSettings
from tests.deploy.manifests import (
    CHART,
    CI_VALUES,
    NAMESPACE,
    REPO,
    Manifest,
    containers,
    env_of,
    helm_template,
    named,
    one,
    pod_templates,
    validate,
)

CI_NAMES = [path.name for path in CI_VALUES]
CONTROL_PLANE = "kpo-control-plane"
RAY_CLUSTER = "kpo-ray"
POD_OWNERS = ("Deployment", "StatefulSet", "Pod")


def pod_specs(manifests: list[Manifest]) -> Iterator[tuple[str, Manifest, Manifest]]:
    """(where, pod metadata, pod spec) of every pod the objects would create."""
    for m in manifests:
        where = f"{m['kind']}/{m['metadata']['name']}"
        if m["kind"] in ("Deployment", "StatefulSet"):
            yield where, m["spec"]["template"]["metadata"], m["spec"]["template"]["spec"]
        elif m["kind"] == "Pod":
            yield where, m["metadata"], m["spec"]
        for path, template in pod_templates(m):
            yield f"{where} {path}", template.get("metadata", {}), template["spec"]


def control_plane_container(manifests: list[Manifest]) -> Manifest:
    deployment = one(manifests, "Deployment", CONTROL_PLANE)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


# --- lint, render, validate --------------------------------------------------------------------


def test_ci_values_cover_the_main_combinations() -> None:
    assert {
        "default-values.yaml",
        "external-redis-values.yaml",
        "monitoring-values.yaml",
        "gpu-sizes-values.yaml",
        "external-ray-values.yaml",
    } <= set(CI_NAMES)


@pytest.mark.parametrize("values", CI_NAMES)
def test_helm_lint_strict(helm: str, values: str) -> None:
    result = subprocess.run(
        [helm, "lint", "--strict", str(CHART), "--values", str(CHART / "ci" / values)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", CI_NAMES)
def test_every_rendered_object_validates(rendered: dict[str, list[Manifest]], values: str) -> None:
    manifests = rendered[values]
    assert manifests
    for manifest in manifests:
        validate(manifest)


def test_validation_fails_on_unknown_fields_and_unknown_kinds() -> None:
    """The validator itself can fail: an unknown field, a bad Ray field, an unknown kind."""
    rayjob = next(
        d
        for d in yaml.safe_load_all((REPO / "deploy" / "kuberay" / "rayjob.yaml").read_text())
        if d["kind"] == "RayJob"
    )
    validate(rayjob)
    bad_param = json.loads(json.dumps(rayjob))  # KubeRay wants strings
    bad_param["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0
    bad_pod = json.loads(json.dumps(rayjob))  # a typo inside a pod template
    worker = bad_pod["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    worker["template"]["spec"]["containers"][0]["resource"] = {}
    cases: list[Manifest] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "dta": {}},
        {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "x"}},
        bad_param,
        bad_pod,
    ]
    for case in cases:
        with pytest.raises(AssertionError):
            validate(case)


# --- what the objects mean ---------------------------------------------------------------------


def test_default_release_has_the_expected_objects(rendered: dict[str, list[Manifest]]) -> None:
    kinds = sorted(m["kind"] for m in rendered["default-values.yaml"])
    assert kinds == sorted(
        [
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "Secret",
            "Secret",
            "ConfigMap",
            "ConfigMap",
            "Service",
            "Service",
            "Deployment",
            "StatefulSet",
            "RayCluster",
            "Pod",
            "Pod",
        ]
    )
    tests = [m for m in rendered["default-values.yaml"] if m["kind"] == "Pod"]
    assert all(m["metadata"]["annotations"]["helm.sh/hook"] == "test" for m in tests)


def test_every_resource_has_the_recommended_labels(rendered: dict[str, list[Manifest]]) -> None:
    for manifests in rendered.values():
        for m in manifests:
            labels = m["metadata"]["labels"]
            for key in (
                "app.kubernetes.io/name",
                "app.kubernetes.io/instance",
                "app.kubernetes.io/component",
                "app.kubernetes.io/managed-by",
                "helm.sh/chart",
            ):
                assert key in labels, f"{m['kind']}/{m['metadata']['name']} lacks {key}"


@pytest.mark.parametrize("values", CI_NAMES)
def test_control_plane_probes_security_and_settings(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    manifests = rendered[values]
    container = control_plane_container(manifests)
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    pod = one(manifests, "Deployment", CONTROL_PLANE)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    # Every variable the control plane gets is one `kpo serve` reads.
    config = one(manifests, "ConfigMap", CONTROL_PLANE)["data"]
    names = set(config) | set(env_of(container))
    known = {f.validation_alias for f in ApiSettings.model_fields.values()} | {"KPO_REDIS_PASSWORD"}
    assert names <= known, names - known
    # The settings load and give a real token source.
    settings = ApiSettings.model_validate(
        {**config, "KPO_API_TOKEN_FILE": env_of(container)["KPO_API_TOKEN_FILE"]["value"]}
    )
    assert settings.api_token_file is not None and str(settings.data_dir) == "/data/kpo"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-token")
    assert str(settings.api_token_file).startswith(mount["mountPath"])


def test_secrets_never_appear_in_plain_text(rendered: dict[str, list[Manifest]]) -> None:
    """Secret values live in Secrets only; containers get them through secretKeyRef."""
    for manifests in rendered.values():
        secrets = {
            base64.b64decode(value).decode()
            for secret in named(manifests, "Secret")
            for value in secret["data"].values()
        }
        others = yaml.safe_dump([m for m in manifests if m["kind"] != "Secret"])
        assert not any(secret in others for secret in secrets)
        for where, _, spec in pod_specs(manifests):
            for container in containers(spec):
                for name, entry in env_of(container).items():
                    if re.search(r"PASSWORD|TOKEN|AUTH", name) and not name.endswith("_FILE"):
                        assert "valueFrom" in entry, f"{where}: {name} is not from a Secret"


def test_store_url_takes_the_password_from_the_secret(rendered: dict[str, list[Manifest]]) -> None:
    env = env_of(control_plane_container(rendered["default-values.yaml"]))
    assert env["KPO_STORE_URL"]["value"] == "redis://:$(KPO_REDIS_PASSWORD)@kpo-redis:6379/0"
    # $(VAR) expands only for variables defined earlier in the list.
    names = list(env)
    assert names.index("KPO_REDIS_PASSWORD") < names.index("KPO_STORE_URL")
    secret = env["KPO_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert one(rendered["default-values.yaml"], "Secret", secret["name"])["data"][secret["key"]]

    external = env_of(control_plane_container(rendered["external-redis-values.yaml"]))
    assert external["KPO_STORE_URL"]["value"] == (
        "rediss://:$(KPO_REDIS_PASSWORD)@redis.example.internal:6380/2"
    )
    assert external["KPO_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "kpo-redis-credentials",
        "key": "password",
    }
    no_auth = env_of(control_plane_container(rendered["gpu-sizes-values.yaml"]))
    assert no_auth["KPO_STORE_URL"]["value"] == "redis://kpo-redis:6379/0"
    assert "KPO_REDIS_PASSWORD" not in no_auth


def test_builtin_redis_is_durable(rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered["default-values.yaml"]
    conf = one(manifests, "ConfigMap", "kpo-redis")["data"]["redis.conf"].splitlines()
    for line in (
        "appendonly yes",
        "appendfsync everysec",
        "maxmemory-policy noeviction",
        "dir /data",
    ):
        assert line in conf
    statefulset = one(manifests, "StatefulSet", "kpo-redis")
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    assert claim["metadata"]["name"] == "data"
    assert container["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert not named(rendered["external-redis-values.yaml"], "StatefulSet")


def test_control_plane_submits_to_the_head_service(rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered["default-values.yaml"]
    address = one(manifests, "ConfigMap", CONTROL_PLANE)["data"]["RAY_ADDRESS"]
    cluster = one(manifests, "RayCluster", RAY_CLUSTER)
    # KubeRay names the head's Service `<cluster>-head-svc`; its dashboard port is the job server.
    assert address == f"http://{RAY_CLUSTER}-head-svc.{NAMESPACE}.svc:8265"
    assert job_server_url(address) == address  # the launcher takes it as it is
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "dashboard", "containerPort": 8265} in head["ports"]
    external = rendered["external-ray-values.yaml"]
    assert not named(external, "RayCluster")
    assert one(external, "ConfigMap", CONTROL_PLANE)["data"]["RAY_ADDRESS"] == (
        "http://shared-ray-head-svc.ray-system.svc:8265"
    )


def test_ray_cluster_head_and_gpu_worker_groups(rendered: dict[str, list[Manifest]]) -> None:
    spec = one(rendered["default-values.yaml"], "RayCluster", RAY_CLUSTER)["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    # The autoscaler sidecar in the head needs its ServiceAccount token; no other Ray pod does.
    head_pod = spec["headGroupSpec"]["template"]["spec"]
    assert head_pod.get("automountServiceAccountToken", True) is True
    (group,) = spec["workerGroupSpecs"]
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    pod = group["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"] and pod["tolerations"]

    sized = one(rendered["gpu-sizes-values.yaml"], "RayCluster", RAY_CLUSTER)["spec"]
    assert sized["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in sized
    for where, template in pod_templates(one(rendered["gpu-sizes-values.yaml"], "RayCluster")):
        assert template["spec"]["automountServiceAccountToken"] is False, where
    groups = {g["groupName"]: g for g in sized["workerGroupSpecs"]}
    assert set(groups) == {"gen-1gpu", "learner-8gpu"}  # `gpu: null` removed the default group
    learner = groups["learner-8gpu"]["template"]["spec"]
    resources = learner["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 8
    assert resources["requests"]["cpu"] == "64"  # the group's own, merged over the defaults
    assert learner["nodeSelector"] == {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    }
    shm = next(v for v in learner["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}


def test_runs_volume_is_shared_by_every_ray_pod(rendered: dict[str, list[Manifest]]) -> None:
    for values, claim in (
        ("monitoring-values.yaml", "kpo-runs"),
        ("gpu-sizes-values.yaml", "kpo-runs"),
    ):
        manifests = rendered[values]
        cluster = one(manifests, "RayCluster", RAY_CLUSTER)
        for where, template in pod_templates(cluster):
            data = next(v for v in template["spec"]["volumes"] if v["name"] == "data")
            assert data == {"name": "data", "persistentVolumeClaim": {"claimName": claim}}, where
    pvc = one(rendered["monitoring-values.yaml"], "PersistentVolumeClaim", "kpo-runs")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert not named(rendered["gpu-sizes-values.yaml"], "PersistentVolumeClaim")  # existing claim


def test_services_select_pods(rendered: dict[str, list[Manifest]]) -> None:
    for manifests in rendered.values():
        pods = [(meta.get("labels", {}), spec) for _, meta, spec in pod_specs(manifests)]
        for service in named(manifests, "Service"):
            selector = service["spec"]["selector"]
            matching = [spec for labels, spec in pods if selector.items() <= labels.items()]
            assert matching, f"Service {service['metadata']['name']} selects no pod"
            ports = {
                p["name"]
                for spec in matching
                for c in spec["containers"]
                for p in c.get("ports", [])
            }
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in ports, (service["metadata"]["name"], port)
        for workload in (*named(manifests, "Deployment"), *named(manifests, "StatefulSet")):
            labels = workload["spec"]["template"]["metadata"]["labels"]
            assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()


def references(spec: Manifest) -> Iterator[tuple[str, str]]:
    """(kind, name) of every object a pod spec refers to."""
    if "serviceAccountName" in spec:
        yield "ServiceAccount", spec["serviceAccountName"]
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            yield "Secret", volume["secret"]["secretName"]
        if "configMap" in volume:
            yield "ConfigMap", volume["configMap"]["name"]
        if "persistentVolumeClaim" in volume:
            yield "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]
    for container in containers(spec):
        for source in container.get("envFrom", []):
            yield "ConfigMap", source["configMapRef"]["name"]
        for entry in container.get("env", []):
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                yield "Secret", ref["name"]


def test_references_resolve(rendered: dict[str, list[Manifest]]) -> None:
    """Every Secret, ConfigMap, claim and ServiceAccount a pod names is rendered, or is one the
    ci values name as existing (or `default`, which every namespace has)."""
    existing = {"kpo-api-token", "kpo-redis-credentials", "kpo-runs", "regcred", "default"}
    for values, manifests in rendered.items():
        have = {(m["kind"], m["metadata"]["name"]) for m in manifests}
        for where, _, spec in pod_specs(manifests):
            for kind, name in references(spec):
                assert (kind, name) in have or name in existing, f"{values}: {where}: {kind} {name}"


def test_rbac_is_read_only_and_bound_to_the_control_plane(
    rendered: dict[str, list[Manifest]],
) -> None:
    manifests = rendered["default-values.yaml"]
    role = one(manifests, "Role", CONTROL_PLANE)
    for rule in role["rules"]:
        assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
    binding = one(manifests, "RoleBinding", CONTROL_PLANE)
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    pod = one(manifests, "Deployment", CONTROL_PLANE)["spec"]["template"]["spec"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": NAMESPACE}
    ]
    assert not named(rendered["external-redis-values.yaml"], "Role")


def test_monitoring_objects(
    rendered: dict[str, list[Manifest]], promtool: str, tmp_path: Path
) -> None:
    manifests = rendered["monitoring-values.yaml"]
    monitor = one(manifests, "ServiceMonitor")
    service = one(manifests, "Service", CONTROL_PLANE)
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (
        endpoint["port"] == service["spec"]["ports"][0]["name"] and endpoint["path"] == "/metrics"
    )
    assert {"action": "replace", "targetLabel": "job", "replacement": "kpo-control-plane"} in (
        endpoint["relabelings"]
    )
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"

    pod_monitor = one(manifests, "PodMonitor")
    assert pod_monitor["spec"]["selector"]["matchLabels"] == {"ray.io/cluster": RAY_CLUSTER}
    cluster = one(manifests, "RayCluster", RAY_CLUSTER)
    for where, template in pod_templates(cluster):
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports.get("metrics") == 8080, where
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["metrics-export-port"] == "8080"

    # The PrometheusRule holds deploy/prometheus/rules.yaml unchanged, and promtool accepts it.
    rule = one(manifests, "PrometheusRule")
    source = yaml.safe_load((REPO / "deploy" / "prometheus" / "rules.yaml").read_text())
    assert rule["spec"] == {"groups": source["groups"]}
    rendered_rules = tmp_path / "rules.yaml"
    rendered_rules.write_text(yaml.safe_dump(rule["spec"]))
    result = subprocess.run(
        [promtool, "check", "rules", str(rendered_rules)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    # The dashboard ConfigMap holds deploy/grafana/kpo-stability.json unchanged.
    dashboard = one(manifests, "ConfigMap", "kpo-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["kpo-stability.json"]) == json.loads(
        (REPO / "deploy" / "grafana" / "kpo-stability.json").read_text()
    )
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert not named(rendered["default-values.yaml"], kind)  # off by default


def test_chart_tests_check_health_metrics_and_auth(rendered: dict[str, list[Manifest]]) -> None:
    pods = {m["metadata"]["name"]: m for m in named(rendered["default-values.yaml"], "Pod")}
    assert set(pods) == {"kpo-test-connection", "kpo-test-auth"}
    scripts = {name: pod["spec"]["containers"][0]["args"][0] for name, pod in pods.items()}
    for name, script in scripts.items():
        compile(script, name, "exec")  # the Python they run is valid
    assert (
        "/readyz" in scripts["kpo-test-connection"] and "/metrics" in scripts["kpo-test-connection"]
    )
    assert "== 401" in scripts["kpo-test-auth"]
    url = env_of(pods["kpo-test-connection"]["spec"]["containers"][0])["KPO_URL"]["value"]
    assert url == f"http://{CONTROL_PLANE}:8000"


# --- values the chart refuses ------------------------------------------------------------------

REFUSED = {
    "typo at the top": (["controlPlane.replica=2"], "Additional property replica is not allowed"),
    "typo in a worker group": (
        ["ray.workerGroups.gpu.gpu=2"],
        "Additional property gpu is not allowed",
    ),
    "wrong type": (["controlPlane.port=http"], "controlPlane.port: Invalid type"),
    "bad duration": (
        ["monitoring.serviceMonitor.interval=often"],
        "monitoring.serviceMonitor.interval: Does not match pattern",
    ),
    "credentials in the Redis URL": (
        ["redis.builtin.enabled=false", "redis.external.url=redis://:pw@host:6379/0"],
        "redis.external.url: Does not match pattern",
    ),
    "external Redis without a URL": (
        ["redis.builtin.enabled=false"],
        "redis.external.url: String length must be greater",
    ),
    "both Redis kinds": (
        ["redis.external.url=redis://host:6379/0"],
        "set either redis.builtin.enabled=true or redis.external.url, not both",
    ),
    "external Redis without its Secret": (
        ["redis.builtin.enabled=false", "redis.external.url=redis://host:6379/0"],
        "set redis.auth.existingSecret",
    ),
    "no Ray cluster and no address": (
        ["ray.cluster.enabled=false"],
        "ray.cluster.enabled is false, so set ray.address",
    ),
    "replicas outside the bounds": (
        ["ray.workerGroups.gpu.minReplicas=3"],
        "need minReplicas <= replicas <= maxReplicas (got 3, 1, 4)",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_values_fail_with_a_message(helm: str, case: str) -> None:
    sets, expected = REFUSED[case]
    result = helm_template(helm, sets=sets)
    assert result.returncode != 0, f"{case}: accepted"
    assert expected in result.stderr, result.stderr


def test_values_table_is_generated_and_every_value_documented() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "helm_values_table.py"), str(CHART), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_schema_is_strict_everywhere() -> None:
    """Every object in values.schema.json that lists properties forbids the others."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: object, path: str) -> Iterator[str]:
        if isinstance(node, dict):
            if "properties" in node and node.get("additionalProperties") is not False:
                yield path
            for key, child in node.items():
                if key not in ("if", "then"):  # conditions, not object definitions
                    yield from walk(child, f"{path}/{key}")
        elif isinstance(node, list):
            for i, child in enumerate(node):
                yield from walk(child, f"{path}/{i}")

    assert list(walk(schema, "#")) == []
