"""What Ray makes of a RayCluster's node groups: the resources each pod advertises, read by
Ray's own code rather than by a copy of it.

Two readers matter, and a group's `rayStartParams.resources` must satisfy both:

- Ray's autoscaler (in the head pod) reads the RayCluster object and derives one node type per
  group, with the resources its pods will have (`_derive_autoscaling_config_from_ray_cr`, Ray's
  real function, private API); it raises on a `resources` string it cannot read or on an amount
  that is not a whole number.
- Each pod runs `ray start --resources=VALUE`: KubeRay pastes the value as it is after
  `--resources=` into the container's shell command (`convertParamMap` in KubeRay's
  ray-operator/controllers/ray/common/pod.go; its tests expect `--resources='{"TPU":4}'`), the
  shell removes one level of quoting, and Ray's CLI parses the rest (`parse_resources_json`).
"""

from __future__ import annotations

import copy
import shlex
from typing import Any

from ray._private.utils import parse_resources_json
from ray.autoscaler._private.cli_logger import cf, cli_logger
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr,
)

from tests.deploy.manifests import NAMESPACE, Manifest

HEAD_GROUP = "headgroup"  # the autoscaler's name for the head's node type
# Resources Ray puts on every node itself; what is left is the custom ones.
RAY_OWN = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


def node_types(manifest: Manifest) -> dict[str, dict[str, Any]]:
    """The autoscaler's node types of a RayCluster or of a RayJob's cluster, by group name
    (`headgroup` for the head): `resources`, `min_workers`, `max_workers`."""
    spec = manifest["spec"]
    if manifest["kind"] == "RayJob":
        spec = spec["rayClusterSpec"]
    cluster = {
        "metadata": {"name": manifest["metadata"]["name"], "namespace": NAMESPACE},
        "spec": copy.deepcopy(spec),
    }
    config = _derive_autoscaling_config_from_ray_cr(cluster)
    types: dict[str, dict[str, Any]] = config["available_node_types"]
    return types


def custom(resources: dict[str, Any]) -> dict[str, Any]:
    """The custom resources among a node's resources."""
    return {name: amount for name, amount in resources.items() if name not in RAY_OWN}


def ray_start_resources(ray_start_params: dict[str, str]) -> dict[str, float]:
    """The custom resources `ray start` gets from a group's rayStartParams (empty without)."""
    if "resources" not in ray_start_params:
        return {}
    (argument,) = shlex.split(f"--resources={ray_start_params['resources']}")
    resources: dict[str, float] = parse_resources_json(
        argument.removeprefix("--resources="), cli_logger, cf
    )
    return resources
