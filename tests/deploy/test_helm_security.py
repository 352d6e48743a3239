"""The chart's security defaults, each rendered with the real `helm template` and checked for
what it must mean (tests/deploy/test_helm_chart.py has the general checks, and the
NetworkPolicies' ingress and egress):

- Ray's token authentication on every Ray container (head, autoscaler sidecar, every worker
  group, GPU groups included) and on the control plane, whose launcher sends it;
- the store URL on the Ray pods from their own environment (its password from the Secret), never
  in a job's runtime environment nor on any command line; Redis' password from a file, never on
  its command line (run for real with `redis-server`);
- `secrets.requireExisting` for GitOps, and checksum annotations that roll a secret's readers;
- RBAC off and no ServiceAccount token where nothing calls the Kubernetes API;
- image digests; `appendfsync always`; guarded reads, `/docs` off, a metrics port the Ingress
  never routes; the head's `kpo_driver` slots.
"""

from __future__ import annotations

import base64
import hashlib
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from services.api.settings import ApiSettings
from services.jobs.launcher import ray_auth_headers
from services.jobs.ray_head import free_port
from services.jobs.settings import JobSettings
from tests.deploy.manifests import (
    CI_VALUES,
    EXISTING_SECRETS,
    NAMESPACE,
    RELEASE,
    REPO,
    Manifest,
    autoscaler_pod,
    containers,
    env_of,
    helm_template,
    named,
    one,
    pod_templates,
    render,
    validate,
)
from tests.deploy.ray_resources import HEAD_GROUP, custom, node_types, ray_start_resources
from tests.deploy.test_helm_chart import (
    CONTROL_PLANE,
    RAY_CLUSTER,
    control_plane_container,
    every_container,
    pod_specs,
)

CI_NAMES = [path.name for path in CI_VALUES]
RAY_AUTH_SECRET = "kpo-ray-auth"
REDIS_SECRET = "kpo-redis"
DIGEST = "sha256:" + "0123456789abcdef" * 4


def secret_value(manifests: list[Manifest], name: str, key: str) -> str:
    """The decoded value of a Secret the release renders."""
    return base64.b64decode(one(manifests, "Secret", name)["data"][key]).decode()


def ray_containers(manifests: list[Manifest]) -> Iterator[tuple[str, Manifest]]:
    """(where, container) of every Ray container of the release's RayClusters: the head's, each
    worker group's, and KubeRay's autoscaler sidecar (as far as the chart sets it)."""
    for cluster in named(manifests, "RayCluster"):
        for where, template in pod_templates(cluster):
            yield where, template["spec"]["containers"][0]
        autoscaler = autoscaler_pod(cluster)
        if autoscaler is not None:
            yield "autoscaler", autoscaler["spec"]["containers"][0]


def resolved_env(container: Manifest, manifests: list[Manifest]) -> dict[str, str]:
    """A container's environment as Kubernetes would give it: plain values, and secretKeyRefs
    read from the release's Secrets (others are left out)."""
    secrets = {m["metadata"]["name"]: m["data"] for m in named(manifests, "Secret")}
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        if ref and ref["name"] in secrets:
            env[entry["name"]] = base64.b64decode(secrets[ref["name"]][ref["key"]]).decode()
    return env


# --- Ray's token authentication ------------------------------------------------------------------


