"""The Helm chart helm/kpo, checked offline with a real helm binary.

For every ci/*.yaml: `helm lint --strict` and `helm template`, and every rendered object
validated (tests/deploy/manifests.py: core kinds by kubernetes-validate --strict, KubeRay and
Prometheus Operator kinds by the project's schemas, Ray pod templates as core PodTemplates).
Then what the objects must mean: probes, secrets, the addresses the control plane is given,
selectors that select, references that resolve, every container non-root, read-only and
unprivileged with a volume wherever it writes, the NetworkPolicies (evaluated offline by
tests/deploy/network_policy.py, ingress and egress) letting through exactly the connections the
release makes, and values the schema or the chart refuse. The security defaults (Ray's token on
every Ray pod, secrets never on a command line nor in a job's environment, GitOps secrets,
checksums, RBAC off, egress, image digests, durable Redis, guarded reads, a metrics port of its
own) are in tests/deploy/test_helm_security.py.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from services.api.settings import ApiSettings
from services.jobs.launcher import job_server_url
from services.jobs.settings import JobSettings
from tests.deploy.manifests import (
    CHART,
    CI_VALUES,
    EXISTING_SECRETS,
    NAMESPACE,
    REPO,
    Manifest,
    autoscaler_pod,
    containers,
    env_of,
    helm_template,
    models_mount_path,
    named,
    one,
    pod_templates,
    render,
    validate,
)
from tests.deploy.network_policy import (
    Address,
    Pod,
    admitted,
    connects,
    in_ip_block,
    isolating,
)
from tests.deploy.ray_resources import HEAD_GROUP, custom, node_types, ray_start_resources

CI_NAMES = [path.name for path in CI_VALUES]
CONTROL_PLANE = "kpo-control-plane"
RAY_CLUSTER = "kpo-ray"
POD_OWNERS = ("Deployment", "StatefulSet", "Pod")
# Variables the chart gives the control plane besides the fields of ApiSettings and
# JobSettings: KPO_REDIS_PASSWORD, and the contract with the services' side, whether or not
# their settings have the field yet (KPO_OPENAPI_DOCS: /docs on or off; KPO_METRICS_PORT:
# /metrics on a port of its own; KPO_MAX_ACTIVE_RUNS: the cap on active runs;
# KPO_PASS_STORE_URL_TO_JOBS=false: the Ray pods have KPO_STORE_URL, so the launcher leaves it
# out of the jobs' runtime environments; KPO_RAY_DRIVER_RESOURCE: the head's Ray resource each
# run's job reserves, `entrypoint_resources={"kpo_driver": 1}`).
CONTROL_PLANE_VARIABLES = {
    "KPO_REDIS_PASSWORD",  # only for $(KPO_REDIS_PASSWORD) in KPO_STORE_URL
    "KPO_OPENAPI_DOCS",
    "KPO_METRICS_PORT",
    "KPO_MAX_ACTIVE_RUNS",
    "KPO_PASS_STORE_URL_TO_JOBS",
    "KPO_RAY_DRIVER_RESOURCE",
}


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
        "placement-values.yaml",
        "models-values.yaml",
    } <= set(CI_NAMES)


@pytest.mark.parametrize("values", CI_NAMES)
def test_helm_lint_strict(helm: str, values: str) -> None:
    result = subprocess.run(
        [
            *(helm, "lint", "--strict", str(CHART)),
            *("--values", str(EXISTING_SECRETS), "--values", str(CHART / "ci" / values)),
        ],
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
    # No Role nor RoleBinding (rbac.create is off); three Secrets (API token, Redis password, Ray
    # token); a NetworkPolicy each for the control plane, Redis, the Ray pods, the Ray head's
    # Kubernetes API access (its autoscaler) and the `helm test` pods.
    assert kinds == sorted(
        [
            "ServiceAccount",
            "Secret",
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
            "NetworkPolicy",
            "NetworkPolicy",
            "NetworkPolicy",
            "NetworkPolicy",
            "NetworkPolicy",
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
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "probes"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "probes"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    pod = one(manifests, "Deployment", CONTROL_PLANE)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    # Every variable the control plane gets is one `kpo serve` reads.
    config = one(manifests, "ConfigMap", CONTROL_PLANE)["data"]
    names = set(config) | set(env_of(container))
    known = {
        str(f.validation_alias)
        for settings in (ApiSettings, JobSettings)
        for f in settings.model_fields.values()
    } | CONTROL_PLANE_VARIABLES
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
                    if name in ("RAY_AUTH_MODE", "KPO_AUTH_READS"):
                        continue  # switches, not secrets
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
        "appendfsync always",
        "maxmemory-policy noeviction",
        "dir /data",
        "include /run/redis-auth/auth.conf",
    ):
        assert line in conf
    statefulset = one(manifests, "StatefulSet", "kpo-redis")
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    assert claim["metadata"]["name"] == "data"
    assert container["args"] == ["/etc/redis/redis.conf"]  # the password comes from a file
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


GIB = 2**30


def test_worker_groups_advertise_their_ray_resources(rendered: dict[str, list[Manifest]]) -> None:
    """ci/placement-values.yaml: the learner group's pods advertise `learner_gpu` (its amount
    left empty: the group's 8 GPUs), the generation group's `generation_gpu: 1`, each as the
    `resources` rayStartParam in the form KubeRay writes. Ray's autoscaler sees the same amounts
    (so it grows the group a waiting actor asks for), and nothing else advertises them."""
    cluster = one(rendered["placement-values.yaml"], "RayCluster", RAY_CLUSTER)
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"learner", "generation"}
    # The object store: 75% (ray.objectStoreShmPercent) of each group's /dev/shm, 64Gi and 8Gi.
    assert groups["learner"]["rayStartParams"] == {
        "metrics-export-port": "8080",
        "object-store-memory": str(48 * GIB),
        "resources": """'{"learner_gpu":8}'""",
    }
    assert groups["generation"]["rayStartParams"] == {
        "metrics-export-port": "8080",
        "object-store-memory": str(6 * GIB),
        "resources": """'{"generation_gpu":1}'""",
    }
    learner = groups["learner"]["template"]["spec"]["containers"][0]["resources"]
    assert learner["limits"]["nvidia.com/gpu"] == 8

    types = node_types(cluster)
    # CPU from the requests, memory (bytes) from the limits, GPU from nvidia.com/gpu.
    assert types["learner"]["resources"] == {
        "CPU": 64,
        "GPU": 8,
        "memory": 512 * GIB,
        "learner_gpu": 8,
    }
    assert types["generation"]["resources"] == {
        "CPU": 6,
        "GPU": 1,
        "memory": 24 * GIB,
        "generation_gpu": 1,
    }
    assert (types["learner"]["min_workers"], types["learner"]["max_workers"]) == (0, 2)
    # The head advertises only its driver slots (ray.head.driverSlots), no role's resource.
    assert custom(types[HEAD_GROUP]["resources"]) == {"kpo_driver": 8}
    head = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert ray_start_resources(head) == {"kpo_driver": 8}


@pytest.mark.parametrize("values", CI_NAMES)
def test_ray_reads_the_resources_of_every_group(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    """Ray's autoscaler reads every rendered RayCluster (it raises on a `resources` string it
    cannot parse), and each pod's `ray start` gets the custom resources the autoscaler counts
    on; groups without rayResources have no `resources` parameter."""
    for cluster in named(rendered[values], "RayCluster"):
        types = node_types(cluster)
        groups = cluster["spec"]["workerGroupSpecs"]
        assert set(types) == {HEAD_GROUP, *(g["groupName"] for g in groups)}
        head = cluster["spec"]["headGroupSpec"]["rayStartParams"]
        assert ray_start_resources(head) == custom(types[HEAD_GROUP]["resources"])
        for group in groups:
            resources = types[group["groupName"]]["resources"]
            assert ray_start_resources(group["rayStartParams"]) == custom(resources)
            limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
            assert resources.get("GPU", 0) == limits.get("nvidia.com/gpu", 0)
            if values in ("default-values.yaml", "gpu-sizes-values.yaml"):
                assert "resources" not in group["rayStartParams"]


def test_ray_resources_amounts_and_merging(helm: str) -> None:
    """Amounts as given (zero included); an empty amount is the group's gpus; the resources of
    `ray.workerDefaults` merge with a group's own; names may hold digits, `.` and `-`."""
    cluster = one(
        render(
            helm,
            sets=[
                "ray.workerDefaults.rayResources.gpu_node=null",
                "ray.workerGroups.gpu.gpus=4",
                "ray.workerGroups.gpu.rayResources.learner_gpu=2",
                "ray.workerGroups.small.gpus=1",
                "ray.workerGroups.small.rayResources.spare=0",
                "ray.workerGroups.small.rayResources.example\\.pool-2=3",
            ],
        ),
        "RayCluster",
        RAY_CLUSTER,
    )
    params = {g["groupName"]: g["rayStartParams"] for g in cluster["spec"]["workerGroupSpecs"]}
    # Keys sorted (Helm's toJson), compact, in single quotes.
    assert params["gpu"]["resources"] == """'{"gpu_node":4,"learner_gpu":2}'"""
    assert params["small"]["resources"] == """'{"example.pool-2":3,"gpu_node":1,"spare":0}'"""
    assert ray_start_resources(params["small"]) == {"example.pool-2": 3, "gpu_node": 1, "spare": 0}
    types = node_types(cluster)
    assert custom(types["gpu"]["resources"]) == {"gpu_node": 4, "learner_gpu": 2}


