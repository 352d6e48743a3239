"""The chart's Ray pods as GPU work needs them, checked offline on the rendered objects.

- Sizes: a worker group of N GPUs (one vLLM engine at tensor_parallel_size N, or N learner ranks)
  gets N times one GPU's CPU, memory and /dev/shm unless it sets its own; /dev/shm is a
  memory-backed emptyDir with a sizeLimit below the memory limit (its pages are the pod's
  memory), and Ray's object store is capped below it so that NCCL and vLLM's tensor-parallel
  workers keep some of it.
- The model directory: every Ray pod mounts it at the same path (the driver checks a run's model
  on the head, the learner and generation load it on the workers), by default inside the folder
  the API reads the paths of specs from; `prefetch` downloads models into it before Ray starts,
  once on the head for a shared claim, on every pod for emptyDirs; the download arguments are
  checked against the real `hf` command line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.api.spec_paths import confine_path, inputs_dir
from tests.deploy.manifests import (
    CI_VALUES,
    Manifest,
    env_of,
    named,
    one,
    pod_templates,
    render,
    validate,
)
from tests.deploy.ray_resources import node_types

CI_NAMES = [path.name for path in CI_VALUES]
RAY_CLUSTER = "kpo-ray"
GIB = 2**30
UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
UNITS |= {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_bytes(quantity: str) -> int:
    """Bytes of a whole-number Kubernetes quantity (16Gi, 500M, 1024)."""
    match = re.fullmatch(r"(\d+)(k|Ki|M|Mi|G|Gi|T|Ti)?", quantity)
    assert match, f"not a whole-number quantity: {quantity}"
    return int(match.group(1)) * UNITS[match.group(2) or ""]


def ray_pods(cluster: Manifest) -> dict[str, Manifest]:
    """Pod template specs of a RayCluster: `head` and `worker-<group>`."""
    return {where: template["spec"] for where, template in pod_templates(cluster)}


def start_params(cluster: Manifest) -> dict[str, dict[str, str]]:
    """rayStartParams by the same keys as `ray_pods`."""
    spec = cluster["spec"]
    params = {"head": spec["headGroupSpec"]["rayStartParams"]}
    for group in spec["workerGroupSpecs"]:
        params[f"worker-{group['groupName']}"] = group["rayStartParams"]
    return params


def volume(pod: Manifest, name: str) -> Manifest:
    (found,) = [v for v in pod["volumes"] if v["name"] == name]
    assert isinstance(found, dict)
    return found


def mount(container: Manifest, name: str) -> Manifest:
    (found,) = [m for m in container["volumeMounts"] if m["name"] == name]
    assert isinstance(found, dict)
    return found


def sizes(pod: Manifest) -> tuple[str, str, str, str]:
    """(cpu requested, memory requested, memory limit, /dev/shm size) of a Ray pod."""
    resources = pod["containers"][0]["resources"]
    return (
        resources["requests"]["cpu"],
        resources["requests"]["memory"],
        resources["limits"]["memory"],
        volume(pod, "shm")["emptyDir"]["sizeLimit"],
    )


# --- sizes, /dev/shm and the object store ----------------------------------------------------


@pytest.mark.parametrize("values", CI_NAMES)
def test_every_ray_pod_has_a_memory_backed_dev_shm_within_its_memory(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    for cluster in named(rendered[values], "RayCluster"):
        params = start_params(cluster)
        for where, pod in ray_pods(cluster).items():
            shm = volume(pod, "shm")["emptyDir"]
            assert shm["medium"] == "Memory", where
            assert mount(pod["containers"][0], "shm")["mountPath"] == "/dev/shm", where
            _, requested, limit, shm_size = sizes(pod)
            # Pages of /dev/shm are the pod's memory and cannot be reclaimed: the pod gets what
            # it may use (requests = limits), and /dev/shm leaves room for the processes.
            assert requested == limit, where
            assert quantity_bytes(shm_size) < quantity_bytes(limit), where
            store = int(params[where]["object-store-memory"])
            assert store == quantity_bytes(shm_size) * 75 // 100, where


def test_gpu_worker_sizes_scale_with_the_gpus(rendered: dict[str, list[Manifest]]) -> None:
    """One GPU's worth by default; a 4-GPU group (tensor_parallel_size 4) four times that; a
    group's own sizes win; Ray's autoscaler sees the memory the pods get."""
    default = ray_pods(one(rendered["default-values.yaml"], "RayCluster", RAY_CLUSTER))
    assert sizes(default["worker-gpu"]) == ("8", "64Gi", "64Gi", "16Gi")

    cluster = one(rendered["models-values.yaml"], "RayCluster", RAY_CLUSTER)
    pods = ray_pods(cluster)
    assert sizes(pods["worker-tp4"]) == ("32", "256Gi", "256Gi", "64Gi")
    assert pods["worker-tp4"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert sizes(pods["worker-gpu"]) == ("8", "64Gi", "64Gi", "16Gi")
    assert start_params(cluster)["worker-tp4"]["object-store-memory"] == str(48 * GIB)
    tp4 = node_types(cluster)["tp4"]["resources"]
    assert (tp4["CPU"], tp4["GPU"], tp4["memory"]) == (32, 4, 256 * GIB)

    sized = ray_pods(one(rendered["gpu-sizes-values.yaml"], "RayCluster", RAY_CLUSTER))
    assert sizes(sized["worker-learner-8gpu"]) == ("64", "512Gi", "512Gi", "64Gi")
    assert sizes(sized["worker-gen-1gpu"]) == ("8", "64Gi", "64Gi", "16Gi")


def test_sizes_a_group_sets_itself_win(helm: str, tmp_path: Path) -> None:
    """A memory limit alone also sets the request; a group's perGpu, shmSize and
    object-store-memory replace the defaults; a group without GPUs is one GPU's worth."""
    # From a values file, where Helm reads numbers as floats (1e+09 unless the chart says).
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "ray": {
                    "workerGroups": {
                        "small": {
                            "gpus": 2,
                            "shmSize": "3Gi",
                            "rayStartParams": {"object-store-memory": 1_000_000_000},
                        }
                    }
                }
            }
        ),
        encoding="utf-8",
    )
    cluster = one(
        render(
            helm,
            [values],
            sets=[
                "ray.workerGroups.gpu.gpus=2",
                "ray.workerGroups.gpu.resources.limits.memory=100Gi",
                "ray.workerGroups.gpu.perGpu.shmGi=4",
                "ray.workerGroups.cpu.gpus=0",
            ],
        ),
        "RayCluster",
        RAY_CLUSTER,
    )
    validate(cluster)
    pods, params = ray_pods(cluster), start_params(cluster)
    assert sizes(pods["worker-gpu"]) == ("16", "100Gi", "100Gi", "8Gi")
    assert sizes(pods["worker-small"]) == ("16", "128Gi", "128Gi", "3Gi")
    assert params["worker-small"]["object-store-memory"] == "1000000000"
    assert sizes(pods["worker-cpu"]) == ("8", "64Gi", "64Gi", "16Gi")
    assert "nvidia.com/gpu" not in pods["worker-cpu"]["containers"][0]["resources"]["limits"]


