"""The paths of a run spec sent over HTTP: only inside the control plane's inputs folder.

A run spec names files that the run's driver and actors read: `model` (a Hugging Face model
directory, unless it is a built-in name or a hub id), `task.path` (a prompt file) and the vLLM
`tokenizer` option. From a local run file (`kpo run`) these may be any path: users read their
own files. Over the API any client could otherwise have the cluster read any file it can reach,
and see parts of it in the run's error message, so a spec sent over HTTP may name only:

- a built-in model (`tiny-arith`) or a hub id (`org/name`, downloaded into the Hugging Face
  cache, not read from the file system) for `model`;
- a relative path without `..`, read from `<KPO_DATA_DIR>/inputs/`; the stored spec holds the
  absolute path, so the job reads exactly that file and the client sees which one;
- an absolute path already inside that folder (what a stored spec holds, so it can be resent).

Anything else (an absolute path elsewhere, `..`, `~`, backslashes, control characters) is a 422
naming the field. Links inside the folder are followed: its contents are the operator's choice,
never a client's. The other string options of the generation backend may not look like a path
that leaves the folder (absolute, `~`, `..`) either; `generation.engine` takes no path at all
(its allowlist, services/generation/engine_args.py, holds no argument that names a file).
Trackers write only into the run's own directory (their folders left out) or to an MLflow
server the operator allows (KPO_TRACKING_HOSTS). Tool calls go only to a sandbox server the
operator lists (KPO_SANDBOX_URLS: scheme, host and port; no credentials, path, query or
fragment), carrying only a token variable the operator allows (KPO_SANDBOX_TOKEN_ENVS,
`KPO_SANDBOX_TOKEN` by default): the generation workers send that variable's value as a bearer
token to that URL, so a client that could name both would have any worker secret sent anywhere.
A model whose config the control plane can read (a folder in the inputs, a hub model already in
its cache, and transformers installed) is checked as `kpo run` checks it
(`model_family_problem`): a family the learner cannot train is a 422 naming `model`, not a job
that fails at its first step.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from fastapi.exceptions import RequestValidationError

from services.spec import DatasetTask, JsonlTask, RunSpec
from services.tasks.models import is_hub_id
from services.tasks.registry import BUILTIN_MODELS

INPUTS_DIR_NAME = "inputs"
# Backend options whose value is read as a file or folder (VllmBackend's `tokenizer`).
PATH_OPTIONS = frozenset({"tokenizer"})


class PathRefused(ValueError):
    """A path field of a spec sent over HTTP that the API does not read; says why."""


class SandboxUrlRefused(str):
    """Why a sandbox URL is not a server's origin (returned, not raised, by sandbox_origin)."""


@dataclass(frozen=True)
class OperatorAllowlist:
    """What a spec sent over HTTP may name outside the inputs folder (services/api/settings.py
    reads it from the server's environment): MLflow servers (`host` or `host:port`, lowercase),
    sandbox servers (origins, as `sandbox_origin` writes them) and the environment variables a
    sandbox token may be read from."""

    tracking_servers: frozenset[str] = frozenset()
    sandbox_servers: frozenset[str] = frozenset()
    sandbox_token_envs: frozenset[str] = frozenset({"KPO_SANDBOX_TOKEN"})


def inputs_dir(data_dir: Path) -> Path:
    """Where paths of specs sent over HTTP are read: `<data dir>/inputs`, as jobs see it.

    Resolved as the launcher resolves the data directory it hands to jobs (`KPO_DATA_DIR`).
    """
    return Path(data_dir).expanduser().resolve() / INPUTS_DIR_NAME