# Values of `ray.workerGroups.gpu.rayResources` the schema refuses, and what helm says.
REFUSED_RAY_RESOURCES: dict[str, tuple[Any, str]] = {
    **{
        f"Ray's own {name}": ({name: 1}, f'Property name of "{name}" does not match')
        for name in ("CPU", "GPU", "memory", "object_store_memory")
    },
    "an accelerator type": (
        {"accelerator_type:H100": 1},
        'Property name of "accelerator_type:H100" does not match',
    ),
    "a node resource": (
        {"node:__internal_head__": 1},
        'Property name of "node:__internal_head__" does not match',
    ),
    # It would end the single-quoted JSON in the pod's `ray start` shell command.
    "a quote in the name": (
        {"learner'gpu": 1},
        """Property name of "learner'gpu" does not match""",
    ),
    "a space in the name": ({"learner gpu": 1}, 'Property name of "learner gpu" does not match'),
    "a negative amount": ({"learner_gpu": -1}, "learner_gpu: Must be greater than or equal to 0"),
    "a fraction": (
        {"learner_gpu": 0.5},
        "learner_gpu: Invalid type. Expected: integer, given: number",
    ),
    "a string": (
        {"learner_gpu": "8"},
        "learner_gpu: Invalid type. Expected: integer, given: string",
    ),
    "more than Ray's maximum": (
        {"learner_gpu": 10**15},
        "learner_gpu: Must be less than or equal to",
    ),
    "not a map": (
        [{"learner_gpu": 1}],
        "rayResources: Invalid type. Expected: object, given: array",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_RAY_RESOURCES))
def test_bad_ray_resources_are_refused(helm: str, tmp_path: Path, case: str) -> None:
    resources, expected = REFUSED_RAY_RESOURCES[case]
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump({"ray": {"workerGroups": {"gpu": {"rayResources": resources}}}}),
        encoding="utf-8",
    )
    result = helm_template(helm, [values])
    assert result.returncode != 0, f"{case}: accepted"
    assert "ray.workerGroups.gpu.rayResources" in result.stderr, result.stderr
    assert expected in result.stderr, result.stderr


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
    existing = {
        "kpo-api-token",
        "kpo-redis-credentials",
        "shared-ray-auth",
        "kpo-runs",
        "regcred",
        "hf-token",
        "default",
    }
    for values, manifests in rendered.items():
        have = {(m["kind"], m["metadata"]["name"]) for m in manifests}
        for where, _, spec in pod_specs(manifests):
            for kind, name in references(spec):
                assert (kind, name) in have or name in existing, f"{values}: {where}: {kind} {name}"


def test_rbac_is_read_only_and_bound_to_the_control_plane(helm: str) -> None:
    """rbac.create (off by default): a read-only Role bound to the control plane's account."""
    manifests = render(helm, sets=["rbac.create=true"])
    role = one(manifests, "Role", CONTROL_PLANE)
    for rule in role["rules"]:
        assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
    binding = one(manifests, "RoleBinding", CONTROL_PLANE)
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    pod = one(manifests, "Deployment", CONTROL_PLANE)["spec"]["template"]["spec"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": NAMESPACE}
    ]
    assert pod["automountServiceAccountToken"] is True  # the token the Role is for


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
    # The Service's metrics port, not the API's.
    ports = {port["name"]: port for port in service["spec"]["ports"]}
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert ports["metrics"]["port"] == 9090 and ports["http"]["port"] == 8000
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
    assert "KPO_METRICS_URL" in scripts["kpo-test-connection"]
    env = env_of(pods["kpo-test-connection"]["spec"]["containers"][0])
    assert env["KPO_URL"]["value"] == f"http://{CONTROL_PLANE}:8000"
    assert env["KPO_METRICS_URL"]["value"] == f"http://{CONTROL_PLANE}:9090/metrics"
    assert env["KPO_AUTH_READS"]["value"] == "true"


