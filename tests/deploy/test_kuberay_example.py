"""deploy/kuberay/rayjob.yaml: a RayJob that runs one run without the control plane. Its objects
validate like the chart's (core kinds strictly, the RayJob by the project's ray.io schema, its
pod templates as PodTemplates), and the run it carries is a valid RunSpec that fits the
cluster the RayJob creates, each role on the worker group that advertises its Ray resource. Its
dashboard listens on every address of the head pod, so Ray's token authentication is on in every
pod that runs or talks to Ray (the submitter's included), the token from the Secret the file
tells to create, and no secret is in what Ray's job API shows of the job."""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from services.generation.vllm_backend import VLLMBackend
from services.pipeline.actors import resource_needs
from services.spec import RunSpec
from tests.deploy.manifests import (
    REPO,
    Manifest,
    as_pod_template,
    containers,
    env_of,
    load_all,
    one,
    pod_templates,
    validate,
    validate_core,
)
from tests.deploy.ray_resources import custom, node_types, ray_start_resources

EXAMPLE = REPO / "deploy" / "kuberay" / "rayjob.yaml"


def manifests() -> list[Manifest]:
    return load_all(EXAMPLE.read_text(encoding="utf-8"))


def test_every_object_validates() -> None:
    docs = manifests()
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "RayJob"]
    for doc in docs:
        validate(doc)
    # The submitter's pod, which `validate` does not reach: a core PodTemplate like the others.
    job = one(docs, "RayJob")
    submitter = as_pod_template(job["spec"]["submitterPodTemplate"], "kpo-gpu-demo-submitter")
    validate_core(submitter, "RayJob/kpo-gpu-demo submitter")


