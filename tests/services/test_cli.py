"""The `kpo` command line: config validation with errors that name the file and key."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from services.cli import app

runner = CliRunner()
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_every_shipped_algorithm_example_parses() -> None:
    files = sorted(EXAMPLES.glob("algorithm-*.yaml"))
    assert files
    for path in files:
        result = runner.invoke(app, ["config", "check", str(path)])
        assert result.exit_code == 0, result.output
        resolved = yaml.safe_load(result.output)
        assert resolved["estimator"]["name"] in {
            "token",
            "sequence",
            "geometric",
            "kalman",
            "cumulative",
        }


def test_defaults_are_filled_in(tmp_path: Path) -> None:
    path = tmp_path / "algo.yaml"
    path.write_text("estimator:\n  name: cumulative\n")
    result = runner.invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 0
    assert yaml.safe_load(result.output)["estimator"]["clip_high"] == 0.05


def test_bad_key_names_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "algo.yaml"
    path.write_text("estimator:\n  name: kalman\n  qq: 1\n")
    result = runner.invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 2
    assert f"{path}: estimator.kalman.qq: Extra inputs are not permitted" in result.output
    assert "Traceback" not in result.output


def test_missing_file_and_bad_yaml_are_clear(tmp_path: Path) -> None:
    missing = runner.invoke(app, ["config", "check", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "no such file" in missing.output
    broken = tmp_path / "broken.yaml"
    broken.write_text("estimator: [1\n")
    result = runner.invoke(app, ["config", "check", str(broken)])
    assert result.exit_code == 2 and "invalid YAML" in result.output
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    result = runner.invoke(app, ["config", "check", str(scalar)])
    assert result.exit_code == 2 and "expected a mapping" in result.output