# --- security defaults: who runs, what it may write ---------------------------------------------

# The images' user (deploy/docker/Dockerfile): its home directory holds the Python libraries'
# caches, so the chart mounts a volume there.
IMAGE_HOME = "/home/kpo"


def every_container(manifests: list[Manifest]) -> Iterator[tuple[str, Manifest, Manifest]]:
    """(where, pod spec, container) of every container the release runs, the autoscaler sidecar
    KubeRay adds to the Ray head included (as far as the chart sets it)."""
    for where, _, spec in pod_specs(manifests):
        for container in containers(spec):
            yield f"{where} {container['name']}", spec, container
    for m in manifests:
        pod = autoscaler_pod(m)
        if pod is not None:
            yield (
                f"{m['kind']}/{m['metadata']['name']} autoscaler",
                pod["spec"],
                pod["spec"]["containers"][0],
            )


@pytest.mark.parametrize("values", CI_NAMES)
def test_every_container_is_non_root_read_only_and_unprivileged(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    manifests = rendered[values]
    seen = set()
    for where, spec, container in every_container(manifests):
        seen.add(where)
        pod = spec.get("securityContext", {})
        own = container.get("securityContext", {})

        def effective(key: str, pod: Manifest = pod, own: Manifest = own) -> Any:
            return own.get(key, pod.get(key))

        assert effective("runAsNonRoot") is True, where
        assert isinstance(effective("runAsUser"), int) and effective("runAsUser") > 0, where
        assert isinstance(pod.get("fsGroup"), int) and pod["fsGroup"] > 0, where
        assert own.get("readOnlyRootFilesystem") is True, where
        assert own.get("allowPrivilegeEscalation") is False, where
        assert own.get("privileged", False) is False, where
        assert "ALL" in own.get("capabilities", {}).get("drop", []), where
        assert not own.get("capabilities", {}).get("add"), where
        assert (effective("seccompProfile") or {}).get("type") == "RuntimeDefault", where
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(key), f"{where}: {key}"
        assert not any("hostPath" in v for v in spec.get("volumes", [])), where
    if values == "default-values.yaml":
        assert seen == {
            f"Deployment/{CONTROL_PLANE} control-plane",
            "StatefulSet/kpo-redis redis",
            "StatefulSet/kpo-redis redis-auth",
            f"RayCluster/{RAY_CLUSTER} head ray-head",
            f"RayCluster/{RAY_CLUSTER} worker-gpu ray-worker",
            f"RayCluster/{RAY_CLUSTER} autoscaler",
            "Pod/kpo-test-connection test",
            "Pod/kpo-test-auth test",
        }


def test_images_run_as_the_user_and_home_the_chart_expects(
    rendered: dict[str, list[Manifest]],
) -> None:
    """The chart's uid, gid and home volume are those of the images' user."""
    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text(encoding="utf-8")
    assert set(re.findall(r"--home-dir (\S+)", dockerfile)) == {IMAGE_HOME}
    assert set(re.findall(r"groupadd --gid (\d+)", dockerfile)) == {"10001"}
    assert set(re.findall(r"useradd --uid (\d+)", dockerfile)) == {"10001"}
    assert set(re.findall(r"^USER (\S+)$", dockerfile, re.M)) == {"10001:10001"}
    manifests = rendered["default-values.yaml"]
    for where, spec, _ in every_container(manifests):
        if "redis" in where:
            continue  # the redis image's own user
        context = spec["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (
            10001,
            10001,
            10001,
        ), where


def volume_sources(manifests: list[Manifest]) -> dict[str, dict[str, Manifest]]:
    """The volumes each pod can mount, by pod: its own and its StatefulSet's claim templates."""
    claims: dict[str, dict[str, Manifest]] = {
        f"StatefulSet/{m['metadata']['name']}": {
            c["metadata"]["name"]: {"persistentVolumeClaim": {}}
            for c in m["spec"].get("volumeClaimTemplates", [])
        }
        for m in named(manifests, "StatefulSet")
    }
    result = {}
    for where, _, spec in pod_specs(manifests):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        result[where] = volumes | claims.get(where, {})
    return result


@pytest.mark.parametrize("values", CI_NAMES)
def test_every_directory_written_is_a_volume(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    """With read-only root filesystems, each place a process writes is a writable volume: /tmp
    and the home directory (caches), Ray's /tmp/ray and /dev/shm, the data directory, Redis'
    /data (its claim)."""
    manifests = rendered[values]
    data_dir = one(manifests, "ConfigMap", CONTROL_PLANE)["data"]["KPO_DATA_DIR"]
    ray = {"/tmp", "/tmp/ray", IMAGE_HOME, "/dev/shm", data_dir}
    needs = {
        "control-plane": {"/tmp", IMAGE_HOME, data_dir},
        "ray-head": ray,
        "ray-worker": ray,
        "autoscaler": {"/tmp", IMAGE_HOME},  # KubeRay adds the head's /tmp/ray itself
        "redis": {"/data"},
        "redis-auth": {"/run/redis-auth"},  # writes the `requirepass` file redis.conf includes
        "test": set(),  # a Python script that only makes HTTP requests
        # `hf download` into the model directory, its cache under /tmp (HF_HOME).
        "prefetch": {"/tmp", IMAGE_HOME, models_mount_path(manifests)},
    }
    sources = volume_sources(manifests)
    for where, spec, container in every_container(manifests):
        volumes = sources.get(where.rsplit(" ", 1)[0], {v["name"]: v for v in spec["volumes"]})
        mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
        for path in needs[re.sub(r"-\d+$", "", container["name"])]:
            assert path in mounts, f"{where}: nothing writable at {path}"
            mount = mounts[path]
            assert not mount.get("readOnly"), f"{where}: {path} is read-only"
            volume = volumes.get(mount["name"])
            assert volume is not None, f"{where}: {path}: no volume {mount['name']}"
            assert "emptyDir" in volume or "persistentVolumeClaim" in volume, (where, volume)
        for mount in mounts.values():
            assert mount["name"] in volumes, f"{where}: mounts the unknown volume {mount['name']}"
    for cluster in named(manifests, "RayCluster"):
        for where, template in pod_templates(cluster):
            # KubeRay shares the head's volume named `ray-logs` with the autoscaler sidecar.
            (container,) = template["spec"]["containers"]
            logs = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert logs["/tmp/ray"] == "ray-logs", where
    redis = named(manifests, "ConfigMap", "kpo-redis")
    if redis:
        assert "dir /data" in redis[0]["data"]["redis.conf"].splitlines()


# --- secrets: only from Secrets, files or the environment of a secretKeyRef ---------------------

# Settings of `kpo serve` that hold a secret, and the other variables the chart gives one to.
SECRET_SETTINGS = {
    field.validation_alias
    for field in ApiSettings.model_fields.values()
    if "SecretStr" in str(field.annotation)
}
SECRET_VARIABLES = SECRET_SETTINGS | {
    "KPO_REDIS_PASSWORD",
    "REDIS_PASSWORD",
    "REDISCLI_AUTH",
    "RAY_AUTH_TOKEN",
}
SECRET_NAME = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|CREDENTIAL", re.I)
URL_PASSWORD = re.compile(r"://[^/@\s]*:([^/@\s]+)@")


def test_secret_settings_are_known() -> None:
    assert "KPO_API_TOKEN" in SECRET_SETTINGS


@pytest.mark.parametrize("values", CI_NAMES)
def test_secrets_never_in_a_config_map_or_a_plain_env_value(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    """The API token, the Redis password and Ray's token reach a process only as a file from a
    Secret volume or a variable from a secretKeyRef (a URL holds a `$(VAR)` of such a variable,
    never the password); no ConfigMap holds a secret, nor a value that names one; no command
    line holds a secret, a URL with a password, or a `$(VAR)` of a secret variable (which
    Kubernetes would expand into the arguments, for `ps` to show)."""
    manifests = rendered[values]
    for config_map in named(manifests, "ConfigMap"):
        where = f"ConfigMap/{config_map['metadata']['name']}"
        for key, value in config_map.get("data", {}).items():
            assert key not in SECRET_VARIABLES and not SECRET_NAME.search(key), f"{where}: {key}"
            assert not URL_PASSWORD.search(value), f"{where}: {key} holds a URL with a password"
            assert not re.search(r"^\s*requirepass\b", value, re.M), f"{where}: {key}"
    for where, spec, container in every_container(manifests):
        secret_mounts = {
            m["mountPath"]
            for m in container.get("volumeMounts", [])
            if "secret" in {v["name"]: v for v in spec.get("volumes", [])}.get(m["name"], {})
        }
        from_secrets: set[str] = set()
        for entry in container.get("env", []):
            name = entry["name"]
            if "valueFrom" in entry:
                if "secretKeyRef" in entry["valueFrom"]:
                    from_secrets.add(name)
                continue
            value = str(entry.get("value", ""))
            if name.endswith("_FILE"):
                # A file holding a secret lies on a read-only Secret volume.
                assert any(value.startswith(path + "/") for path in secret_mounts), (where, name)
                continue
            assert name not in SECRET_VARIABLES and not SECRET_NAME.search(name), (
                f"{where}: {name} has a plain value"
            )
            password = URL_PASSWORD.search(value)
            if password:
                reference = re.fullmatch(r"\$\((\w+)\)", password.group(1))
                assert reference and reference.group(1) in from_secrets, (
                    f"{where}: {name} holds a password that is not a $(VAR) of a secretKeyRef"
                )
        for source in container.get("envFrom", []):
            assert "configMapRef" in source or "secretRef" in source, where
        words = [str(word) for word in (*container.get("command", []), *container.get("args", []))]
        for word in words:
            assert not URL_PASSWORD.search(word), f"{where}: a password on the command line"
            assert "--requirepass" not in word, f"{where}: a password on the command line"
            for reference in re.findall(r"\$\((\w+)\)", word):
                assert reference not in from_secrets and reference not in SECRET_VARIABLES, (
                    f"{where}: $({reference}) puts a secret on the command line"
                )


def test_no_value_takes_a_secret_in_plain_text() -> None:
    """values.yaml names Secrets and keys; it has no key that would hold a token or password."""
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))

    def keys(node: object, path: str) -> Iterator[str]:
        if isinstance(node, dict):
            for key, child in node.items():
                yield f"{path}.{key}".lstrip(".")
                yield from keys(child, f"{path}.{key}")

    secretish = [k for k in keys(values, "") if SECRET_NAME.search(k.rsplit(".", 1)[-1])]
    assert sorted(secretish) == sorted(
        [
            "imagePullSecrets",
            "apiToken",
            "apiToken.existingSecret",
            "apiToken.secretKey",
            "controlPlane.ingress.tlsSecretName",
            "redis.auth.existingSecret",
            "redis.auth.secretKey",
            "secrets",
            "ray.auth.existingSecret",
            "ray.auth.secretKey",
            "ray.models.hfToken",
            "ray.models.hfToken.existingSecret",
            "ray.models.hfToken.secretKey",
            "sandbox.token",
            "sandbox.token.existingSecret",
            "sandbox.token.secretKey",
            "alerting.token",
            "alerting.token.existingSecret",
            "alerting.token.secretKey",
        ]
    )
    assert set(values["secrets"]) == {"requireExisting"}
    for key in (
        "apiToken",
        "redis.auth",
        "ray.auth",
        "ray.models.hfToken",
        "sandbox.token",
        "alerting.token",
    ):
        node = values
        for part in key.split("."):
            node = node[part]
        assert set(node) <= {"enabled", "existingSecret", "secretKey"}, key


# --- NetworkPolicies ------------------------------------------------------------------------------

# Pods outside the release, as a cluster has them.
INGRESS_CONTROLLER = Pod.of(
    "ingress-nginx-controller",
    "ingress-nginx",
    {"app.kubernetes.io/name": "ingress-nginx", "app.kubernetes.io/component": "controller"},
)
PROMETHEUS = Pod.of("prometheus-0", "monitoring", {"app.kubernetes.io/name": "prometheus"})
KUBE_DNS = Pod.of("coredns-0", "kube-system", {"k8s-app": "kube-dns"}, {"dns": 53})
# Another application in the release's namespace, another pod in the ingress controller's
# namespace, and a pod elsewhere that copies the release's labels.
NEIGHBOUR = Pod.of("neighbour", NAMESPACE, {"app": "something-else"})
INGRESS_NEIGHBOUR = Pod.of("default-backend", "ingress-nginx", {"app": "default-backend"})
IMPOSTOR = Pod.of(
    "impostor",
    "default",
    {
        "app.kubernetes.io/name": "kpo",
        "app.kubernetes.io/instance": "kpo",
        "app.kubernetes.io/component": "control-plane",
    },
)
EXTERNAL_RAY = Pod.of("shared-ray-worker", "ray-system", {"ray.io/cluster": "shared-ray"})
OUTSIDERS = (NEIGHBOUR, INGRESS_NEIGHBOUR, IMPOSTOR)
# Addresses outside the cluster's pods: the clouds' metadata endpoint (which hands out the
# node's credentials), a host on the internet (a model hub), and an API server in the cluster's
# private network.
METADATA = Address("169.254.169.254")
INTERNET = Address("104.18.0.1")
KUBE_API = Address("10.0.0.1")


def release_pods(manifests: list[Manifest]) -> dict[str, Pod]:
    """The release's pods by where they come from (`Deployment/kpo-control-plane`, ...)."""
    pods = {}
    for where, meta, spec in pod_specs(manifests):
        ports = {
            p["name"]: p["containerPort"]
            for c in spec["containers"]
            for p in c.get("ports", [])
            if "name" in p
        }
        pods[where] = Pod.of(where, NAMESPACE, meta.get("labels", {}), ports)
    return pods


def used_ports(manifests: list[Manifest]) -> dict[str, int]:
    """The ports the release connects to, read from the objects: the control plane's API and
    metrics ports (its Service's targets), the store's (KPO_STORE_URL), the job server's
    (RAY_ADDRESS)."""
    env = env_of(control_plane_container(manifests))
    service = {p["name"]: p for p in one(manifests, "Service", CONTROL_PLANE)["spec"]["ports"]}
    control_plane = release_pods(manifests)[f"Deployment/{CONTROL_PLANE}"]
    ports = {
        "control-plane": control_plane.ports[service["http"]["targetPort"]],
        "metrics": control_plane.ports[service["metrics"]["targetPort"]],
        "store": urlsplit(env["KPO_STORE_URL"]["value"]).port or 6379,
        "job-server": urlsplit(
            one(manifests, "ConfigMap", CONTROL_PLANE)["data"]["RAY_ADDRESS"]
        ).port,
    }
    return {key: int(value) for key, value in ports.items() if value}


def test_network_policies_admit_only_what_the_release_needs(
    rendered: dict[str, list[Manifest]],
) -> None:
    """The default release, connection by connection, both ends checked (out of the source,
    into the destination): what it makes goes through, and nothing else."""
    manifests = rendered["default-values.yaml"]
    policies = named(manifests, "NetworkPolicy")
    pods = release_pods(manifests)
    control_plane, redis = pods[f"Deployment/{CONTROL_PLANE}"], pods["StatefulSet/kpo-redis"]
    head, worker = (
        pods[f"RayCluster/{RAY_CLUSTER} head"],
        pods[f"RayCluster/{RAY_CLUSTER} worker-gpu"],
    )
    tests = [pod for where, pod in pods.items() if where.startswith("Pod/")]
    ports = used_ports(manifests)
    api, metrics, store, jobs = (
        ports["control-plane"],
        ports["metrics"],
        ports["store"],
        ports["job-server"],
    )
    assert (api, metrics, store, jobs) == (8000, 9090, 6379, 8265)
    gcs, client, ray_metrics = head.ports["gcs-server"], head.ports["client"], head.ports["metrics"]

    for pod in (control_plane, redis, head, worker, *tests):
        assert isolating(policies, pod, NAMESPACE, "Ingress"), f"{pod.name} is not isolated"
        assert isolating(policies, pod, NAMESPACE, "Egress"), f"{pod.name}: egress is open"

    def opens(source: Pod, destination: Pod | Address, port: int, protocol: str = "TCP") -> bool:
        return connects(policies, source, destination, port, NAMESPACE, protocol)

    allowed: list[tuple[Pod, Pod | Address, int]] = [
        (INGRESS_CONTROLLER, control_plane, api),
        (PROMETHEUS, control_plane, metrics),
        *[(test, control_plane, api) for test in tests],
        *[(test, control_plane, metrics) for test in tests],
        (control_plane, redis, store),
        (head, redis, store),  # the runs' drivers
        (worker, redis, store),  # the learner and generation actors
        (control_plane, head, jobs),
        (worker, head, gcs),
        (head, worker, 10002),  # Ray's own ports between nodes (raylets, object transfers)
        (worker, worker, 20000),
        (PROMETHEUS, head, ray_metrics),
        (PROMETHEUS, worker, ray_metrics),
        (head, KUBE_API, 443),  # KubeRay's autoscaler sidecar
        (head, KUBE_API, 6443),
    ]
    for source, destination, port in allowed:
        assert opens(source, destination, port), f"{source.name} -> {destination.name}:{port}"
    # DNS, from every pod that resolves names (Redis resolves none).
    for source in (control_plane, head, worker, *tests):
        for protocol in ("UDP", "TCP"):
            assert opens(source, KUBE_DNS, 53, protocol), f"{source.name}: DNS over {protocol}"

    refused: list[tuple[Pod, Pod | Address, int]] = [
        *[
            (outsider, pod, p)
            for outsider in OUTSIDERS
            for pod in pods.values()
            for p in pod.ports.values()
        ],
        *[(outsider, control_plane, api) for outsider in OUTSIDERS],
        *[(outsider, redis, store) for outsider in (*OUTSIDERS, INGRESS_CONTROLLER, PROMETHEUS)],
        *[(test, redis, store) for test in tests],
        *[(test, head, jobs) for test in tests],
        (INGRESS_CONTROLLER, head, jobs),
        (INGRESS_CONTROLLER, control_plane, metrics),  # /metrics is never routed out
        (PROMETHEUS, head, jobs),
        (PROMETHEUS, control_plane, api),  # Prometheus gets /metrics, not the API
        (control_plane, head, gcs),  # the control plane only talks HTTP to the job server
        (control_plane, head, client),
        (control_plane, worker, ray_metrics),
        (control_plane, worker, jobs),
        (head, control_plane, api),  # the runs report through Redis, not the API
        (worker, control_plane, api),
        (EXTERNAL_RAY, redis, store),
        # Out of the release: no pod reaches the internet, the metadata endpoint, or a
        # neighbour; only the head reaches the Kubernetes API.
        *[
            (pod, address, port)
            for pod in (control_plane, redis, head, worker, *tests)
            for address in (INTERNET, METADATA)
            for port in (80, 443)
        ],
        (head, METADATA, 6443),
        (control_plane, KUBE_API, 443),  # rbac.create is off: it needs no API
        (worker, KUBE_API, 443),
        (redis, KUBE_API, 443),
        (head, KUBE_API, 80),
        *[(pod, NEIGHBOUR, 8080) for pod in (control_plane, redis, head, worker)],
        (redis, control_plane, api),  # Redis opens no connection at all
        (redis, KUBE_DNS, 53),
    ]
    for source, destination, port in refused:
        assert not opens(source, destination, port), f"{source.name} -> {destination.name}:{port}"


@pytest.mark.parametrize("values", CI_NAMES)
def test_network_policies_keep_every_connection_the_release_makes(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    manifests = rendered[values]
    policies = named(manifests, "NetworkPolicy")
    assert policies, "NetworkPolicies are on by default"
    for policy in policies:
        name = policy["metadata"]["name"]
        assert set(policy["spec"]["policyTypes"]) <= {"Ingress", "Egress"}, name
        assert "Egress" in policy["spec"]["policyTypes"], f"{name}: egress is on by default"
        for rule in policy["spec"].get("ingress") or []:
            assert rule.get("from"), f"{name}: a rule open to everyone"
        for rule in policy["spec"].get("egress") or []:
            assert rule.get("to"), f"{name}: an egress rule to everywhere"
            for peer in rule["to"]:
                if "ipBlock" in peer:
                    # Every address block holding the metadata endpoint excepts link-local.
                    assert not in_ip_block(peer["ipBlock"], METADATA.ip), (name, peer)
    pods = release_pods(manifests)
    control_plane = pods[f"Deployment/{CONTROL_PLANE}"]
    redis = pods.get("StatefulSet/kpo-redis")
    ray = [pod for where, pod in pods.items() if where.startswith("RayCluster/")]
    tests = [pod for where, pod in pods.items() if where.startswith("Pod/")]
    ports = used_ports(manifests)
    env = env_of(control_plane_container(manifests))
    store_url = urlsplit(env["KPO_STORE_URL"]["value"])
    job_server = urlsplit(one(manifests, "ConfigMap", CONTROL_PLANE)["data"]["RAY_ADDRESS"])

    def opens(source: Pod, destination: Pod | Address, port: int, protocol: str = "TCP") -> bool:
        return connects(policies, source, destination, port, NAMESPACE, protocol)

    assert opens(INGRESS_CONTROLLER, control_plane, ports["control-plane"])
    for test in tests:
        assert opens(test, control_plane, ports["control-plane"])
        assert opens(test, control_plane, ports["metrics"])
    for source in (control_plane, *ray, *tests):
        assert opens(source, KUBE_DNS, 53, "UDP") and opens(source, KUBE_DNS, 53, "TCP")
    if redis is not None:
        runs = ray or [EXTERNAL_RAY]  # where the runs' drivers and actors live
        for source in (control_plane, *runs):
            assert opens(source, redis, ports["store"]), source.name
        assert opens(EXTERNAL_RAY, redis, ports["store"]) == (not ray)
    else:
        # An external Redis, somewhere outside the cluster's pods (not link-local).
        external = Address("203.0.113.7")
        for source in (control_plane, *ray):
            assert opens(source, external, ports["store"]), source.name
            assert not opens(source, METADATA, ports["store"]), source.name
        assert store_url.hostname == "redis.example.internal"
    if ray:
        head = pods[f"RayCluster/{RAY_CLUSTER} head"]
        assert opens(control_plane, head, ports["job-server"])
        for source in ray:
            for destination in ray:
                for port in destination.ports.values():
                    assert opens(source, destination, port), (source.name, destination.name)
            assert opens(PROMETHEUS, source, source.ports["metrics"])
    else:
        # The job server of the Ray cluster at ray.address, one of that cluster's pods.
        assert opens(control_plane, EXTERNAL_RAY, job_server.port or 80)
        assert not opens(control_plane, EXTERNAL_RAY, 6379)
    for outsider in OUTSIDERS:
        for pod in (control_plane, *([redis] if redis else []), *ray):
            for port in pod.ports.values():
                assert not opens(outsider, pod, port), (outsider.name, pod.name, port)
    for pod in (control_plane, *([redis] if redis else []), *ray, *tests):
        for port in (80, 443):
            assert not opens(pod, METADATA, port), (pod.name, port)


def test_network_policy_values(helm: str, tmp_path: Path) -> None:
    """networkPolicy.enabled=false removes them; the peers follow their values."""
    default = render(helm)
    off = render(helm, sets=["networkPolicy.enabled=false"])
    assert not named(off, "NetworkPolicy")
    assert sorted(m["kind"] for m in off) == sorted(
        m["kind"] for m in default if m["kind"] != "NetworkPolicy"
    )

    custom = tmp_path / "values.yaml"
    custom.write_text(
        yaml.safe_dump(
            {
                "networkPolicy": {
                    # null removes a default (Helm merges maps).
                    "ingressController": {"namespaceSelector": None, "podSelector": None},
                    "prometheus": {"enabled": False},
                    "controlPlane": {
                        "extraFrom": [
                            {"ipBlock": {"cidr": "10.0.0.0/8"}},
                            {"podSelector": {"matchLabels": {"app": "kpo-cli"}}},
                        ]
                    },
                    "ray": {
                        "extraFrom": [
                            {
                                "namespaceSelector": {
                                    "matchLabels": {"kubernetes.io/metadata.name": "notebooks"}
                                }
                            }
                        ]
                    },
                }
            }
        )
    )
    manifests = render(helm, [custom])
    for manifest in manifests:
        validate(manifest)
    policies = named(manifests, "NetworkPolicy")
    pods = release_pods(manifests)
    control_plane = pods[f"Deployment/{CONTROL_PLANE}"]
    head = pods[f"RayCluster/{RAY_CLUSTER} head"]
    cli = Pod.of("kpo-cli", NAMESPACE, {"app": "kpo-cli"})
    notebook = Pod.of("notebook", "notebooks", {"app": "jupyter"})

    def opens(source: Pod, destination: Pod, port: int) -> bool:
        return admitted(policies, source, destination, port, NAMESPACE)

    assert not opens(INGRESS_CONTROLLER, control_plane, 8000)
    assert not opens(PROMETHEUS, control_plane, 9090)
    assert not opens(PROMETHEUS, head, head.ports["metrics"])
    assert opens(cli, control_plane, 8000) and not opens(cli, head, 8265)
    assert not opens(cli, control_plane, 9090)  # extraFrom: the API only
    assert opens(notebook, head, head.ports["client"]) and not opens(notebook, control_plane, 8000)
    cp_policy = one(policies, "NetworkPolicy", CONTROL_PLANE)
    assert {"ipBlock": {"cidr": "10.0.0.0/8"}} in [
        peer for rule in cp_policy["spec"]["ingress"] for peer in rule["from"]
    ]


def test_egress_values(helm: str) -> None:
    """networkPolicy.egress: off leaves ingress alone; the internet, the Kubernetes API and the
    DNS servers follow their values; link-local is excepted from every address block and refused
    as a block of its own."""
    off = render(helm, sets=["networkPolicy.egress.enabled=false"])
    for policy in named(off, "NetworkPolicy"):
        assert policy["spec"]["policyTypes"] == ["Ingress"], policy["metadata"]["name"]
        assert "egress" not in policy["spec"]
    assert {p["metadata"]["name"] for p in named(off, "NetworkPolicy")} == {
        CONTROL_PLANE,
        "kpo-redis",
        RAY_CLUSTER,
    }

    manifests = render(
        helm,
        sets=[
            "networkPolicy.egress.internet.cidrs={0.0.0.0/0}",
            "networkPolicy.egress.internet.ports={443,80}",
            "networkPolicy.egress.kubernetesApi.cidrs={10.0.0.1/32}",
            "networkPolicy.egress.kubernetesApi.ports={6443}",
            "networkPolicy.dns.extraTo[0].ipBlock.cidr=169.254.20.10/32",
            "rbac.create=true",
        ],
    )
    for manifest in manifests:
        validate(manifest)
    policies = named(manifests, "NetworkPolicy")
    pods = release_pods(manifests)
    control_plane, redis = pods[f"Deployment/{CONTROL_PLANE}"], pods["StatefulSet/kpo-redis"]
    head = pods[f"RayCluster/{RAY_CLUSTER} head"]
    worker = pods[f"RayCluster/{RAY_CLUSTER} worker-gpu"]

    def opens(source: Pod, destination: Pod | Address, port: int, protocol: str = "TCP") -> bool:
        return connects(policies, source, destination, port, NAMESPACE, protocol)

    for pod in (head, worker):  # the hubs, from the Ray pods only
        assert opens(pod, INTERNET, 443) and opens(pod, INTERNET, 80)
        assert not opens(pod, INTERNET, 22)
        assert not opens(pod, METADATA, 443) and not opens(pod, METADATA, 80)
    assert not opens(control_plane, INTERNET, 443) and not opens(redis, INTERNET, 443)
    # The API server, at its one address: from the head and (rbac.create) the control plane.
    for pod in (head, control_plane):
        assert opens(pod, Address("10.0.0.1"), 6443)
        assert not opens(pod, Address("10.0.0.2"), 6443)
    assert not opens(worker, Address("10.0.0.1"), 6443)
    # NodeLocal DNSCache's link-local address, for DNS only.
    node_local_dns = Address("169.254.20.10")
    assert opens(worker, node_local_dns, 53, "UDP") and not opens(worker, node_local_dns, 80)

    # No DNS server named: no rule for port 53 at all (a rule without `to` would open it to
    # every address).
    no_dns = render(
        helm,
        sets=["networkPolicy.dns.namespaceSelector=null", "networkPolicy.dns.podSelector=null"],
    )
    for policy in named(no_dns, "NetworkPolicy"):
        for rule in policy["spec"].get("egress") or []:
            assert rule.get("to"), policy["metadata"]["name"]
            assert {"port": 53, "protocol": "UDP"} not in rule.get("ports", [])

    # Without the autoscaler, no pod reaches the Kubernetes API.
    fixed = render(helm, sets=["ray.autoscaling.enabled=false"])
    assert not named(fixed, "NetworkPolicy", "kpo-ray-head-kube-api")
    fixed_head = release_pods(fixed)[f"RayCluster/{RAY_CLUSTER} head"]
    assert not connects(named(fixed, "NetworkPolicy"), fixed_head, KUBE_API, 443, NAMESPACE)


LINK_LOCAL_REFUSED = {
    "the metadata endpoint itself": (
        ["networkPolicy.egress.internet.cidrs={169.254.169.254/32}"],
        "networkPolicy.egress.internet.cidrs: 169.254.169.254/32 is link-local",
    ),
    "all of link-local for the API": (
        ["networkPolicy.egress.kubernetesApi.cidrs={169.254.0.0/16}"],
        "networkPolicy.egress.kubernetesApi.cidrs: 169.254.0.0/16 is link-local",
    ),
    "an external Redis at a link-local address": (
        [
            "redis.builtin.enabled=false",
            "redis.external.url=redis://redis.example:6379/0",
            "redis.auth.existingSecret=redis-credentials",
            "networkPolicy.egress.externalRedis.cidrs={169.254.10.0/24}",
        ],
        "networkPolicy.egress.externalRedis.cidrs: 169.254.10.0/24 is link-local",
    ),
}


@pytest.mark.parametrize("case", list(LINK_LOCAL_REFUSED))
def test_link_local_is_never_allowed(helm: str, case: str) -> None:
    sets, expected = LINK_LOCAL_REFUSED[case]
    result = helm_template(helm, sets=sets)
    assert result.returncode != 0, f"{case}: accepted"
    assert expected in result.stderr, result.stderr


def test_link_local_is_excepted_from_every_block_that_holds_it(helm: str) -> None:
    """A block that holds 169.254.0.0/16 gets it as an `except`; one that does not, none (an
    except outside its cidr is invalid)."""
    cidrs = ["0.0.0.0/0", "128.0.0.0/1", "169.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12"]
    manifests = render(helm, sets=["networkPolicy.egress.internet.cidrs={" + ",".join(cidrs) + "}"])
    policy = one(manifests, "NetworkPolicy", RAY_CLUSTER)
    blocks = {
        peer["ipBlock"]["cidr"]: peer["ipBlock"]
        for rule in policy["spec"]["egress"]
        for peer in rule["to"]
        if "ipBlock" in peer
    }
    assert set(blocks) == set(cidrs)
    for cidr in ("0.0.0.0/0", "128.0.0.0/1", "169.0.0.0/8"):
        assert blocks[cidr]["except"] == ["169.254.0.0/16"], cidr
    for cidr in ("10.0.0.0/8", "172.16.0.0/12"):
        assert "except" not in blocks[cidr], cidr


def test_network_policy_evaluator_follows_kubernetes() -> None:
    """The evaluator the policy tests rely on, on cases whose answer Kubernetes documents."""
    web = Pod.of("web", "shop", {"app": "web"}, {"http": 8080})
    client = Pod.of("client", "shop", {"role": "client"})
    foreign = Pod.of("client", "other", {"role": "client"})

    def policy(ingress: list[Manifest], selector: Manifest | None = None) -> Manifest:
        return {
            "metadata": {"name": "p", "namespace": "shop"},
            "spec": {
                "podSelector": selector or {"matchLabels": {"app": "web"}},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }

    assert admitted([], client, web, 8080, "shop")  # no policy: not isolated
    assert not admitted([policy([])], client, web, 8080, "shop")  # isolated, no rule
    assert admitted([policy([{}])], foreign, web, 1, "shop")  # a rule without from and ports
    same_namespace = policy([{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}]}])
    assert admitted([same_namespace], client, web, 8080, "shop")
    assert not admitted([same_namespace], foreign, web, 8080, "shop")
    both = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "other"}},
        "podSelector": {"matchLabels": {"role": "client"}},
    }
    assert admitted([policy([{"from": [both]}])], foreign, web, 8080, "shop")
    assert not admitted([policy([{"from": [both]}])], client, web, 8080, "shop")
    named_port = policy([{"from": [{"podSelector": {}}], "ports": [{"port": "http"}]}])
    assert admitted([named_port], client, web, 8080, "shop")
    assert not admitted([named_port], client, web, 8081, "shop")
    ranged = policy([{"ports": [{"port": 1000, "endPort": 2000}]}])
    assert admitted([ranged], client, web, 1500, "shop") and not admitted(
        [ranged], client, web, 2001, "shop"
    )
    expression = {"matchExpressions": [{"key": "app", "operator": "In", "values": ["db"]}]}
    assert admitted([policy([], expression)], client, web, 8080, "shop")  # selects no web pod
    udp = policy([{"ports": [{"port": 53, "protocol": "UDP"}]}])
    assert admitted([udp], client, web, 53, "shop", "UDP")
    assert not admitted([udp], client, web, 53, "shop", "TCP")

    # Egress: the same rules from the source's end.
    def egress(rules: list[Manifest], types: list[str] | None = None) -> Manifest:
        spec: Manifest = {"podSelector": {"matchLabels": {"role": "client"}}, "egress": rules}
        if types is not None:
            spec["policyTypes"] = types
        return {"metadata": {"name": "e", "namespace": "shop"}, "spec": spec}

    metadata, outside = Address("169.254.169.254"), Address("93.184.216.34")
    assert connects([], client, outside, 443, "shop")  # not isolated for egress
    assert not connects([egress([], ["Egress"])], client, web, 8080, "shop")  # isolated, no rule
    assert connects([egress([{}])], client, outside, 1, "shop")  # no policyTypes: Egress too
    # Ingress only: the egress rules of a policy without `Egress` in its types do not isolate.
    assert connects([egress([], ["Ingress"])], client, outside, 443, "shop")
    to_web = egress([{"to": [{"podSelector": {"matchLabels": {"app": "web"}}}]}], ["Egress"])
    assert connects([to_web], client, web, 8080, "shop")
    assert not connects([to_web], client, outside, 443, "shop")
    assert connects([to_web], foreign, outside, 443, "shop")  # another namespace's: not selected
    block = {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}}
    anywhere = egress([{"to": [block], "ports": [{"port": 443}]}], ["Egress"])
    assert connects([anywhere], client, outside, 443, "shop")
    assert not connects([anywhere], client, metadata, 443, "shop")  # the except
    assert not connects([anywhere], client, outside, 80, "shop")
    assert not connects([anywhere], client, web, 443, "shop")  # an ipBlock matches no pod
    # Both ends: let out of the source, but not into an isolated destination.
    assert not connects([to_web, policy([])], client, web, 8080, "shop")
    assert in_ip_block({"cidr": "10.0.0.0/8"}, "10.1.2.3")
    assert not in_ip_block({"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}, "10.1.2.3")


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
        [
            "redis.builtin.enabled=false",
            "redis.external.url=redis://host:6379/0",
            "redis.auth.existingSecret=",
        ],
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
    "external Ray cut off from the built-in Redis": (
        ["ray.cluster.enabled=false", "ray.address=http://ray-head-svc:8265"],
        "set networkPolicy.externalRay.from",
    ),
    "Ray's own resource name in the worker defaults": (
        ["ray.workerDefaults.rayResources.GPU=1"],
        'ray.workerDefaults.rayResources: Property name of "GPU" does not match',
    ),
    "custom Ray resources in two places": (
        [
            "ray.workerGroups.gpu.rayResources.learner_gpu=8",
            "ray.workerGroups.gpu.rayStartParams.resources='{}'",
        ],
        "ray.workerGroups.gpu: declare custom Ray resources in rayResources only",
    ),
    "typo in a NetworkPolicy peer": (
        ["networkPolicy.ingressController.podSelector.matchLabel.app=x"],
        "Additional property matchLabel is not allowed",
    ),
    "/dev/shm as large as the memory limit": (
        ["ray.workerGroups.gpu.shmSize=64Gi"],
        "ray.workerGroups.gpu: /dev/shm (64Gi) must be smaller than the memory limit (64Gi)",
    ),
    "/dev/shm of the head above its memory": (
        ["ray.head.shmSize=9Gi"],
        "ray.head: /dev/shm (9Gi) must be smaller than the memory limit (8Gi)",
    ),
    "a fractional /dev/shm": (
        ["ray.workerGroups.gpu.shmSize=1.5Gi"],
        "ray.workerGroups.gpu.shmSize",
    ),
    "typo in the per-GPU sizes": (
        ["ray.workerDefaults.perGpu.memory=64"],
        "Additional property memory is not allowed",
    ),
    "an object store taking all of /dev/shm": (
        ["ray.objectStoreShmPercent=100"],
        "ray.objectStoreShmPercent: Must be less than or equal to 95",
    ),
    "an unknown kind of model volume": (
        ["ray.models.volume=hostPath"],
        "ray.models.volume: ray.models.volume must be one of the following",
    ),
    "a model repo that leaves the model directory": (
        ["ray.models.prefetch[0].repo=../etc"],
        "ray.models.prefetch.0.repo: Does not match pattern",
    ),
    "a model revision that is an option": (
        ["ray.models.prefetch[0].repo=Qwen/Qwen2.5-0.5B", "ray.models.prefetch[0].revision=--help"],
        "ray.models.prefetch.0.revision: Does not match pattern",
    ),
    "a relative model mount path": (
        ["ray.models.mountPath=models"],
        "ray.models.mountPath: Does not match pattern",
    ),
    "model downloads with egress closed to the internet": (
        ["ray.models.prefetch[0].repo=Qwen/Qwen2.5-0.5B"],
        "ray.models.prefetch downloads from the Hugging Face Hub, so set "
        "networkPolicy.egress.internet.cidrs",
    ),
    "an egress CIDR that is not IPv4": (
        ["networkPolicy.egress.internet.cidrs={::/0}"],
        "networkPolicy.egress.internet.cidrs.0: Does not match pattern",
    ),
    "a Redis fsync policy that loses writes": (
        ["redis.builtin.appendfsync=no"],
        "redis.builtin.appendfsync: redis.builtin.appendfsync must be one of the following",
    ),
    "/metrics on the API's port": (
        ["controlPlane.metrics.port=8000"],
        "controlPlane.metrics.port: /metrics needs a port of its own",
    ),
    "a metrics port that is not a port": (
        ["controlPlane.metrics.port=0"],
        "controlPlane.metrics.port: Must be greater than or equal to 1",
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