def test_the_run_file_is_a_valid_run_spec_mounted_where_the_entrypoint_reads_it() -> None:
    docs = manifests()
    config_map = one(docs, "ConfigMap")
    spec = RunSpec.model_validate(yaml.safe_load(config_map["data"]["run.yaml"]))
    assert spec.generation.backend == "vllm" and spec.learner.device == "cuda"
    # Backend options become the backend's constructor arguments: each must be one.
    parameters = inspect.signature(VLLMBackend.__init__).parameters
    assert set(spec.generation.options) <= set(parameters), spec.generation.options
    job = one(docs, "RayJob")
    command = shlex.split(job["spec"]["entrypoint"])
    assert command[:2] == ["kpo", "run"]
    run_file = PurePosixPath(command[2])
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    volume = next(
        v
        for v in head["volumes"]
        if v.get("configMap", {}).get("name") == config_map["metadata"]["name"]
    )
    mount = next(m for m in head["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
    assert run_file.parent == PurePosixPath(mount["mountPath"])
    assert run_file.name in config_map["data"]


def test_the_cluster_holds_the_runs_gpus() -> None:
    docs = manifests()
    spec = RunSpec.model_validate(yaml.safe_load(one(docs, "ConfigMap")["data"]["run.yaml"]))
    job = one(docs, "RayJob")
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    gpus = 0
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus += group["maxReplicas"] * int(limits.get("nvidia.com/gpu", 0))
    # Each actor reserves whole GPUs here, one per pod: the pods must hold them all.
    assert resource_needs(spec).gpus <= gpus
    assert len(list(pod_templates(job))) == 1 + len(cluster["workerGroupSpecs"])


def actors(spec: RunSpec) -> list[tuple[str, dict[str, float]]]:
    """(role, what one actor reserves) for every actor of the run, by Ray resource name."""

    def needs(
        cpus: float, gpus: float = 0.0, resources: dict[str, float] | None = None
    ) -> dict[str, float]:
        return {"CPU": cpus, "GPU": gpus, **(resources or {})}

    gen, reward, learner = spec.generation, spec.reward, spec.learner
    return [
        *[("learner", needs(learner.num_cpus, learner.num_gpus, learner.resources))]
        * learner.world_size,
        *[("generation", needs(gen.num_cpus, gen.num_gpus, gen.resources))] * gen.num_workers,
        *[("reward", needs(reward.num_cpus))] * reward.num_workers,
    ]


def place(
    actors: list[tuple[str, dict[str, float]]], types: dict[str, dict[str, Any]]
) -> Counter[tuple[str, str]]:
    """How many actors of each role land on each group: every actor on the first pod with room
    left for all it reserves, over maxReplicas pods of each group (and the head's one pod).
    Fails naming the first actor that fits nowhere."""
    pods = [
        (group, dict(node["resources"]))
        for group, node in types.items()
        for _ in range(max(node["max_workers"], 1))  # the head: max_workers 0, one pod
    ]
    placed: Counter[tuple[str, str]] = Counter()
    for role, needs in actors:
        fits = [
            (group, free)
            for group, free in pods
            if all(free.get(name, 0) >= amount for name, amount in needs.items())
        ]
        assert fits, f"no pod has room left for a {role} actor reserving {needs}"
        group, free = fits[0]
        for name, amount in needs.items():
            free[name] = free.get(name, 0) - amount
        placed[role, group] += 1
    return placed


def test_each_role_lands_on_the_group_that_advertises_its_resource() -> None:
    """The learner asks for `learner_gpu`, which only the learner group advertises, and vLLM for
    `generation_gpu`, only on the generation group, as Ray's autoscaler and `ray start` read the
    groups; and every actor of the run fits on the cluster's pods."""
    docs = manifests()
    spec = RunSpec.model_validate(yaml.safe_load(one(docs, "ConfigMap")["data"]["run.yaml"]))
    assert spec.learner.resources == {"learner_gpu": 1}
    assert spec.generation.resources == {"generation_gpu": 1}
    job = one(docs, "RayJob")
    types = node_types(job)
    for group in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        advertised = custom(types[group["groupName"]]["resources"])
        assert ray_start_resources(group["rayStartParams"]) == advertised
    advertisers = {
        name: {group for group, node in types.items() if name in node["resources"]}
        for name in ("learner_gpu", "generation_gpu")
    }
    assert advertisers == {"learner_gpu": {"learner"}, "generation_gpu": {"generation"}}

    placed = place(actors(spec), types)
    assert placed["learner", "learner"] == spec.learner.world_size
    assert placed["generation", "generation"] == spec.generation.num_workers


# --- Ray's token authentication, and no secret in the job ------------------------------------


def ray_pods(job: Manifest) -> list[tuple[str, Manifest]]:
    """(where, pod spec) of every pod of the RayJob: each node group's, and the submitter's."""
    pods = [(where, template["spec"]) for where, template in pod_templates(job)]
    return [*pods, ("submitter", job["spec"]["submitterPodTemplate"]["spec"])]


def header() -> str:
    """The file's leading comment, without the `#`s, continued lines joined."""
    lines = []
    for line in EXAMPLE.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.removeprefix("#").strip())
    return re.sub(r"\\\n\s*", " ", "\n".join(lines))


def created_secret() -> tuple[str, str]:
    """(name, key) of the Secret that the file's instructions create for Ray's token."""
    commands = re.findall(r"^kubectl create secret generic .*$", header(), re.M)
    assert len(commands) == 1, commands
    words = shlex.split(commands[0])
    literals = [w.split("=", 1)[1] for w in words if w.startswith("--from-literal=")]
    assert len(literals) == 1, words
    key, _, value = literals[0].partition("=")
    # A random token made on the spot (as `ray get-auth-token --generate` makes: 32 random
    # bytes in hex), never one written in the file.
    assert value == "$(openssl rand -hex 32)", value
    return words[4], key


def test_token_auth_on_every_ray_pod_and_the_submitter() -> None:
    """RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from the Secret the instructions create, on every
    container of the head, of each worker group and of the submitter, whose pod KubeRay uses as
    it is (K8sJobMode) and completes with its `ray job submit` command. The head's dashboard and
    job API listen beyond loopback only because of that."""
    secret, key = created_secret()
    assert re.search(r"access to Ray's job API is code execution", header(), re.I)
    job = one(manifests(), "RayJob")
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert job["spec"].get("submissionMode", "K8sJobMode") == "K8sJobMode"
    submitter = job["spec"]["submitterPodTemplate"]["spec"]
    assert submitter["restartPolicy"] == "Never"  # a Job's pod; KubeRay's default too
    assert "command" not in submitter["containers"][0]  # KubeRay fills in `ray job submit`
    pods = ray_pods(job)
    assert [where for where, _ in pods] == [
        "head",
        *[f"worker-{g['groupName']}" for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]],
        "submitter",
    ]
    for where, pod in pods:
        for container in containers(pod):
            env = env_of(container)
            assert env.get("RAY_AUTH_MODE") == {"name": "RAY_AUTH_MODE", "value": "token"}, where
            assert env.get("RAY_AUTH_TOKEN") == {
                "name": "RAY_AUTH_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": secret, "key": key}},
            }, where  # not `optional`: without the Secret the pod does not start
            assert "RAY_AUTH_TOKEN_PATH" not in env, where


