"""The chart's tool sandbox (`sandbox.*`: `kpo sandbox serve` in pods of its own), rendered with
the real `helm template` and validated against the Kubernetes schema like every other object:
what it renders on and off, its NetworkPolicy connection by connection (both ends, with the
evaluator of tests/deploy/network_policy.py), its ServiceAccount, securityContext, probes and
token. docs/deploy.md explains the choices these checks pin down.
"""

from __future__ import annotations

import base64
import subprocess

import pytest

from services.tools.server import SandboxSettings
from tests.deploy.manifests import (
    CHART,
    NAMESPACE,
    RELEASE,
    Manifest,
    env_of,
    helm_template,
    named,
    one,
    render,
    validate,
)
from tests.deploy.network_policy import connects, isolating
from tests.deploy.test_helm_chart import (
    CONTROL_PLANE,
    EXTERNAL_RAY,
    INGRESS_CONTROLLER,
    INTERNET,
    KUBE_API,
    KUBE_DNS,
    METADATA,
    OUTSIDERS,
    PROMETHEUS,
    RAY_CLUSTER,
    release_pods,
)
from tests.deploy.test_helm_security import ray_containers

SANDBOX = "kpo-sandbox"
TOKEN_SECRET = "kpo-sandbox-token"
ON = ["sandbox.enabled=true"]


@pytest.fixture(scope="module")
def sandbox_on(helm: str) -> list[Manifest]:
    # The token the chart generates: the tests follow it from its Secret to every reader.
    return render(helm, sets=ON, secrets="generated")


@pytest.fixture(scope="module")
def sandbox_off(helm: str) -> list[Manifest]:
    return render(helm)


