"""Reading a run spec from a YAML file with `--set key=value` overrides, and checking it early.

Every problem is a `SpecError` whose message names the file and the key (and, from pydantic, the
valid values), so the command line can print it as one line instead of a traceback.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kpo_core.config import describe_validation_error
from services.pipeline.held_out import NoHeldOutPrompts, held_out_prompts
from services.pipeline.prompts import PromptStream, chats_strings
from services.spec import RunSpec
from services.tasks import PromptFileError
from services.tasks.models import ModelDirError, check_tokenizer, has_chat_template, resolve_model


class SpecError(ValueError):
    """A run spec that cannot be used; the message says where and why."""


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """The mapping at the top of a YAML file."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise SpecError(f"{path}: cannot read: {error}") from None
    except yaml.YAMLError as error:
        raise SpecError(f"{path}: invalid YAML: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError(
            f"{path}: expected a mapping of keys at the top level, got {type(data).__name__}"
        )
    return data


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `data` with each `dotted.key=value` set; values are parsed as YAML scalars."""
    result: dict[str, Any] = yaml.safe_load(yaml.safe_dump(data))  # a deep copy of plain data
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set {item!r}: expected key=value, e.g. pipeline.steps=20")
        parts = key.strip().split(".")
        node = result
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise SpecError(f"--set {item!r}: {where} is a value, not a section")
            node = child
        node[parts[-1]] = _parse_value(item, raw)
    return result


def _parse_value(item: str, raw: str) -> Any:
    """A YAML scalar, except that `1e-3` is a number (YAML 1.1 reads it as a string)."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise SpecError(f"--set {item!r}: the value is not valid YAML: {error}") from None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def parse_run_spec(data: dict[str, Any], source: str) -> RunSpec:
    try:
        return RunSpec.model_validate(data)
    except ValidationError as error:
        raise SpecError(describe_validation_error(error, source)) from None


def load_run_spec(path: Path, overrides: Sequence[str] = ()) -> RunSpec:
    """Validate the YAML run file at `path` with `overrides` applied."""
    return parse_run_spec(apply_overrides(read_yaml_mapping(path), overrides), str(path))


def model_family_problem(spec: RunSpec, model_dir: Path) -> str | None:
    """Why the run cannot train the model in `model_dir` (its family's layers, or packing it as
    `learner.pack_rows: true` asks), read from its config alone, no weights loaded; None if it
    can. The learner and the hf engine serve every family this passes."""
    # Imported here: the control plane (`kpo serve`, the API) runs without torch or
    # transformers installed, and reaches this only for a spec whose model config it can read.
    import torch
    from transformers import AutoConfig

    from services.learner.sharding import packing_problem
    from services.model_layout import UnsupportedModel, check_causal_lm

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as error:
        return f"cannot read the config of {model_dir}: {error}"
    try:
        layout = check_causal_lm(config, spec.model)
    except UnsupportedModel as error:
        return str(error)
    if spec.learner.pack_rows is True:
        problem = packing_problem(spec.learner, torch.device(spec.learner.device), layout)
        if problem is not None:
            return (
                f"{spec.model} ({layout.model_type}) cannot be trained with learner.pack_rows: "
                f"true on {spec.learner.device}: {problem} (pack_rows: auto pads it)"
            )
    return None


def preflight(spec: RunSpec, source: str) -> Path:
    """Check what validation cannot see (the model directory and family, the prompt file)
    before any actor starts; returns the model directory."""
    try:
        model_dir = resolve_model(spec.model, spec.model_revision)
        check_tokenizer(model_dir)
    except ModelDirError as error:
        raise SpecError(f"{source}: model: {error}") from None
    problem = model_family_problem(spec, model_dir)
    if problem is not None:
        raise SpecError(f"{source}: model: {problem}")
    try:
        chat = chats_strings(spec.task, has_chat_template(model_dir))
    except ValueError as error:
        raise SpecError(f"{source}: task.chat_template: {error} ({model_dir})") from None
    try:
        PromptStream(spec.task, spec.seed, chat=chat).take(1)
    except PromptFileError as error:
        raise SpecError(f"{source}: task.path: {error}") from None
    if spec.eval is not None:
        try:
            held_out_prompts(spec.task, spec.seed, 1)
        except NoHeldOutPrompts as error:
            raise SpecError(f"{source}: eval: {error}") from None
        except PromptFileError as error:
            raise SpecError(f"{source}: task.eval_path: {error}") from None
    return model_dir
