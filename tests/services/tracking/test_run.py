"""A real run with trackers: each mirrors every record of metrics.jsonl and ends with the run."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from services.pipeline.launch import execute_run
from services.pipeline.outputs import RunDirectory, read_metrics
from tests.services.pipeline.conftest import tiny_spec
from tests.services.tracking.test_mlflow import run_in
from tests.services.tracking.test_tensorboard import read_scalars

# A run of the tiny model on a local Ray: over 10 s.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("ray_instance"),
    pytest.mark.timeout(300),
]


def test_a_run_is_mirrored_step_by_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = tiny_spec("pipeline.steps=3")
    spec = spec.model_copy(
        update={"tracking": spec.tracking.model_validate({"mlflow": {}, "tensorboard": {}})}
    )
    assert execute_run(spec, RunDirectory(tmp_path)) == "succeeded"

    reward = {r["step"]: r["reward_mean"] for r in read_metrics(tmp_path)}
    assert sorted(reward) == [1, 2, 3]
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    run_id = run_in(client, "kpo-rl")
    history = client.get_metric_history(run_id, "reward_mean")
    assert {metric.step: metric.value for metric in history} == reward
    assert client.get_run(run_id).info.status == "FINISHED"
    scalars = read_scalars(tmp_path / "tensorboard")[1]
    assert scalars["reward_mean"] == pytest.approx(reward, rel=1e-6)