def sandbox_objects(manifests: list[Manifest]) -> list[Manifest]:
    return [
        m
        for m in manifests
        if m["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        in ("sandbox", "sandbox-token")
    ]


def pod_spec(manifests: list[Manifest]) -> Manifest:
    spec = one(manifests, "Deployment", SANDBOX)["spec"]["template"]["spec"]
    assert isinstance(spec, dict)
    return spec


# What the server itself holds (uvicorn, FastAPI, its threads), measured: about 100 MiB.
SERVER_MIB = 100


def container(manifests: list[Manifest]) -> Manifest:
    (only,) = pod_spec(manifests)["containers"]
    assert isinstance(only, dict)
    return only


# --- rendered and valid ------------------------------------------------------------------------


def test_off_by_default_and_nothing_of_it_rendered(sandbox_off: list[Manifest]) -> None:
    assert sandbox_objects(sandbox_off) == []
    for where, ray in ray_containers(sandbox_off):
        assert "KPO_SANDBOX_TOKEN" not in env_of(ray), where
    for policy in named(sandbox_off, "NetworkPolicy"):
        assert "sandbox" not in str(policy["spec"]), policy["metadata"]["name"]


def test_on_renders_its_objects_and_every_object_validates(sandbox_on: list[Manifest]) -> None:
    kinds = sorted((m["kind"], m["metadata"]["name"]) for m in sandbox_objects(sandbox_on))
    assert kinds == [
        ("Deployment", SANDBOX),
        ("NetworkPolicy", SANDBOX),
        ("Secret", TOKEN_SECRET),
        ("Service", SANDBOX),
        ("ServiceAccount", SANDBOX),
    ]
    # Every object of the release, the RayCluster's pod templates (which now carry the token)
    # included, against the Kubernetes schema in strict mode.
    for manifest in sandbox_on:
        validate(manifest)


def test_service_selects_the_sandbox_pods_on_the_containers_port(
    sandbox_on: list[Manifest],
) -> None:
    service = one(sandbox_on, "Service", SANDBOX)["spec"]
    deployment = one(sandbox_on, "Deployment", SANDBOX)["spec"]
    labels = deployment["template"]["metadata"]["labels"]
    assert service["type"] == "ClusterIP"
    assert service["selector"].items() <= labels.items()
    assert deployment["selector"]["matchLabels"] == service["selector"]
    (port,) = service["ports"]  # the calls' port only: the probes' stays in the pod
    container_port, probe_port = container(sandbox_on)["ports"]
    assert port["targetPort"] == container_port["name"] == "http"
    assert port["port"] == container_port["containerPort"] == 8090
    assert (probe_port["name"], probe_port["containerPort"]) == ("probes", 8091)
    command = container(sandbox_on)["command"]
    # Under an init that reaps (the image's tini): bwrap leaves a zombie per call otherwise.
    assert command[:5] == ["tini", "--", "kpo", "sandbox", "serve"]
    assert command[command.index("--port") + 1] == "8090"
    assert command[command.index("--host") + 1] == "0.0.0.0"
    # The URL a run puts in tools.sandbox_url is printed by the install notes.
    assert deployment["replicas"] == 1


def test_settings_are_the_servers_own(sandbox_on: list[Manifest]) -> None:
    """Every KPO_SANDBOX_* variable the chart sets is a setting of the server, and the server
    accepts the values (so a renamed setting fails here, not in a crash-looping pod)."""
    env = env_of(container(sandbox_on))
    fields = {f"KPO_SANDBOX_{name.upper()}" for name in SandboxSettings.model_fields}
    ours = {name for name in env if name.startswith("KPO_SANDBOX_")}
    assert ours <= fields, ours - fields
    plain = {
        name.removeprefix("KPO_SANDBOX_").lower(): entry["value"]
        for name, entry in env.items()
        if name in ours and "value" in entry
    }
    settings = SandboxSettings(**plain)
    assert settings.backend == "bwrap" and not settings.allow_unsafe_process
    assert (settings.max_concurrency, settings.max_queue, settings.nproc) == (4, 32, 8)
    assert settings.probe_port == 8091


# --- the NetworkPolicy -------------------------------------------------------------------------


def test_network_policy_denies_every_egress(sandbox_on: list[Manifest]) -> None:
    policy = one(sandbox_on, "NetworkPolicy", SANDBOX)["spec"]
    assert "Egress" in policy["policyTypes"] and "Ingress" in policy["policyTypes"]
    assert not policy.get("egress"), "an egress rule on the sandbox"
    policies = named(sandbox_on, "NetworkPolicy")
    pods = release_pods(sandbox_on)
    sandbox = pods[f"Deployment/{SANDBOX}"]
    assert isolating(policies, sandbox, NAMESPACE, "Egress")
    destinations = [*pods.values(), KUBE_DNS, PROMETHEUS, *OUTSIDERS]
    for destination in destinations:
        for port in {53, 80, 443, 6379, 8000, 8265, 8090, *destination.ports.values()}:
            for protocol in ("TCP", "UDP"):
                assert not connects(policies, sandbox, destination, port, NAMESPACE, protocol), (
                    destination.name,
                    port,
                    protocol,
                )
    for address in (INTERNET, METADATA, KUBE_API):
        for port in (53, 80, 443, 6443):
            assert not connects(policies, sandbox, address, port, NAMESPACE), (address, port)


def test_network_policy_admits_only_the_runs_and_the_control_plane_on_its_port(
    sandbox_on: list[Manifest],
) -> None:
    """Both ends: the Ray pods' and the control plane's egress let the call out, the sandbox's
    ingress lets it in; nobody else, and no other port."""
    policies = named(sandbox_on, "NetworkPolicy")
    pods = release_pods(sandbox_on)
    sandbox = pods[f"Deployment/{SANDBOX}"]
    head = pods[f"RayCluster/{RAY_CLUSTER} head"]
    worker = pods[f"RayCluster/{RAY_CLUSTER} worker-gpu"]
    control_plane = pods[f"Deployment/{CONTROL_PLANE}"]
    port = sandbox.ports["http"]
    for client in (head, worker, control_plane):
        assert connects(policies, client, sandbox, port, NAMESPACE), client.name
        for other in (port + 1, 22, 8000):
            assert not connects(policies, client, sandbox, other, NAMESPACE), (client.name, other)
    others = [
        pod for where, pod in pods.items() if pod not in (sandbox, head, worker, control_plane)
    ]
    assert {pod.name for pod in others} >= {"StatefulSet/kpo-redis", "Pod/kpo-test-connection"}
    for outsider in (*others, *OUTSIDERS, INGRESS_CONTROLLER, PROMETHEUS, EXTERNAL_RAY):
        assert not connects(policies, outsider, sandbox, port, NAMESPACE), outsider.name


def test_network_policy_stays_without_the_release_policies(helm: str) -> None:
    """networkPolicy.enabled=false drops the release's policies, never the sandbox's."""
    manifests = render(helm, sets=[*ON, "networkPolicy.enabled=false"])
    assert [p["metadata"]["name"] for p in named(manifests, "NetworkPolicy")] == [SANDBOX]
    policies = named(manifests, "NetworkPolicy")
    pods = release_pods(manifests)
    sandbox = pods[f"Deployment/{SANDBOX}"]
    assert not connects(policies, sandbox, KUBE_DNS, 53, NAMESPACE, "UDP")
    assert connects(
        policies, pods[f"RayCluster/{RAY_CLUSTER} worker-gpu"], sandbox, 8090, NAMESPACE
    )
    for outsider in OUTSIDERS:
        assert not connects(policies, outsider, sandbox, 8090, NAMESPACE), outsider.name


def test_an_external_ray_cluster_is_admitted_when_named(helm: str) -> None:
    values = CHART / "ci" / "external-ray-values.yaml"
    manifests = render(helm, [values], sets=ON)
    policies = named(manifests, "NetworkPolicy")
    sandbox = release_pods(manifests)[f"Deployment/{SANDBOX}"]
    assert connects(policies, EXTERNAL_RAY, sandbox, 8090, NAMESPACE)
    for outsider in OUTSIDERS:
        assert not connects(policies, outsider, sandbox, 8090, NAMESPACE), outsider.name
    refused = helm_template(
        helm,
        sets=[
            *ON,
            "ray.cluster.enabled=false",
            "ray.address=http://ray.example:8265",
            "ray.auth.enabled=false",
            "networkPolicy.enabled=false",
        ],
    )
    assert refused.returncode != 0
    assert "sandbox.extraFrom" in refused.stderr


# --- pod, container, probes, token -------------------------------------------------------------


def test_service_account_mounts_no_token(sandbox_on: list[Manifest]) -> None:
    account = one(sandbox_on, "ServiceAccount", SANDBOX)
    assert account["automountServiceAccountToken"] is False
    spec = pod_spec(sandbox_on)
    assert spec["serviceAccountName"] == SANDBOX != CONTROL_PLANE
    assert spec["automountServiceAccountToken"] is False
    # No Role binds it.
    for binding in named(sandbox_on, "RoleBinding"):
        assert all(s["name"] != SANDBOX for s in binding["subjects"])


def test_container_is_unprivileged_and_sees_only_tmp(sandbox_on: list[Manifest]) -> None:
    spec = pod_spec(sandbox_on)
    own = container(sandbox_on)["securityContext"]
    pod = spec["securityContext"]
    assert own["capabilities"]["drop"] == ["ALL"] and not own["capabilities"].get("add")
    assert own["allowPrivilegeEscalation"] is False
    assert own.get("privileged", False) is False
    assert own["readOnlyRootFilesystem"] is True
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 10001
    # What bubblewrap needs, and why (docs/deploy.md): its own user namespace and a fresh /proc
    # (the pod in a user namespace, /proc unmasked), unshare and mount (seccomp and AppArmor).
    assert spec["hostUsers"] is False and own["procMount"] == "Unmasked"
    assert pod["seccompProfile"] == {"type": "Unconfined"}
    assert pod["appArmorProfile"] == {"type": "Unconfined"}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(key), key
    assert spec["enableServiceLinks"] is False
    assert spec["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    assert container(sandbox_on)["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]


def test_seccomp_profile_and_security_context_can_be_overridden(helm: str) -> None:
    manifests = render(
        helm,
        sets=[
            *ON,
            "sandbox.seccompProfile.type=Localhost",
            "sandbox.seccompProfile.localhostProfile=profiles/kpo-sandbox.json",
            "sandbox.appArmorProfile=null",
        ],
    )
    pod = pod_spec(manifests)["securityContext"]
    assert pod["seccompProfile"] == {
        "type": "Localhost",
        "localhostProfile": "profiles/kpo-sandbox.json",
    }
    assert "appArmorProfile" not in pod
    for manifest in manifests:
        validate(manifest)


def test_the_memory_limit_holds_the_calls_worst_case(sandbox_on: list[Manifest]) -> None:
    """Run as a non-root user, a pod's calls share `nproc x maxConcurrency` processes: their
    worst case (services/tools/sandbox.py, `worst_case_mib`) and the server fit the limit, so a
    call at its bounds is not what kills the container."""
    sandbox = container(sandbox_on)
    plain = {
        name.removeprefix("KPO_SANDBOX_").lower(): entry["value"]
        for name, entry in env_of(sandbox).items()
        if name.startswith("KPO_SANDBOX_") and "value" in entry
    }
    settings = SandboxSettings(**plain)
    calls = settings.max_concurrency
    worst = settings.limits().worst_case_mib(settings.nproc * calls, calls) + SERVER_MIB
    limit = sandbox["resources"]["limits"]["memory"]
    assert limit.endswith("Gi")
    assert worst <= float(limit.removesuffix("Gi")) * 1024 < 1.2 * worst, (worst, limit)


def test_probes_hit_the_probe_port_with_a_name_the_server_answers(
    sandbox_on: list[Manifest],
) -> None:
    """Readiness on `/readyz` (it fails when calls cannot start), liveness on `/healthz`, both
    on the probes' own port, with a Host the server accepts (the kubelet's default, the pod's
    address, is refused as any name the server does not know), and the Service's names and
    URL among those it accepts."""
    sandbox = container(sandbox_on)
    ports = {p["name"]: p["containerPort"] for p in sandbox["ports"]}
    plain = {
        name.removeprefix("KPO_SANDBOX_").lower(): entry["value"]
        for name, entry in env_of(sandbox).items()
        if name.startswith("KPO_SANDBOX_") and "value" in entry
    }
    names = SandboxSettings(**plain).host_names("0.0.0.0")
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = sandbox[probe]["httpGet"]
        assert (get["path"], ports[get["port"]]) == (path, 8091), probe
        (host,) = [h["value"] for h in get["httpHeaders"] if h["name"] == "Host"]
        assert host in names, probe
    service_host = f"{SANDBOX}.{NAMESPACE}.svc"
    assert {SANDBOX, service_host, f"{service_host}.cluster.local"} <= names
    assert "10.1.2.3" not in names


def test_token_comes_from_a_secret_never_a_literal(sandbox_on: list[Manifest]) -> None:
    secret = one(sandbox_on, "Secret", TOKEN_SECRET)
    token = base64.b64decode(secret["data"]["sandbox-token"]).decode()
    assert len(token) >= 32
    entry = env_of(container(sandbox_on))["KPO_SANDBOX_TOKEN"]
    assert "value" not in entry
    assert entry["valueFrom"]["secretKeyRef"] == {"name": TOKEN_SECRET, "key": "sandbox-token"}
    # The generation workers send the same token: every Ray container has it from the Secret.
    seen = set()
    for where, ray in ray_containers(sandbox_on):
        if where == "autoscaler":
            continue
        seen.add(where)
        ray_entry = env_of(ray)["KPO_SANDBOX_TOKEN"]
        assert "value" not in ray_entry, where
        assert ray_entry["valueFrom"]["secretKeyRef"] == {
            "name": TOKEN_SECRET,
            "key": "sandbox-token",
        }
    assert seen == {"head", "worker-gpu"}
    # The token is nowhere in plain text but in its Secret.
    text = str([m for m in sandbox_on if m is not secret])
    assert token not in text


def test_existing_token_secret_and_require_existing(helm: str) -> None:
    existing = ["apiToken.existingSecret=api", "redis.auth.existingSecret=redis"]
    existing += ["ray.auth.existingSecret=ray", "secrets.requireExisting=true"]
    refused = helm_template(helm, sets=[*ON, *existing], secrets="chart")
    assert refused.returncode != 0
    assert "sandbox.token.existingSecret" in refused.stderr
    manifests = render(
        helm,
        sets=[*ON, *existing, "sandbox.token.existingSecret=mine", "sandbox.token.secretKey=k"],
        secrets="chart",
    )
    assert named(manifests, "Secret") == []
    ref = env_of(container(manifests))["KPO_SANDBOX_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "mine", "key": "k"}
    # Without the sandbox, requireExisting asks nothing more of it.
    render(helm, sets=existing, secrets="chart")


def test_clusters_without_user_namespaces_by_default_are_refused(helm: str) -> None:
    def at(version: str, *sets: str) -> subprocess.CompletedProcess[str]:
        command = [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        command += ["--kube-version", version, "--set", "secrets.requireExisting=false"]
        for assignment in sets:
            command += ["--set", assignment]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

    old = at("1.32.0", *ON)
    assert old.returncode != 0 and "user namespace" in old.stderr, old.stderr
    assert at("1.32.0").returncode == 0, "only the sandbox needs it"
    assert at("1.33.0", *ON).returncode == 0


def test_helm_lint_strict_with_the_sandbox(helm: str) -> None:
    """`helm lint --strict` (which renders NOTES.txt too, with the URL for tools.sandbox_url)."""
    command = [helm, "lint", "--strict", str(CHART), "--kube-version", "1.35.0", "--set", ON[0]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    notes = (CHART / "templates" / "NOTES.txt").read_text(encoding="utf-8")
    assert 'sandbox_url: {{ include "kpo.sandboxUrl" . }}' in notes