def confined_spec(
    spec: RunSpec, inputs: Path, allowed: OperatorAllowlist = OperatorAllowlist()
) -> dict[str, Any]:
    """`spec` as JSON, with each path made absolute inside `inputs`.

    Raises RequestValidationError (a 422 naming each refused field) for a path outside it, or
    a tracking server, sandbox server or sandbox token variable that `allowed` does not list.
    """
    data = spec.model_dump(mode="json")
    errors: list[dict[str, Any]] = []
    relative = f"a path relative to {inputs}"

    def confine(loc: tuple[str, ...], value: str, expected: str = relative) -> str:
        try:
            return confine_path(value, inputs)
        except PathRefused as error:
            errors.append(_error(loc, f"{error}; give {expected}"))
            return value

    if spec.model not in BUILTIN_MODELS and not _names_a_hub_model(spec.model, inputs):
        builtin = ", ".join(BUILTIN_MODELS)
        refused = len(errors)
        data["model"] = confine(
            ("model",), spec.model, f"a built-in model ({builtin}), a hub id or {relative}"
        )
        if len(errors) == refused:  # inside the inputs: its config may be read
            errors.extend(_model_errors(spec, Path(data["model"])))
    elif spec.model not in BUILTIN_MODELS:
        errors.extend(_model_errors(spec, _cached_hub_model(spec.model, spec.model_revision)))
    if isinstance(spec.task, JsonlTask | DatasetTask):
        data["task"]["path"] = confine(("task", "path"), spec.task.path)
    if isinstance(spec.task, DatasetTask) and spec.task.eval_path is not None:
        data["task"]["eval_path"] = confine(("task", "eval_path"), spec.task.eval_path)
    for key, value in spec.generation.options.items():
        loc = ("generation", "options", key)
        if key in PATH_OPTIONS and isinstance(value, str):
            data["generation"]["options"][key] = confine(loc, value)
        elif isinstance(value, str) and _leaves_folder(value):
            message = "not a path option: it may not be absolute or hold '~', '..' or '\\'"
            errors.append(_error(loc, message))
    errors.extend(_tracking_errors(spec, allowed.tracking_servers))
    errors.extend(_sandbox_errors(spec, allowed))
    if errors:
        raise RequestValidationError(errors)
    return data


def _model_errors(spec: RunSpec, model_dir: Path | None) -> list[dict[str, Any]]:
    """The 422 of a model whose family the run cannot train, where its config is at hand
    here (`model_dir`, a folder in the inputs or a hub snapshot in the cache)."""
    if model_dir is None or not (model_dir / "config.json").is_file():
        return []  # read by the job's own check, before any actor starts
    from services.pipeline.specs import model_family_problem

    try:
        problem = model_family_problem(spec, model_dir)
    except ImportError:
        # A control plane installed from its lock has no transformers (nor torch): the job's
        # own check reads the config instead, before any actor starts.
        return []
    return [] if problem is None else [_error(("model",), problem)]