def resolved_env(container: Manifest, secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """A container's environment as Kubernetes gives it, with these Secret values."""
    env = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = secrets[ref["name"], ref["key"]]
    return env


RAY_HEADERS = (
    "import json\n"
    "from ray._private.authentication.http_token_authentication import (\n"
    "    get_auth_headers_if_auth_enabled,\n"
    ")\n"
    "print(json.dumps(get_auth_headers_if_auth_enabled({})))\n"
)


def ray_auth_headers(env: dict[str, str], home: Path) -> dict[str, str]:
    """The headers Ray's own HTTP clients (`ray job submit`, the dashboard client) send with
    this environment, as Ray reads it in a fresh process (no ~/.ray/auth_token in `home`)."""
    result = subprocess.run(
        [sys.executable, "-c", RAY_HEADERS],
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(home), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    headers: dict[str, str] = json.loads(result.stdout.strip().splitlines()[-1])
    return headers


def test_ray_reads_the_secrets_token_in_every_pod(tmp_path: Path) -> None:
    """Ray itself, given each container's environment with the Secret's value, sends
    `Authorization: Bearer <the Secret's token>`; and nothing without the variables (so the
    check can fail)."""
    secret, key = created_secret()
    token = "0123456789abcdef" * 4
    job = one(manifests(), "RayJob")
    seen = set()
    for where, pod in ray_pods(job):
        env = resolved_env(pod["containers"][0], {(secret, key): token})
        env = {k: v for k, v in env.items() if k.startswith("RAY_")}
        if json.dumps(env, sort_keys=True) in seen:
            continue  # the worker groups share one pod template
        seen.add(json.dumps(env, sort_keys=True))
        assert ray_auth_headers(env, tmp_path) == {"authorization": f"Bearer {token}"}, where
    assert len(seen) == 1  # one and the same token everywhere
    assert ray_auth_headers({}, tmp_path) == {}


SECRET_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|CREDENTIAL|KEY", re.I)
CREDENTIALS_IN_URL = re.compile(r"://[^/@\s]*:([^/@\s]+)@")


def test_no_secret_in_the_job_or_in_a_literal_value() -> None:
    """Ray's job API shows a job's entrypoint and runtime environment: neither holds the store
    URL, a URL with credentials or a secret variable. Every secret variable of every pod comes
    from a Secret (secretKeyRef), and a URL's password may only be a `$(VAR)` of one (the
    chart's KPO_STORE_URL)."""
    job = one(manifests(), "RayJob")
    shown = [job["spec"]["entrypoint"]]
    if "runtimeEnvYAML" in job["spec"]:
        runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"]) or {}
        shown.append(yaml.safe_dump(runtime_env))
        assert not any(SECRET_NAME.search(n) for n in runtime_env.get("env_vars", {}))
    for text in shown:
        assert "KPO_STORE_URL" not in text and "redis://" not in text and "rediss://" not in text
        assert not CREDENTIALS_IN_URL.search(text), text
    for where, pod in ray_pods(job):
        for container in containers(pod):
            env = env_of(container)
            from_secrets = {n for n, e in env.items() if "secretKeyRef" in e.get("valueFrom", {})}
            assert "RAY_AUTH_TOKEN" in from_secrets, where
            for name, entry in env.items():
                if SECRET_NAME.search(name):
                    assert name in from_secrets, f"{where}: {name} is not from a Secret"
                password = CREDENTIALS_IN_URL.search(str(entry.get("value", "")))
                if password:
                    reference = re.fullmatch(r"\$\((\w+)\)", password.group(1))
                    assert reference and reference.group(1) in from_secrets, f"{where}: {name}"
            words = [*container.get("command", []), *container.get("args", [])]
            assert not any("redis://" in str(w) or "TOKEN" in str(w) for w in words), where
