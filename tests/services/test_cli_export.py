"""`kpo export`: a run's checkpoint as a model directory; mistakes are one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from services.cli import app
from tests.services.learner.test_export import save_learner_checkpoint, tiny_model, write_run

runner = CliRunner()
# The checkpoints are written without a process group, as DCP warns: on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with checkpoints at steps 10 (float32) and 20 (bfloat16)."""
    model, tokenizer = tiny_model()
    root = tmp_path_factory.mktemp("learners")
    fp32 = save_learner_checkpoint(root / "fp32", model, tokenizer)
    bf16 = save_learner_checkpoint(root / "bf16", model, tokenizer, compute_dtype="bfloat16")
    return write_run(tmp_path_factory.mktemp("run"), {10: fp32, 20: bf16})


def _dtype(model_dir: Path) -> str:
    dtype: str = json.loads((model_dir / "config.json").read_text())["dtype"]
    return dtype


def test_export_writes_the_step_asked_for_to_out(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    result = runner.invoke(app, ["export", str(run_dir), "--step", "10", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert str(out) in result.output
    assert _dtype(out) == "float32"
    model, _ = tiny_model()
    weights = load_file(out / "model.safetensors")
    for name, tensor in weights.items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_export_defaults_to_the_newest_step_and_run_dir_model(run_dir: Path) -> None:
    result = runner.invoke(app, ["export", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert _dtype(run_dir / "model") == "bfloat16"  # step 20
    again = runner.invoke(app, ["export", str(run_dir), "--step", "10"])  # replaces the export
    assert again.exit_code == 0, again.output
    assert _dtype(run_dir / "model") == "float32"


def test_a_missing_run_dir_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["export", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {tmp_path / 'nope'}: no such run directory"


def test_a_missing_step_lists_the_steps_available(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, ["export", str(run_dir), "--step", "15", "--out", str(out)])
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"error: {run_dir} has no checkpoint of step 15 (steps: 10, 20)"
    )
    assert "Traceback" not in result.output and not out.exists()


def test_an_out_that_is_not_a_model_directory_is_refused(run_dir: Path) -> None:
    result = runner.invoke(app, ["export", str(run_dir), "--out", str(run_dir)])
    assert result.exit_code == 2
    assert "holds the checkpoint" in result.output
    assert (run_dir / "checkpoints").is_dir()


def test_a_negative_step_is_a_usage_error(run_dir: Path) -> None:
    result = runner.invoke(app, ["export", str(run_dir), "--step", "-1"])
    assert result.exit_code == 2
