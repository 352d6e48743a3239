"""deploy/kuberay/rayjob.yaml: a RayJob that runs one run without the control plane. Its objects
validate like the chart's (core kinds strictly, the RayJob by the project's ray.io schema, its
pod templates as PodTemplates), and the run it carries is a valid RunSpec that fits the
cluster the RayJob creates, each role on the worker group that advertises its Ray resource."""

from __future__ import annotations

import inspect
import shlex
from collections import Counter
from pathlib import PurePosixPath
from typing import Any

import yaml

from services.generation.vllm_backend import VLLMBackend
from services.pipeline.actors import resource_needs
from services.spec import RunSpec
from tests.deploy.manifests import REPO, Manifest, load_all, one, pod_templates, validate
from tests.deploy.ray_resources import custom, node_types, ray_start_resources

EXAMPLE = REPO / "deploy" / "kuberay" / "rayjob.yaml"


def manifests() -> list[Manifest]:
    return load_all(EXAMPLE.read_text(encoding="utf-8"))


def test_every_object_validates() -> None:
    docs = manifests()
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "RayJob"]
    for doc in docs:
        validate(doc)


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
