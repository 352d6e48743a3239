"""`kpo run` / `kpo resume` at the edge: clear errors, no traceback, nothing started."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from services.cli import app

runner = CliRunner()
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def test_a_bad_run_file_names_file_key_and_valid_values(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  estimator:\n    name: ppo\ngeneration:\n  group_size: 1\n")
    result = runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert f"{path}: algorithm.estimator: " in result.output
    assert "'kalman'" in result.output and "'cumulative'" in result.output
    assert f"{path}: generation.group_size: Input should be greater than or equal to 2" in (
        result.output
    )
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_broken_yaml_and_bad_overrides_are_clear(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("pipeline: [1\n")
    result = runner.invoke(app, ["run", str(path)])
    assert result.exit_code == 2 and f"{path}: invalid YAML" in result.output
    result = runner.invoke(app, ["run", str(EXAMPLES / "demo.yaml"), "--set", "pipeline.mode=fast"])
    assert result.exit_code == 2
    assert "pipeline.mode: Input should be 'async' or 'sync'" in result.output


def test_dry_run_prints_the_resolved_spec(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["run", str(EXAMPLES / "sync.yaml"), "--dry-run", "--set", "pipeline.steps=7"]
    )
    assert result.exit_code == 0, result.output
    assert "max_staleness: 0" in result.output and "steps: 7" in result.output


def test_a_missing_model_fails_before_anything_starts(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["run", str(EXAMPLES / "demo.yaml"), "--set", f"model={tmp_path / 'none'}"]
    )
    assert result.exit_code == 2
    assert "demo.yaml: model: " in result.output and "is not a directory" in result.output


def test_resume_needs_a_run_directory(tmp_path: Path) -> None:
    result = runner.invoke(app, ["resume", str(tmp_path)])
    assert result.exit_code == 2
    assert "config.json: no such file" in result.output


def test_run_refuses_to_overwrite_a_run(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    result = runner.invoke(app, ["run", str(EXAMPLES / "demo.yaml"), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "already holds a run" in result.output
