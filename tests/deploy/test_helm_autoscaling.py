"""The chart's RayCluster autoscaling, which an elastic generation pool (`generation.actors`)
relies on: KubeRay's in-tree autoscaler and each worker group's bounds, from values, as Ray's
own autoscaler reads them."""

from __future__ import annotations

from services.pipeline.actors import resource_needs
from services.spec import RunSpec
from tests.deploy.manifests import one, render
from tests.deploy.ray_resources import custom, node_types

RAY_CLUSTER = "kpo-ray"  # the release the tests render is `kpo`
GENERATION_GROUP = [
    "ray.workerGroups.gen.gpus=1",
    "ray.workerGroups.gen.rayResources.generation_gpu=1",
    "ray.workerGroups.gen.replicas=1",
    "ray.workerGroups.gen.minReplicas=1",
    "ray.workerGroups.gen.maxReplicas=6",
]


def test_autoscaling_on_gives_the_autoscaler_and_the_groups_bounds_from_values(helm: str) -> None:
    cluster = one(
        render(
            helm,
            sets=[
                "ray.autoscaling.enabled=true",
                "ray.autoscaling.idleTimeoutSeconds=120",
                "ray.autoscaling.upscalingMode=Aggressive",
                *GENERATION_GROUP,
            ],
        ),
        "RayCluster",
        RAY_CLUSTER,
    )
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    assert (options["idleTimeoutSeconds"], options["upscalingMode"]) == (120, "Aggressive")
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    gen = groups["gen"]
    assert (gen["replicas"], gen["minReplicas"], gen["maxReplicas"]) == (1, 1, 6)
    # What Ray's autoscaler makes of it: a node type it grows to 6 pods of one generation GPU.
    types = node_types(cluster)
    assert (types["gen"]["min_workers"], types["gen"]["max_workers"]) == (1, 6)
    assert custom(types["gen"]["resources"]) == {"generation_gpu": 1}


def test_an_elastic_runs_max_pool_fits_the_generation_groups_max_pods(helm: str) -> None:
    """An elastic run reserves its `generation.actors.max` workers' resources; the group's
    maxReplicas pods advertise enough of them for the autoscaler to place every one."""
    cluster = one(render(helm, sets=GENERATION_GROUP), "RayCluster", RAY_CLUSTER)
    gen = node_types(cluster)["gen"]
    run = RunSpec.model_validate(
        {
            "generation": {
                "num_workers": 2,
                "num_gpus": 1,
                "resources": {"generation_gpu": 1},
                "actors": {"min": 1, "max": 6},
            }
        }
    )
    wanted = resource_needs(run).custom["generation_gpu"]
    assert wanted == 6
    assert gen["max_workers"] * custom(gen["resources"])["generation_gpu"] >= wanted
    assert gen["min_workers"] * custom(gen["resources"])["generation_gpu"] >= 1  # its min warm


def test_autoscaling_off_leaves_the_groups_fixed(helm: str) -> None:
    cluster = one(
        render(helm, sets=["ray.autoscaling.enabled=false", *GENERATION_GROUP]),
        "RayCluster",
        RAY_CLUSTER,
    )
    assert cluster["spec"]["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in cluster["spec"]
