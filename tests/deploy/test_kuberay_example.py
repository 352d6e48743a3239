"""deploy/kuberay/rayjob.yaml: a RayJob that runs one run without the control plane. Its objects
validate like the chart's (core kinds strictly, the RayJob by the project's ray.io schema, its
pod templates as PodTemplates), and the run it carries is a valid RunSpec that fits the
cluster the RayJob creates."""

from __future__ import annotations

import inspect
import shlex
from pathlib import PurePosixPath

import yaml

from kpo_core.config import RunSpec
from services.generation.vllm_backend import VLLMBackend
from services.pipeline.actors import resource_needs
from tests.deploy.manifests import REPO, Manifest, load_all, one, pod_templates, validate

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
