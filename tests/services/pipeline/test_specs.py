"""Run files: overrides, and errors that name the file, the key and the valid values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from kpo_core.config import describe_validation_error
from services.pipeline.specs import SpecError, apply_overrides, load_run_spec, preflight
from services.spec import RunSpec
from services.tasks.models import resolve_model

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_every_shipped_run_file_parses_and_passes_preflight() -> None:
    files = [p for p in sorted(EXAMPLES.glob("*.yaml")) if not p.name.startswith("algorithm-")]
    assert {p.stem for p in files} >= {"demo", "grpo", "gspo", "gmpo", "kpo", "ctpo", "sync"}
    for path in files:
        spec = load_run_spec(path)
        assert preflight(spec, str(path)).is_dir()


def test_overrides_set_nested_keys_with_yaml_values() -> None:
    data = apply_overrides(
        {"pipeline": {"steps": 5}},
        ["pipeline.steps=20", "algorithm.estimator.name=token", "learner.lr=1e-3"],
    )
    assert data == {
        "pipeline": {"steps": 20},
        "algorithm": {"estimator": {"name": "token"}},
        "learner": {"lr": 1e-3},
    }
    with pytest.raises(SpecError, match="expected key=value"):
        apply_overrides({}, ["pipeline.steps"])
    with pytest.raises(SpecError, match=r"pipeline\.steps is a value, not a section"):
        apply_overrides({"pipeline": {"steps": 5}}, ["pipeline.steps.x=1"])


def test_a_bad_value_names_file_key_and_valid_values(tmp_path: Path) -> None:
    path = write(tmp_path, "generation:\n  backend: tgi\npipeline:\n  stepz: 3\n")
    with pytest.raises(SpecError) as info:
        load_run_spec(path)
    message = str(info.value)
    assert f"{path}: generation.backend: Input should be 'hf' or 'vllm'" in message
    assert f"{path}: pipeline.stepz: Extra inputs are not permitted" in message


def test_sync_mode_refuses_a_staleness_bound(tmp_path: Path) -> None:
    path = write(tmp_path, "pipeline:\n  mode: sync\n  max_staleness: 2\n")
    with pytest.raises(SpecError, match="max_staleness must be 0"):
        load_run_spec(path)
    resolved = load_run_spec(write(tmp_path, "pipeline:\n  mode: sync\n"))
    assert resolved.pipeline.max_staleness == 0
    assert RunSpec().pipeline.max_staleness == 2
    assert RunSpec().pipeline.buffer_groups == 4 * RunSpec().pipeline.batch_groups


def test_a_resolved_spec_validates_again_unchanged() -> None:
    spec = load_run_spec(EXAMPLES / "demo.yaml")
    again = RunSpec.model_validate(json.loads(json.dumps(spec.model_dump(mode="json"))))
    assert again == spec


def test_preflight_names_a_missing_model_and_a_broken_prompt_file(tmp_path: Path) -> None:
    spec = RunSpec(model=str(tmp_path / "nowhere"))
    with pytest.raises(
        SpecError,
        match=r"run\.yaml: model: .*is not a directory, a hub id \(org/name\) nor a built-in",
    ):
        preflight(spec, "run.yaml")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"architectures": ["BertModel"]}')
    with pytest.raises(SpecError, match="names no causal-LM architecture"):
        preflight(RunSpec(model=str(tmp_path / "m")), "run.yaml")
    bad = tmp_path / "p.jsonl"
    bad.write_text("not json\n")
    spec = RunSpec.model_validate({"task": {"name": "jsonl", "path": str(bad)}})
    with pytest.raises(SpecError, match=r"run.yaml: task.path: .*p.jsonl:1: invalid JSON"):
        preflight(spec, "run.yaml")


def test_preflight_names_a_tokenizer_without_an_eos_token(tmp_path: Path) -> None:
    model = tmp_path / "no-eos"
    shutil.copytree(resolve_model("tiny-arith"), model)
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    assert preflight(RunSpec(model=str(model)), "run.yaml") == model.resolve()
    config["eos_token"] = None
    config_file.write_text(json.dumps(config))
    with pytest.raises(SpecError, match=r"run\.yaml: model: the tokenizer of .*no-eos has no EOS"):
        preflight(RunSpec(model=str(model)), "run.yaml")
    (model / "tokenizer.json").write_text("{not json")
    with pytest.raises(SpecError, match=r"run\.yaml: model: cannot load the tokenizer of"):
        preflight(RunSpec(model=str(model)), "run.yaml")


def test_a_bad_backend_or_verifier_name_lists_the_registered_ones() -> None:
    """The spec reads its names from the registries: an unknown one is a validation error."""
    with pytest.raises(ValidationError) as caught:
        RunSpec.model_validate({"generation": {"backend": "tgi"}, "reward": {"verifier": "llm"}})
    message = describe_validation_error(caught.value, "run.yaml")
    assert "run.yaml: generation.backend: Input should be 'hf' or 'vllm'" in message
    assert "run.yaml: reward.verifier: Input should be 'exact' or 'math'" in message
