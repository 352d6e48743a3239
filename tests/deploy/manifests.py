"""Rendering the Helm chart and validating Kubernetes objects offline.

Core objects are validated by `kubernetes_validate` (the PyPI package `kubernetes-validate`, the
schemas of every Kubernetes release bundled) in strict mode: an unknown field is an error. The
custom resources the project renders (KubeRay's and the Prometheus Operator's) have no schema
there; they are checked against schemas/*.json, which this project writes for the fields it
uses, and the pod templates inside RayCluster and RayJob objects are validated as core
`PodTemplate` objects. The AlertmanagerConfig is checked against its CRD's own openAPIV3Schema
(schemas/monitoring.coreos.com-v1alpha1-alertmanagerconfigs.json), strictly, as the API server's
field validation does. Any other kind without a schema is a failure, never a warning.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any, Literal

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kpo"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
# The names of the Secret docs/deploy.md has an install create first.
EXISTING_SECRETS = Path(__file__).parent / "existing-secrets-values.yaml"
SCHEMAS = Path(__file__).parent / "schemas"
# The Kubernetes release objects are validated against (and `helm template --kube-version`).
KUBERNETES_VERSION = "1.35.0"
RELEASE = "kpo"
NAMESPACE = "kpo"
# Kinds that kubernetes-validate has no schema for, and the project schema that covers each.
CUSTOM_KINDS = {
    "RayCluster": "ray.io-v1.json",
    "RayJob": "ray.io-v1.json",
    "ServiceMonitor": "monitoring.coreos.com-v1.json",
    "PodMonitor": "monitoring.coreos.com-v1.json",
    "PrometheusRule": "monitoring.coreos.com-v1.json",
}

# Kinds checked against their CRD's own openAPIV3Schema, as the operator publishes it (the
# file's `openAPIV3Schema`; its `group` and `version` give the apiVersion).
CRD_KINDS = {
    "AlertmanagerConfig": "monitoring.coreos.com-v1alpha1-alertmanagerconfigs.json",
}

Manifest = dict[str, Any]
# Where a render's secrets come from (see helm_template).
Secrets = Literal["existing", "generated", "chart"]


def helm_template(
    helm: str,
    values_files: Sequence[Path] = (),
    sets: Sequence[str] = (),
    secrets: Secrets = "existing",
    flags: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """`helm template` of the chart (not checked: callers look at the return code), with more
    `flags` of helm's if given (e.g. `--skip-schema-validation`).

    `secrets`: "existing", from the Secret an install creates first (EXISTING_SECRETS, before
    `values_files`), as the chart requires by default; "generated", made by the chart
    (`secrets.requireExisting=false`, what `helm install` can keep), including those the values
    files leave to the operator's `kpo-secrets` (every ci/*.yaml names it, so that each renders
    on its own); "chart", neither: the values files as they are."""
    command = [
        helm,
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        KUBERNETES_VERSION,
        *flags,
    ]
    if secrets == "generated":
        command += ["--set", "secrets.requireExisting=false"]
        command += [f"--set={path}=" for path in operator_secret_paths(values_files)]
    elif secrets == "existing":
        command += ["--values", str(EXISTING_SECRETS)]
    for path in values_files:
        command += ["--values", str(path)]
    for assignment in sets:
        command += ["--set", assignment]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


# The Secret docs/deploy.md (step 3) has an operator create, and where the values name it.
OPERATOR_SECRET = "kpo-secrets"
SECRET_PATHS = (
    "apiToken.existingSecret",
    "redis.auth.existingSecret",
    "ray.auth.existingSecret",
    "sandbox.token.existingSecret",
    "alerting.token.existingSecret",
)


def operator_secret_paths(values_files: Sequence[Path]) -> list[str]:
    """The SECRET_PATHS that `values_files` set to OPERATOR_SECRET (the last file wins)."""
    found: dict[str, object] = {}
    for path in values_files:
        values = yaml.safe_load(path.read_text()) or {}
        for dotted in SECRET_PATHS:
            node: object = values
            for key in dotted.split("."):
                node = node.get(key) if isinstance(node, dict) else None
            if node is not None:
                found[dotted] = node
    return [dotted for dotted, value in found.items() if value == OPERATOR_SECRET]


def render(
    helm: str,
    values_files: Sequence[Path] = (),
    sets: Sequence[str] = (),
    secrets: Secrets = "existing",
) -> list[Manifest]:
    """The chart's objects for these values; fails the test with helm's message otherwise."""
    result = helm_template(helm, values_files, sets, secrets)
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return load_all(result.stdout)


def load_all(text: str) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def named(manifests: Sequence[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    """The objects of `kind` (and `name`, when given)."""
    return [
        m
        for m in manifests
        if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)
    ]


def one(manifests: Sequence[Manifest], kind: str, name: str | None = None) -> Manifest:
    found = named(manifests, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


# --- validation ------------------------------------------------------------------------------


def validate(manifest: Manifest) -> None:
    """Validate one object: core kinds strictly, custom kinds by the project's schemas with
    their pod templates as core PodTemplates. Raises AssertionError naming the object."""
    kind, name = manifest.get("kind"), manifest.get("metadata", {}).get("name")
    where = f"{kind}/{name}"
    if kind in CRD_KINDS:
        api_version, validator = crd_validator(kind)
        assert manifest.get("apiVersion") == api_version, (
            f"{where}: apiVersion is not {api_version}"
        )
        errors = sorted(validator.iter_errors(manifest), key=lambda e: list(e.absolute_path))
        assert not errors, f"{where}: " + "; ".join(
            f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors
        )
        return
    if kind in CUSTOM_KINDS:
        errors = sorted(
            custom_validator(kind).iter_errors(manifest), key=lambda e: list(e.absolute_path)
        )
        assert not errors, f"{where}: " + "; ".join(
            f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors
        )
        for path, template in pod_templates(manifest):
            validate_core(as_pod_template(template, f"{name}-{path}"), f"{where} {path}")
        autoscaler = autoscaler_pod(manifest)
        if autoscaler is not None:
            validate_core(as_pod_template(autoscaler, f"{name}-autoscaler"), f"{where} autoscaler")
        return
    validate_core(manifest, where)


def validate_core(manifest: Manifest, where: str) -> None:
    try:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError as error:
        raise AssertionError(f"{where}: no schema, an unexpected kind: {error.message}") from None
    except kubernetes_validate.ValidationError as error:
        path = ".".join(map(str, error.path))
        raise AssertionError(f"{where}: {path}: {error.message}") from None


@cache
def custom_validator(kind: str) -> jsonschema.Draft202012Validator:
    """The validator of `kind` in the project's schema file for it (`kinds.<Kind>`)."""
    root = json.loads((SCHEMAS / CUSTOM_KINDS[kind]).read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(root)
    return jsonschema.Draft202012Validator({**root, "$ref": f"#/kinds/{kind}"})


def strict_structural(schema: Any) -> Any:
    """A CRD's structural schema with the API server's strict field validation made explicit:
    an object schema that lists its `properties` and neither admits more
    (`additionalProperties`) nor keeps unknown fields (`x-kubernetes-preserve-unknown-fields`)
    refuses any other field, as `kubectl apply` (server-side field validation `Strict`) does."""
    if not isinstance(schema, dict):
        return schema
    strict = dict(schema)
    if "properties" in schema:
        strict["properties"] = {
            name: strict_structural(child) for name, child in schema["properties"].items()
        }
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            strict["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            strict[key] = strict_structural(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            strict[key] = [strict_structural(child) for child in schema[key]]
    return strict


@cache
def crd_validator(kind: str) -> tuple[str, jsonschema.Draft202012Validator]:
    """The apiVersion of `kind` and a strict validator of its CRD's openAPIV3Schema. OpenAPI's
    own keywords (`x-kubernetes-*`, `format: int32`, `default`) do not constrain JSON Schema;
    the structure, types, enums, patterns and bounds do. (Not `check_schema`: some patterns of
    fields the chart never renders are Go regular expressions that Python's `re` refuses.)"""
    crd = json.loads((SCHEMAS / CRD_KINDS[kind]).read_text(encoding="utf-8"))
    assert crd["kind"] == kind
    schema = strict_structural(crd["openAPIV3Schema"])
    return f"{crd['group']}/{crd['version']}", jsonschema.Draft202012Validator(schema)


def pod_templates(manifest: Manifest) -> Iterator[tuple[str, Manifest]]:
    """(where, pod template) of every Ray node group of a RayCluster or RayJob."""
    spec = manifest.get("spec", {})
    if manifest["kind"] == "RayJob":
        spec = spec.get("rayClusterSpec", {})
    if manifest["kind"] not in ("RayCluster", "RayJob"):
        return
    yield "head", spec["headGroupSpec"]["template"]
    for group in spec.get("workerGroupSpecs", []):
        yield f"worker-{group['groupName']}", group["template"]


# The fields of a RayCluster's `autoscalerOptions` that KubeRay copies into the autoscaler
# container it adds to the head pod.
AUTOSCALER_CONTAINER_FIELDS = ("resources", "securityContext", "volumeMounts", "env", "envFrom")


def autoscaler_pod(manifest: Manifest) -> Manifest | None:
    """The head's pod template with the autoscaler sidecar alone in it, as far as the chart sets
    the sidecar (`autoscalerOptions`); None without the in-tree autoscaler."""
    spec = manifest.get("spec", {})
    if manifest["kind"] == "RayJob":
        spec = spec.get("rayClusterSpec", {})
    if manifest["kind"] not in ("RayCluster", "RayJob") or not spec.get("enableInTreeAutoscaling"):
        return None
    options = spec.get("autoscalerOptions", {})
    container = {"name": "autoscaler", "image": options.get("image", "autoscaler")}
    container |= {key: options[key] for key in AUTOSCALER_CONTAINER_FIELDS if key in options}
    head = spec["headGroupSpec"]["template"]
    return {**head, "spec": {**head["spec"], "containers": [container]}}


def as_pod_template(template: Manifest, name: str) -> Manifest:
    """A pod template spec wrapped as the core object `v1/PodTemplate`."""
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": name},
        "template": template,
    }


def containers(pod_spec: Manifest) -> list[Manifest]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def env_of(container: Manifest) -> dict[str, Manifest]:
    """A container's env entries by name."""
    return {entry["name"]: entry for entry in container.get("env", [])}


def models_mount_path(manifests: Sequence[Manifest]) -> str:
    """Where the Ray containers of the release's RayCluster mount the model directory (the
    `models` volume); empty without a RayCluster."""
    for manifest in manifests:
        for _, template in pod_templates(manifest):
            for mount in template["spec"]["containers"][0].get("volumeMounts", []):
                if mount["name"] == "models":
                    return str(mount["mountPath"])
    return ""