def _cached_hub_model(repo_id: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of hub model `repo_id` holding its config, if the control
    plane's Hugging Face cache has one (nothing is downloaded here)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # a control plane installed from its lock: the job reads the config
        return None
    cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    return Path(cached).parent if isinstance(cached, str) else None


def _tracking_errors(spec: RunSpec, servers: frozenset[str]) -> list[dict[str, Any]]:
    """Trackers write files: over the API only into the run's own directory (their default),
    and MLflow only to one of the operator's `servers`, never to a file store the client names
    nor to another host (the tracker's credentials come from the server's environment)."""
    errors = []
    tracking = spec.tracking
    folders = {
        ("tracking", "wandb", "dir"): tracking.wandb and tracking.wandb.dir,
        ("tracking", "tensorboard", "log_dir"): tracking.tensorboard
        and tracking.tensorboard.log_dir,
    }
    for loc, value in folders.items():
        if value:
            errors.append(
                _error(loc, "leave it out over the API: the run writes it in its own directory")
            )
    uri = tracking.mlflow and tracking.mlflow.tracking_uri
    if uri:
        refused = _refused_server(uri, servers)
        if refused:
            errors.append(_error(("tracking", "mlflow", "tracking_uri"), refused))
    return errors


def _sandbox_errors(spec: RunSpec, allowed: OperatorAllowlist) -> list[dict[str, Any]]:
    """The worker sends the variable `sandbox_token_env` names to `sandbox_url` with every
    call: over the API both must be the operator's wherever a URL is named (checked whether or
    not tools are enabled, so that a stored spec never holds a pair that a later edit could
    switch on). Without a URL the variable is sent nowhere, so any name passes: an operator
    who lists other variables does not refuse every spec that keeps the default."""
    errors: list[dict[str, Any]] = []
    tools = spec.tools
    if tools.sandbox_url is None:
        return errors
    origin = sandbox_origin(tools.sandbox_url)
    if isinstance(origin, SandboxUrlRefused):
        errors.append(_error(("tools", "sandbox_url"), origin))
    elif origin not in allowed.sandbox_servers:
        listed = ", ".join(sorted(allowed.sandbox_servers)) or "none (KPO_SANDBOX_URLS is unset)"
        message = f"{origin} is not one of the sandbox servers the operator allows: {listed}"
        errors.append(_error(("tools", "sandbox_url"), message))
    if tools.sandbox_token_env not in allowed.sandbox_token_envs:
        listed = ", ".join(sorted(allowed.sandbox_token_envs)) or "none"
        message = (
            f"{tools.sandbox_token_env} is not a sandbox token variable the operator allows "
            f"(KPO_SANDBOX_TOKEN_ENVS): {listed}"
        )
        errors.append(_error(("tools", "sandbox_token_env"), message))
    return errors


def sandbox_origin(url: str) -> str | SandboxUrlRefused:
    """`url` as `scheme://host:port` (host lowercase, an IPv6 address in brackets, the
    scheme's port when none is given), or why it is not a sandbox server's address: only a
    scheme, a host and a port, with no credentials, path, query or fragment."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as error:  # a port that is not a number, a bracket left open
        return SandboxUrlRefused(f"not a valid URL: {error}")
    if parts.scheme not in ("http", "https") or not host:
        return SandboxUrlRefused("a sandbox server is http(s)://host:port")
    if parts.username is not None or parts.password is not None:
        return SandboxUrlRefused("credentials do not go in the URL")
    if parts.path not in ("", "/") or parts.query or parts.fragment or "?" in url or "#" in url:
        return SandboxUrlRefused("a sandbox server's URL has no path, query or fragment")
    name = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{name}:{port or (443 if parts.scheme == 'https' else 80)}"


def _refused_server(uri: str, servers: frozenset[str]) -> str | None:
    """Why the tracking server `uri` is refused over the API; None if it is one of `servers`."""
    try:
        parts = urlsplit(uri)
        host, port = parts.hostname, parts.port
    except ValueError as error:  # a port that is not a number, a bracket left open
        return f"not a valid URL: {error}"
    if parts.scheme not in ("http", "https") or not host:
        return "over the API an MLflow tracking URI is a server (http or https)"
    if parts.username is not None or parts.password is not None:
        return "credentials do not go in the URI: the server's environment holds them"
    # urlsplit lowercases the host and drops an IPv6 address's brackets; KPO_TRACKING_HOSTS
    # writes them as a URL does.
    name = f"[{host}]" if ":" in host else host
    if name in servers or (port is not None and f"{name}:{port}" in servers):
        return None
    allowed = ", ".join(sorted(servers)) or "none (KPO_TRACKING_HOSTS is unset)"
    return f"{name} is not one of the tracking servers the operator allows: {allowed}"


def _names_a_hub_model(model: str, inputs: Path) -> bool:
    """A hub id (`org/name`) that names no folder in `inputs`: downloaded into the cache, not
    read from the file system."""
    return is_hub_id(model) and not (inputs / model).is_dir()


def confine_path(value: str, inputs: Path) -> str:
    """The absolute path inside `inputs` that `value` names; PathRefused if it names none."""
    if any(char == "\\" or unicodedata.category(char) == "Cc" for char in value):
        raise PathRefused("backslashes and control characters are not allowed in paths")
    if value.startswith("~"):
        raise PathRefused("home folders ('~') are not read over the API")
    path = PurePosixPath(value)
    if path.is_absolute():
        if not path.is_relative_to(inputs):
            raise PathRefused(f"absolute paths outside {inputs} are not read over the API")
        path = path.relative_to(inputs)
    if ".." in path.parts:
        raise PathRefused("'..' is not allowed in paths sent over the API")
    if not path.parts:
        raise PathRefused(f"the path names {inputs} itself, not a file or folder in it")
    return str(inputs / path)


def _leaves_folder(value: str) -> bool:
    path = PurePosixPath(value)
    return path.is_absolute() or value.startswith("~") or ".." in path.parts or "\\" in value


def _error(loc: tuple[str, ...], message: str) -> dict[str, Any]:
    # The shape of pydantic's errors, so the API's 422 handler names the field like any other.
    return {"type": "value_error", "loc": ("body", *loc), "msg": message, "input": None}