# --- the model directory ---------------------------------------------------------------------


@pytest.mark.parametrize("values", CI_NAMES)
def test_every_ray_pod_mounts_the_model_directory_at_one_path(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    manifests = rendered[values]
    data_dir = one(manifests, "ConfigMap", "kpo-control-plane")["data"]["KPO_DATA_DIR"]
    for cluster in named(manifests, "RayCluster"):
        pods = ray_pods(cluster)
        assert "head" in pods and len(pods) > 1  # the head and at least one group
        paths, sources = set(), []
        for where, pod in pods.items():
            models = mount(pod["containers"][0], "models")
            assert models.get("readOnly") is True, where  # only the prefetch containers write
            paths.add(models["mountPath"])
            source = {k: v for k, v in volume(pod, "models").items() if k != "name"}
            sources.append(source)
        assert len(paths) == 1, paths
        (path,) = paths
        # By default the folder a spec sent over the API names models from: `model:
        # models/<repo>` resolves, on the control plane, to a path inside this mount.
        inputs = inputs_dir(Path(data_dir))
        assert path == str(inputs / "models")
        assert confine_path("models/Qwen/Qwen2.5-0.5B", inputs).startswith(path + "/")
        if "persistentVolumeClaim" in sources[0]:
            assert all(s == sources[0] for s in sources), "pods on different claims"
        else:
            assert all(set(s) == {"emptyDir"} and s["emptyDir"]["sizeLimit"] for s in sources)


def test_a_shared_claim_is_filled_once_by_the_head(rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered["models-values.yaml"]
    claim = one(manifests, "PersistentVolumeClaim", "kpo-models")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["storageClassName"] == "nfs-client"
    assert claim["spec"]["resources"]["requests"]["storage"] == "500Gi"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    pods = ray_pods(one(manifests, "RayCluster", RAY_CLUSTER))
    path = "/data/kpo/inputs/models"
    for where, pod in pods.items():
        assert volume(pod, "models")["persistentVolumeClaim"] == {"claimName": "kpo-models"}
        if where != "head":
            # Workers start after the head's GCS, so after its init containers filled the claim.
            assert not pod.get("initContainers"), where
    prefetch = pods["head"]["initContainers"]
    assert [c["name"] for c in prefetch] == ["prefetch-0", "prefetch-1"]
    assert [c["command"] + c["args"] for c in prefetch] == [
        [
            "hf",
            "download",
            "Qwen/Qwen2.5-7B-Instruct",
            "--revision",
            "a09a35458c702b33eeacc393d103063234e8bc28",
            "--local-dir",
            f"{path}/Qwen/Qwen2.5-7B-Instruct",
        ],
        [
            "hf",
            "download",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--revision",
            "main",
            "--local-dir",
            f"{path}/meta-llama/Llama-3.1-8B-Instruct",
        ],
    ]
    for container in prefetch:
        assert {"name": "models", "mountPath": path} in container["volumeMounts"]  # writable
        token = env_of(container)["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token == {"name": "hf-token", "key": "token"}
    assert not named(rendered["default-values.yaml"], "PersistentVolumeClaim")


def test_prefetch_into_emptydirs_runs_on_every_ray_pod(helm: str) -> None:
    manifests = render(
        helm,
        sets=[
            "ray.models.prefetch[0].repo=Qwen/Qwen2.5-0.5B-Instruct",
            "ray.workerGroups.tp2.gpus=2",
            # The downloads need HTTPS out of the Ray pods (the chart refuses without).
            "networkPolicy.egress.internet.cidrs={0.0.0.0/0}",
        ],
    )
    for manifest in manifests:
        validate(manifest)
    assert not named(manifests, "PersistentVolumeClaim")
    pods = ray_pods(one(manifests, "RayCluster", RAY_CLUSTER))
    assert set(pods) == {"head", "worker-gpu", "worker-tp2"}
    for where, pod in pods.items():
        (container,) = pod["initContainers"]
        assert container["args"][:2] == ["download", "Qwen/Qwen2.5-0.5B-Instruct"], where
        assert "HF_TOKEN" not in env_of(container), where  # no Secret named
        assert volume(pod, "models")["emptyDir"] == {"sizeLimit": "100Gi"}, where


def test_prefetch_arguments_are_what_the_hf_command_accepts(
    rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    """Each prefetch container's command line, run through the real `hf` (huggingface_hub's, a
    dependency of transformers, which the image has too) as a dry run in offline mode: it gets
    past the argument parser (a usage error exits 2 and names the option) and stops only where
    it would reach the Hub."""
    hf = Path(sys.executable).parent / "hf"
    assert hf.exists(), f"{hf}: huggingface_hub's command line is not installed"
    pods = ray_pods(one(rendered["models-values.yaml"], "RayCluster", RAY_CLUSTER))
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    environment.pop("HF_TOKEN", None)
    for container in pods["head"]["initContainers"]:
        args = list(container["args"])
        args[args.index("--local-dir") + 1] = str(tmp_path / container["name"])
        result = subprocess.run(
            [str(hf), *args, "--dry-run"],
            capture_output=True,
            text=True,
            timeout=120,
            env=environment,
            check=False,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 1, output
        assert "No such option" not in output and "offline mode is enabled" in output, output