@pytest.mark.parametrize("values", CI_NAMES)
def test_every_ray_container_has_token_auth(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    """RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from the release's Secret on the head, the
    autoscaler sidecar and every worker group (GPU groups included), and Ray's own reading of
    that environment finds the token."""
    manifests = rendered[values]
    clusters = named(manifests, "RayCluster")
    if not clusters:
        # An existing Ray cluster (ray.address): its pods are not the chart's.
        assert (
            "kpo-ray-head-svc"
            not in one(manifests, "ConfigMap", CONTROL_PLANE)["data"]["RAY_ADDRESS"]
        )
        return
    token = secret_value(manifests, RAY_AUTH_SECRET, "auth_token")
    assert len(token) >= 32
    seen = set()
    for where, container in ray_containers(manifests):
        seen.add(where)
        env = env_of(container)
        assert env["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "token"}, where
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": RAY_AUTH_SECRET,
            "key": "auth_token",
        }, where
        settings = JobSettings.model_validate(resolved_env(container, manifests))
        assert ray_auth_headers(settings) == {"Authorization": f"Bearer {token}"}, where
    groups = [g for c in clusters for g in c["spec"]["workerGroupSpecs"]]
    assert {f"worker-{g['groupName']}" for g in groups} | {"head"} <= seen
    gpu_groups = [
        g
        for g in groups
        if g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
    ]
    assert gpu_groups, "every ci release has GPU worker groups"
    # The model downloads need no Ray token.
    for cluster in clusters:
        for where, template in pod_templates(cluster):
            for init in template["spec"].get("initContainers", []):
                assert "RAY_AUTH_TOKEN" not in env_of(init), (where, init["name"])


@pytest.mark.parametrize("values", CI_NAMES)
def test_control_plane_sends_the_ray_token(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    """The control plane has the token its Ray cluster wants, and the launcher's header reader
    (`ray_auth_headers`) turns its environment into `Authorization: Bearer <token>`."""
    manifests = rendered[values]
    container = control_plane_container(manifests)
    env = env_of(container)
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    if named(manifests, "RayCluster"):
        assert ref == {"name": RAY_AUTH_SECRET, "key": "auth_token"}
        token = secret_value(manifests, RAY_AUTH_SECRET, "auth_token")
        settings = JobSettings.model_validate(resolved_env(container, manifests))
        assert ray_auth_headers(settings) == {"Authorization": f"Bearer {token}"}
    else:
        assert ref == {"name": "shared-ray-auth", "key": "auth_token"}  # that cluster's token


def test_ray_auth_values(helm: str) -> None:
    """An existing Secret replaces the generated one; off is explicit (`disabled`) everywhere;
    an existing Ray cluster needs its token's Secret."""
    existing = render(helm, sets=["ray.auth.existingSecret=my-ray-token", "ray.auth.secretKey=t"])
    assert not named(existing, "Secret", RAY_AUTH_SECRET)
    for where, container in [*ray_containers(existing), ("cp", control_plane_container(existing))]:
        ref = env_of(container)["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "my-ray-token", "key": "t"}, where

    off = render(helm, sets=["ray.auth.enabled=false"])
    assert not named(off, "Secret", RAY_AUTH_SECRET)
    for where, container in [*ray_containers(off), ("cp", control_plane_container(off))]:
        env = env_of(container)
        assert env["RAY_AUTH_MODE"]["value"] == "disabled" and "RAY_AUTH_TOKEN" not in env, where
    for where, values in checksums(off).items():
        assert "checksum/secret-ray-auth" not in values, where

    result = helm_template(
        helm,
        values_files=[path for path in CI_VALUES if path.name == "external-ray-values.yaml"],
        sets=["ray.auth.existingSecret="],
    )
    assert result.returncode != 0
    assert "set ray.auth.existingSecret" in result.stderr, result.stderr


# --- the store URL and passwords: never in a job's environment, never on a command line -----------


@pytest.mark.parametrize("values", CI_NAMES)
def test_store_url_reaches_ray_pods_from_the_secret(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    """Every Ray container has KPO_STORE_URL in its own environment, its password a `$(VAR)` of
    a secretKeyRef variable defined before it (Kubernetes expands it in the pod; the manifest
    holds no password), so the launcher is told to leave it out of the jobs' runtime
    environments (KPO_PASS_STORE_URL_TO_JOBS=false), where Ray's dashboard would show it."""
    manifests = rendered[values]
    config = one(manifests, "ConfigMap", CONTROL_PLANE)["data"]
    clusters = named(manifests, "RayCluster")
    if not clusters:
        # Another cluster's pods: the launcher keeps passing the URL (its default).
        assert "KPO_PASS_STORE_URL_TO_JOBS" not in config
        return
    assert config["KPO_PASS_STORE_URL_TO_JOBS"] == "false"
    control_plane = env_of(control_plane_container(manifests))
    for where, container in ray_containers(manifests):
        if where == "autoscaler":
            assert "KPO_STORE_URL" not in env_of(container)  # it reports nothing
            continue
        env = env_of(container)
        names = list(env)
        url = env["KPO_STORE_URL"]
        assert url == control_plane["KPO_STORE_URL"], where  # the control plane's store
        password = re.search(r"://:(.*)@", url.get("value", ""))
        if password is None:
            assert values == "gpu-sizes-values.yaml", where  # redis.auth.enabled=false
            continue
        reference = re.fullmatch(r"\$\((\w+)\)", password.group(1))
        assert reference, where
        variable = env[reference.group(1)]
        assert "secretKeyRef" in variable["valueFrom"], where
        assert names.index(reference.group(1)) < names.index("KPO_STORE_URL"), where
        if values == "default-values.yaml":
            assert variable["valueFrom"]["secretKeyRef"] == {
                "name": REDIS_SECRET,
                "key": "redis-password",
            }
            resolved = resolved_env(container, manifests)
            expanded = url["value"].replace(password.group(1), resolved[reference.group(1)])
            assert expanded == (
                f"redis://:{secret_value(manifests, REDIS_SECRET, 'redis-password')}"
                "@kpo-redis:6379/0"
            )


def walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every node of a manifest."""
    yield path, node
    if isinstance(node, dict):
        for key, child in node.items():
            yield from walk(child, f"{path}.{key}")
    elif isinstance(node, list):
        for index, child in enumerate(node):
            yield from walk(child, f"{path}[{index}]")


@pytest.mark.parametrize("values", CI_NAMES)
def test_no_secret_in_a_job_environment_or_on_a_command_line(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    """No rendered object holds a runtime environment carrying the store URL or a secret, and
    no container's command or arguments hold a secret, the store URL, a `$(VAR)` of a secret
    variable, or a Redis password flag."""
    manifests = rendered[values]
    secrets = [
        base64.b64decode(value).decode()
        for secret in named(manifests, "Secret")
        for value in secret["data"].values()
    ]
    secret_variables = {
        entry["name"]
        for _, _, spec in pod_specs(manifests)
        for container in containers(spec)
        for entry in container.get("env", [])
        if "secretKeyRef" in entry.get("valueFrom", {})
    }
    assert {"KPO_REDIS_PASSWORD", "RAY_AUTH_TOKEN"} & secret_variables
    for manifest in manifests:
        for path, node in walk(manifest):
            key = path.rsplit(".", 1)[-1]
            if re.search(r"runtime_?env", key, re.I):
                text = yaml.safe_dump(node)
                assert "KPO_STORE_URL" not in text and "PASSWORD" not in text.upper(), path
                assert not any(secret in text for secret in secrets), path
    for where, _, container in every_container(manifests):
        words = [str(w) for w in (*container.get("command", []), *container.get("args", []))]
        for word in words:
            assert not any(secret in word for secret in secrets), f"{where}: a secret in argv"
            assert "KPO_STORE_URL" not in word and "redis://" not in word, where
            assert not re.search(r"--requirepass|--masterauth", word), where
            for reference in re.findall(r"\$\((\w+)\)", word):
                assert reference not in secret_variables, f"{where}: $({reference}) in argv"


def redis_parts(manifests: list[Manifest]) -> tuple[str, Manifest, Manifest]:
    """redis.conf, the `redis-auth` init container and the Redis container of a release."""
    conf = one(manifests, "ConfigMap", "kpo-redis")["data"]["redis.conf"]
    pod = one(manifests, "StatefulSet", "kpo-redis")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (server,) = pod["containers"]
    return conf, init, server


def test_redis_password_is_a_file_never_an_argument(helm: str, tmp_path: Path) -> None:
    """The chart's own pieces, run for real: the init container's script writes `requirepass`
    from the Secret's file (mode 0600), and a `redis-server` started with the chart's redis.conf
    and arguments then wants the password, while its command line holds none."""
    server_binary = shutil.which("redis-server")
    assert server_binary, "redis-server is not on PATH: apt-get install redis-server"
    manifests = render(helm, secrets="generated")
    conf, init, server = redis_parts(manifests)
    password = secret_value(manifests, REDIS_SECRET, "redis-password")
    assert server["args"] == ["/etc/redis/redis.conf"]
    assert "REDIS_PASSWORD" not in env_of(server)
    mounts = {m["name"]: m for m in init["volumeMounts"]}
    assert mounts["redis-secret"]["readOnly"] is True
    pod = one(manifests, "StatefulSet", "kpo-redis")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["redis-secret"]["secret"]["items"] == [
        {"key": "redis-password", "path": "password"}
    ]
    assert volumes["redis-auth"]["emptyDir"]["medium"] == "Memory"

    # The init container's script, on this machine's shell, with the pod's paths moved here.
    secret_dir, auth_dir, data_dir = tmp_path / "secret", tmp_path / "auth", tmp_path / "data"
    for directory in (secret_dir, auth_dir, data_dir):
        directory.mkdir()
    (secret_dir / "password").write_text(password)

    def moved(text: str) -> str:
        return text.replace("/etc/redis-secret", str(secret_dir)).replace(
            "/run/redis-auth", str(auth_dir)
        )

    assert init["command"] == ["sh", "-c"]
    (script,) = init["args"]
    subprocess.run(["sh", "-c", moved(script)], check=True, timeout=30)
    auth_file = auth_dir / "auth.conf"
    assert auth_file.read_text() == f'requirepass "{password}"\n'
    assert auth_file.stat().st_mode & 0o777 == 0o600

    # A password the config syntax would misread is refused, not half-written.
    (secret_dir / "password").write_text('pass"word')
    auth_file.unlink()
    bad = subprocess.run(["sh", "-c", moved(script)], capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "double quote" in bad.stderr and not auth_file.exists()
    (secret_dir / "password").write_text(password + "\n")  # a trailing newline is dropped
    subprocess.run(["sh", "-c", moved(script)], check=True, timeout=30)
    assert auth_file.read_text() == f'requirepass "{password}"\n'

    # redis-server with the chart's config (on loopback, a free port, this test's directories).
    port = free_port()
    config = moved(conf).replace("dir /data", f"dir {data_dir}")
    config = config.replace("bind 0.0.0.0 -::*", "bind 127.0.0.1").replace(
        "port 6379", f"port {port}"
    )
    (tmp_path / "redis.conf").write_text(config)
    process = subprocess.Popen(
        [server_binary, str(tmp_path / "redis.conf"), *server["args"][1:]],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port, password=password, socket_timeout=2)
        deadline = time.monotonic() + 20
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        # Without the password, every command is refused (a bare socket: redis-py would retry).
        with socket.create_connection(("127.0.0.1", port), timeout=2) as bare:
            bare.sendall(b"SET k v\r\n")
            assert bare.recv(256).startswith(b"-NOAUTH"), "Redis answered without a password"
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode()
        assert password not in cmdline and "requirepass" not in cmdline
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)


def test_redis_fsync_policy(helm: str) -> None:
    """`appendfsync always` by default (every acknowledged write is on disk); `everysec` when
    asked for; nothing else."""
    conf, _, _ = redis_parts(render(helm))
    assert "appendfsync always" in conf.splitlines()
    conf, _, _ = redis_parts(render(helm, sets=["redis.builtin.appendfsync=everysec"]))
    assert "appendfsync everysec" in conf.splitlines()
    result = helm_template(helm, sets=["redis.builtin.appendfsync=no"])
    assert result.returncode != 0 and "redis.builtin.appendfsync" in result.stderr


# --- GitOps: secrets that must exist, and checksums that roll their readers -----------------------


def test_require_existing_refuses_generated_secrets(helm: str) -> None:
    """By default (secrets.requireExisting) the chart refuses to render, naming each value to
    set and the command that creates the Secret, until every secret is an existing one; then it
    generates none and renders the same manifests every time."""
    result = helm_template(helm, secrets="chart")
    assert result.returncode != 0
    assert (
        "secrets.requireExisting is true, so set apiToken.existingSecret, "
        "redis.auth.existingSecret, ray.auth.existingSecret:" in result.stderr
    ), result.stderr
    assert (
        f"kubectl -n {NAMESPACE} create secret generic kpo-secrets "
        '--from-literal=token="$(openssl rand -hex 32)"' in result.stderr
    ), result.stderr
    # One command, a distinct value for each key the chart reads by default.
    keys = re.findall(r'--from-literal=([\w-]+)=\\?"\$\(openssl rand -hex 32\)', result.stderr)
    assert sorted(keys) == ["auth_token", "redis-password", "sandbox-token", "token"], keys
    partial = helm_template(helm, sets=["apiToken.existingSecret=api"], secrets="chart")
    assert partial.returncode != 0
    assert "set redis.auth.existingSecret, ray.auth.existingSecret:" in partial.stderr
    assert "apiToken.existingSecret," not in partial.stderr
    # The values of the one command docs/deploy.md gives (tests/deploy/existing-secrets-values).
    manifests = render(helm)
    assert not named(manifests, "Secret")
    for manifest in manifests:
        validate(manifest)
    for path in CI_VALUES:
        assert not named(render(helm, [path]), "Secret"), path.name
    # Two renders without the cluster are the same release: nothing random in them.
    assert helm_template(helm).stdout == helm_template(helm).stdout
    # A secret the release does not use is not asked for.
    unused = ["apiToken.existingSecret=api", "redis.auth.enabled=false", "ray.auth.enabled=false"]
    assert helm_template(helm, sets=unused, secrets="chart").returncode == 0
    # Turned off, the chart generates them (and `helm upgrade` keeps them, through `lookup`).
    generated = render(helm, secrets="generated")
    assert {m["metadata"]["name"] for m in named(generated, "Secret")} == {
        "kpo-api-token",
        REDIS_SECRET,
        RAY_AUTH_SECRET,
    }


def test_install_docs_create_the_secrets_the_chart_requires() -> None:
    """docs/deploy.md's one command creates a Secret with each key the existing-secret values
    name, and its values snippet names that Secret."""
    docs = (REPO / "docs" / "deploy.md").read_text(encoding="utf-8")
    start = docs.index("kubectl -n kpo create secret generic kpo-secrets")
    lines = []
    for line in docs[start:].splitlines():  # the command, with its continuation lines
        lines.append(line)
        if not line.endswith("\\"):
            break
    command = " ".join(lines)
    keys = set(re.findall(r"--from-literal=([\w-]+)=", command))
    values = yaml.safe_load(EXISTING_SECRETS.read_text(encoding="utf-8"))
    assert keys == {"token", "redis-password", "auth_token", "sandbox-token"}
    assert values["apiToken"]["existingSecret"] == "kpo-secrets"
    assert values["redis"]["auth"]["existingSecret"] == "kpo-secrets"
    assert values["ray"]["auth"]["existingSecret"] == "kpo-secrets"


def checksums(manifests: list[Manifest]) -> dict[str, dict[str, str]]:
    """The `checksum/secret-*` annotations of every pod template, by where it is."""
    result: dict[str, dict[str, str]] = {}
    for where, meta, _ in pod_specs(manifests):
        if where.startswith("Pod/"):
            continue  # the `helm test` pods run once
        result[where] = {
            key: value
            for key, value in (meta.get("annotations") or {}).items()
            if key.startswith("checksum/secret-")
        }
    return result


def test_checksums_roll_every_reader_of_a_secret(helm: str) -> None:
    """Redis, the control plane and every Ray pod carry the checksum of each secret they read:
    the same value on each, that of the Secret's content for a generated one (consistent within
    a render), of the Secret's name and key for an existing one."""
    manifests = render(helm, secrets="generated")
    found = checksums(manifests)
    expected_keys = {
        f"Deployment/{CONTROL_PLANE}": {
            "checksum/secret-api-token",
            "checksum/secret-redis",
            "checksum/secret-ray-auth",
        },
        "StatefulSet/kpo-redis": {"checksum/secret-redis"},
        f"RayCluster/{RAY_CLUSTER} head": {"checksum/secret-redis", "checksum/secret-ray-auth"},
        f"RayCluster/{RAY_CLUSTER} worker-gpu": {
            "checksum/secret-redis",
            "checksum/secret-ray-auth",
        },
    }
    assert {where: set(keys) for where, keys in found.items()} == expected_keys
    for secret, key, annotation in (
        ("kpo-api-token", "token", "checksum/secret-api-token"),
        (REDIS_SECRET, "redis-password", "checksum/secret-redis"),
        (RAY_AUTH_SECRET, "auth_token", "checksum/secret-ray-auth"),
    ):
        data = one(manifests, "Secret", secret)["data"][key]
        digest = hashlib.sha256(f"{secret}/{key}:{data}".encode()).hexdigest()
        for where, values in found.items():
            if annotation in values:
                assert values[annotation] == digest, (where, annotation)

    # Existing Secrets: the checksum follows the name (their content is not the chart's to read).
    def existing(redis_secret: str, ray_secret: str) -> dict[str, dict[str, str]]:
        return checksums(
            render(
                helm,
                sets=[
                    "apiToken.existingSecret=api",
                    f"redis.auth.existingSecret={redis_secret}",
                    f"ray.auth.existingSecret={ray_secret}",
                ],
            )
        )

    first, same, renamed = existing("a", "r"), existing("a", "r"), existing("b", "r2")
    assert first == same
    for where in expected_keys:
        for annotation in first[where]:
            changed = first[where][annotation] != renamed[where][annotation]
            assert changed == (annotation != "checksum/secret-api-token"), (where, annotation)
    redis_digest = hashlib.sha256(b"a/redis-password").hexdigest()
    assert first["StatefulSet/kpo-redis"]["checksum/secret-redis"] == redis_digest
    # Without a Redis password, no checksum of it.
    no_auth = checksums(render(helm, sets=["redis.auth.enabled=false"]))
    assert not any("checksum/secret-redis" in values for values in no_auth.values())


# --- RBAC and ServiceAccount tokens ---------------------------------------------------------------


@pytest.mark.parametrize("values", CI_NAMES)
def test_no_rbac_and_no_token_where_nothing_calls_the_api(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    """No Role or binding by default, and no pod mounts a ServiceAccount token but the Ray head
    when KubeRay's autoscaler sidecar runs in it (it scales the RayCluster)."""
    manifests = rendered[values]
    for kind in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
        assert not named(manifests, kind), kind
    autoscaled = any(
        cluster["spec"].get("enableInTreeAutoscaling") for cluster in named(manifests, "RayCluster")
    )
    for where, _, spec in pod_specs(manifests):
        if where == f"RayCluster/{RAY_CLUSTER} head" and autoscaled:
            assert spec.get("automountServiceAccountToken", True) is True, where
        else:
            assert spec.get("automountServiceAccountToken") is False, where


# --- images ---------------------------------------------------------------------------------------


def test_images_by_digest(helm: str) -> None:
    """A digest makes every image of its component `repository@digest` (the tag unused)."""
    manifests = render(
        helm,
        sets=[
            f"controlPlane.image.digest={DIGEST}",
            f"ray.image.digest={DIGEST}",
            f"redis.builtin.image.digest={DIGEST}",
            "ray.models.prefetch[0].repo=Qwen/Qwen2.5-0.5B-Instruct",
            "networkPolicy.egress.internet.cidrs={0.0.0.0/0}",
        ],
    )
    images = {where: c["image"] for where, _, c in every_container(manifests) if "image" in c}
    assert images
    for where, image in images.items():
        if "autoscaler" in where:
            continue  # KubeRay's: the head's image unless autoscalerOptions.image says
        repository = (
            "redis"
            if "redis" in where
            else "kpo-gpu-worker"
            if where.startswith("RayCluster/")
            else "kpo-control-plane"
        )
        assert image == f"{repository}@{DIGEST}", where
    default = {where: c["image"] for where, _, c in every_container(render(helm)) if "image" in c}
    assert default[f"Deployment/{CONTROL_PLANE} control-plane"] == "kpo-control-plane:0.1.0"
    # The built-in Redis is pinned by default: the official index of redis:7.4.2-alpine.
    assert default["StatefulSet/kpo-redis redis"] == (
        "redis@sha256:02419de7eddf55aa5bcf49efb74e88fa8d931b4d77c07eff8a6b2144472b6952"
    )
    bad = helm_template(helm, sets=["ray.image.digest=sha256:short"])
    assert bad.returncode != 0 and "ray.image.digest" in bad.stderr


# --- the control plane's API: guarded reads, no /docs, a metrics port of its own ------------------


def test_reads_guarded_docs_off_and_runs_capped(rendered: dict[str, list[Manifest]]) -> None:
    config = one(rendered["default-values.yaml"], "ConfigMap", CONTROL_PLANE)["data"]
    assert config["KPO_AUTH_READS"] == "true"
    assert config["KPO_OPENAPI_DOCS"] == "false"
    assert config["KPO_MAX_ACTIVE_RUNS"] == "8"
    assert ApiSettings.model_validate(config).auth_reads is True
    assert ApiSettings.model_validate(config).tracking_servers() == frozenset()


@pytest.mark.parametrize("path", CI_VALUES, ids=[p.name for p in CI_VALUES])
def test_every_ci_values_file_renders_on_its_own(helm: str, path: Path) -> None:
    """As chart-testing runs them (`ct lint`/`ct install` over ci/*.yaml, one file each): no
    overlay, the chart's defaults (secrets.requireExisting), every object valid."""
    manifests = render(helm, [path], secrets="chart")
    assert manifests
    for manifest in manifests:
        validate(manifest)


def test_the_sandbox_token_has_a_key_of_its_own(helm: str) -> None:
    on = ["sandbox.enabled=true"]
    manifests = render(helm, sets=on)
    deployment = one(manifests, "Deployment", CONTROL_PLANE)["spec"]["template"]["spec"]
    [api_volume] = [v for v in deployment["volumes"] if v["name"] == "api-token"]
    sandbox = one(manifests, "Deployment", f"{RELEASE}-sandbox")["spec"]["template"]["spec"]
    sandbox_ref = env_of(sandbox["containers"][0])["KPO_SANDBOX_TOKEN"]["valueFrom"]
    # One Secret, two keys: the API reads `token` (the file its volume mounts), the sandbox
    # and every Ray pod `sandbox-token`.
    assert api_volume["secret"]["secretName"] == sandbox_ref["secretKeyRef"]["name"]
    assert api_volume["secret"]["secretName"] == "kpo-secrets"
    assert sandbox_ref["secretKeyRef"]["key"] == "sandbox-token"
    same = helm_template(helm, sets=[*on, "sandbox.token.secretKey=token"])
    assert same.returncode != 0 and "sandbox.token names the API token" in same.stderr
    generated = render(helm, sets=on, secrets="generated")
    names = {m["metadata"]["name"] for m in named(generated, "Secret")}
    assert {"kpo-api-token", f"{RELEASE}-sandbox-token"} <= names


def test_sandbox_urls_reach_the_control_plane(helm: str) -> None:
    """The API accepts the chart's own sandbox (and the operator's others) in a run's
    tools.sandbox_url, and no other."""
    extra = "controlPlane.sandboxUrls={https://tools.example:8443}"
    manifests = render(helm, sets=["sandbox.enabled=true", extra])
    config = one(manifests, "ConfigMap", CONTROL_PLANE)["data"]
    own = f"http://{RELEASE}-sandbox.{NAMESPACE}.svc:8090"
    assert config["KPO_SANDBOX_URLS"] == f"{own},https://tools.example:8443"
    allowed = ApiSettings.model_validate(config).allowlist().sandbox_servers
    assert allowed == {own, "https://tools.example:8443"}
    off = one(render(helm), "ConfigMap", CONTROL_PLANE)["data"]
    assert ApiSettings.model_validate(off).allowlist().sandbox_servers == frozenset()
    bad = helm_template(helm, sets=["controlPlane.sandboxUrls={http://x:1/path}"])
    assert bad.returncode != 0 and "sandboxUrls" in bad.stderr


def test_tracking_hosts_reach_the_control_plane(helm: str) -> None:
    manifests = render(helm, sets=["controlPlane.trackingHosts={mlflow.internal:5000,mlflow.b}"])
    config = one(manifests, "ConfigMap", CONTROL_PLANE)["data"]
    assert config["KPO_TRACKING_HOSTS"] == "mlflow.internal:5000,mlflow.b"
    servers = ApiSettings.model_validate(config).tracking_servers()
    assert servers == {"mlflow.internal:5000", "mlflow.b"}
    bad = helm_template(helm, sets=["controlPlane.trackingHosts={http://x/}"])
    assert bad.returncode != 0 and "trackingHosts" in bad.stderr


@pytest.mark.parametrize("values", CI_NAMES)
def test_metrics_port_is_scraped_and_never_routed(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    """/metrics on a port of its own (KPO_METRICS_PORT), exposed by the Service as `metrics`,
    scraped there by the ServiceMonitor, and routed by no Ingress rule."""
    manifests = rendered[values]
    config = one(manifests, "ConfigMap", CONTROL_PLANE)["data"]
    container = control_plane_container(manifests)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "http": 8000,
        "metrics": int(config["KPO_METRICS_PORT"]),
        "probes": int(config["KPO_PROBE_PORT"]),
    }
    assert ports["metrics"] != ports["http"]
    service = {p["name"]: p for p in one(manifests, "Service", CONTROL_PLANE)["spec"]["ports"]}
    assert service["metrics"]["targetPort"] == "metrics"
    for ingress in named(manifests, "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                port = path["backend"]["service"]["port"]
                assert port in ({"name": "http"}, {"number": service["http"]["port"]}), port
    for monitor in named(manifests, "ServiceMonitor"):
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    if values == "external-redis-values.yaml":
        assert named(manifests, "Ingress"), "this ci release has an Ingress"


@pytest.mark.parametrize("values", CI_NAMES)
def test_probes_use_a_port_the_apis_connection_limit_does_not_bound(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    """Every probe of the control plane is on the probe port (KPO_PROBE_PORT), which neither
    the Service nor the Ingress exposes: clients holding the API's connections (past
    KPO_MAX_CONCURRENCY) cannot make the kubelet restart the pod."""
    manifests = rendered[values]
    config = one(manifests, "ConfigMap", CONTROL_PLANE)["data"]
    container = control_plane_container(manifests)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["probes"] == ApiSettings.model_validate(config).probe_port
    assert len(set(ports.values())) == len(ports)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == "probes", probe
    service = one(manifests, "Service", CONTROL_PLANE)["spec"]["ports"]
    assert "probes" not in {p["name"] for p in service}
    assert ports["probes"] not in {p["targetPort"] for p in service}


def test_the_probe_port_must_be_its_own_and_trusted_proxies_reach_the_api(helm: str) -> None:
    for taken in (8000, 9090):  # the API's port, the metrics'
        result = helm_template(helm, sets=[f"controlPlane.probes.port={taken}"])
        assert result.returncode != 0
        assert "controlPlane.probes.port: the probes need a port of their own" in result.stderr
    proxies = "10.0.0.0/8,fd00::/8"
    escaped = proxies.replace(",", "\\,")  # --set splits lists at unescaped commas
    manifests = render(helm, sets=[f"controlPlane.trustedProxies={escaped}"])
    config = one(manifests, "ConfigMap", CONTROL_PLANE)["data"]
    assert config["KPO_TRUSTED_PROXIES"] == proxies
    assert len(ApiSettings.model_validate(config).proxy_networks()) == 2
    default = one(render(helm), "ConfigMap", CONTROL_PLANE)["data"]
    assert "KPO_TRUSTED_PROXIES" not in default  # the peer is the client


# --- the head's driver slots ----------------------------------------------------------------------


def test_head_advertises_driver_slots(helm: str) -> None:
    """The head's `resources` rayStartParam holds `kpo_driver` (ray.head.driverSlots), which
    Ray's autoscaler and `ray start` both read; the control plane is told its name."""
    manifests = render(helm, sets=["ray.head.driverSlots=3", "controlPlane.maxActiveRuns=3"])
    cluster = one(manifests, "RayCluster", RAY_CLUSTER)
    params = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert params["resources"] == """'{"kpo_driver":3}'"""
    assert ray_start_resources(params) == {"kpo_driver": 3}
    assert custom(node_types(cluster)[HEAD_GROUP]["resources"]) == {"kpo_driver": 3}
    config = one(manifests, "ConfigMap", CONTROL_PLANE)["data"]
    assert config["KPO_RAY_DRIVER_RESOURCE"] == "kpo_driver"
    for group in cluster["spec"]["workerGroupSpecs"]:
        assert "kpo_driver" not in group["rayStartParams"].get("resources", "")
    refused = helm_template(helm, sets=["ray.head.rayStartParams.resources='{}'"])
    assert refused.returncode != 0 and "ray.head: remove rayStartParams.resources" in (
        refused.stderr
    )
    assert helm_template(helm, sets=["ray.head.driverSlots=0"]).returncode != 0


@pytest.mark.parametrize("max_runs", [0, 9])
def test_more_active_runs_than_driver_slots_is_refused(helm: str, max_runs: int) -> None:
    """A run the API accepts must get a driver slot: past the slots its job would wait in Ray's
    queue and fail after Ray's start timeout."""
    sets = ["ray.head.driverSlots=8", f"controlPlane.maxActiveRuns={max_runs}"]
    refused = helm_template(helm, sets=sets)
    assert refused.returncode != 0
    assert "controlPlane.maxActiveRuns" in refused.stderr and "ray.head.driverSlots (8)" in (
        refused.stderr
    )
    assert (
        helm_template(
            helm, sets=["ray.head.driverSlots=8", "controlPlane.maxActiveRuns=8"]
        ).returncode
        == 0
    )


def test_external_ray_gets_no_driver_resource(rendered: dict[str, list[Manifest]]) -> None:
    """Another cluster's head advertises no `kpo_driver`: the control plane is not told to
    reserve one there."""
    config = one(rendered["external-ray-values.yaml"], "ConfigMap", CONTROL_PLANE)["data"]
    assert "KPO_RAY_DRIVER_RESOURCE" not in config
