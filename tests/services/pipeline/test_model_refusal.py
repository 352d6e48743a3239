"""A model the run cannot train is refused before anything starts, saying which and why:
`kpo run --dry-run` and the `hf` engine read its config alone (the folders here hold no
weights, so anything that tried to load them would fail otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import app
from services.generation.hf_backend import HFBackend
from services.model_layout import UnsupportedModel
from tests.services.model_families import save_family_config

runner = CliRunner()
DEMO = Path(__file__).resolve().parents[3] / "examples" / "demo.yaml"


def dry_run(model_dir: Path, *overrides: str) -> tuple[int, str]:
    settings = [arg for item in (f"model={model_dir}", *overrides) for arg in ("--set", item)]
    result = runner.invoke(app, ["run", str(DEMO), "--dry-run", *settings])
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def test_a_family_refused_by_design_is_refused_by_the_dry_run(tmp_path: Path) -> None:
    code, output = dry_run(save_family_config("qwen3-next", tmp_path / "next"))
    assert code == 2, output
    assert f"demo.yaml: model: {tmp_path / 'next'} (qwen3_next): layer 0 is a " in output
    assert "'linear_attention' layer" in output


def test_packing_a_family_that_cannot_be_packed_is_refused_and_auto_pads_it(
    tmp_path: Path,
) -> None:
    model_dir = save_family_config("gpt-oss", tmp_path / "oss")
    code, output = dry_run(model_dir, "learner.pack_rows=true")
    assert code == 2, output
    assert "cannot be trained with learner.pack_rows: true on cpu" in output
    assert "sinks" in output
    code, output = dry_run(model_dir)
    assert code == 0, output


@pytest.mark.parametrize("family", ["llama", "gemma2", "llama4"])
def test_families_the_learner_serves_pass_the_dry_run(tmp_path: Path, family: str) -> None:
    code, output = dry_run(save_family_config(family, tmp_path / family))
    assert code == 0, output


def test_a_config_transformers_cannot_read_is_named(tmp_path: Path) -> None:
    model_dir = save_family_config("llama", tmp_path / "odd")
    config = (model_dir / "config.json").read_text().replace('"llama"', '"no-such-family"')
    (model_dir / "config.json").write_text(config)
    code, output = dry_run(model_dir)
    assert code == 2 and f"model: cannot read the config of {model_dir}" in output, output


def test_the_hf_engine_refuses_the_family_by_name_before_loading_weights(tmp_path: Path) -> None:
    model_dir = save_family_config("qwen3-next", tmp_path / "next")
    with pytest.raises(UnsupportedModel, match=f"{model_dir} .qwen3_next.: layer 0 is a"):
        HFBackend(model_dir)
