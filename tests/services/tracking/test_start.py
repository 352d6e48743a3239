"""Starting the trackers: none without `tracking:`, a clear error for a missing library."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.pipeline.launch import execute_run
from services.pipeline.outputs import STATUS_FILE, RunDirectory
from services.spec import RunSpec
from services.tracking import TrackingError, build_trackers
from tests.services.tracking.test_wandb import read_run

# What `import` of each tracker's library goes through; None in sys.modules makes it fail.
LIBRARIES = {
    "wandb": ["wandb"],
    "mlflow": ["mlflow", "mlflow.entities", "mlflow.tracking"],
    "tensorboard": ["torch.utils.tensorboard"],
}
SETTINGS = {"wandb": {"project": "kpo", "mode": "offline"}, "mlflow": {}, "tensorboard": {}}


def test_no_tracking_imports_no_tracker_library(tmp_path: Path) -> None:
    # A fresh interpreter: this one has imported the libraries for other tests.
    code = (
        "import sys; from pathlib import Path; from services.spec import RunSpec; "
        "from services.tracking import build_trackers; "
        f"assert build_trackers(RunSpec(), Path({str(tmp_path)!r})) == []; "
        "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("key", sorted(LIBRARIES))
def test_a_missing_library_names_the_key_and_the_extra(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in LIBRARIES[key]:
        monkeypatch.setitem(sys.modules, module, None)
    spec = RunSpec.model_validate({"tracking": {key: SETTINGS[key]}})
    with pytest.raises(TrackingError) as caught:
        build_trackers(spec, tmp_path)
    message = str(caught.value)
    assert message.startswith(f"tracking.{key} is set, but ")
    assert "pip install 'kpo-rl[tracking]'" in message


def test_a_tracker_that_cannot_start_fails_the_run_before_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    spec = RunSpec.model_validate({"tracking": {"wandb": SETTINGS["wandb"]}})
    with pytest.raises(TrackingError, match="kpo-rl\\[tracking\\]"):
        execute_run(spec, RunDirectory(tmp_path))
    status = json.loads((tmp_path / STATUS_FILE).read_text(encoding="utf-8"))
    assert status["state"] == "failed"
    assert status["error"].startswith("tracking.wandb is set")


def test_trackers_started_before_one_that_fails_are_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    for module in LIBRARIES["mlflow"]:
        monkeypatch.setitem(sys.modules, module, None)
    spec = RunSpec.model_validate({"tracking": {"wandb": SETTINGS["wandb"], "mlflow": {}}})
    with pytest.raises(TrackingError, match=r"tracking\.mlflow"):
        build_trackers(spec, tmp_path)
    _, _, exit_record, summary = read_run(tmp_path)
    assert exit_record.exit_code == 1
    assert summary["run_error"] == "another tracker could not start"
