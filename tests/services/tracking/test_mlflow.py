"""The MLflow tracker, read back from its file store with MLflow's own client."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from services.spec import RunSpec
from services.tracking import build_trackers
from tests.services.tracking.records import EXPECTED_FINITE, records


@pytest.fixture(autouse=True)
def _mlflow_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tracker opts in to MLflow's file store through the environment: undone after the test.
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def run_in(client: MlflowClient, experiment: str) -> str:
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    [run] = client.search_runs([found.experiment_id])
    run_id: str = run.info.run_id
    return run_id


def test_every_finite_value_is_a_metric_at_its_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run-7"
    spec = RunSpec.model_validate({"tracking": {"mlflow": {}}, "learner": {"lr": 3e-4}})
    [tracker] = build_trackers(spec, run_dir)
    for record in records():
        tracker.on_metrics(record)
    tracker.on_status("failed", "RuntimeError: boom", step=3)

    client = MlflowClient((run_dir / "mlruns").as_uri())
    run_id = run_in(client, "kpo-rl")
    for key, expected in EXPECTED_FINITE.items():
        history = client.get_metric_history(run_id, key)
        assert {metric.step: metric.value for metric in history} == expected, key
    [last_time] = [m for m in client.get_metric_history(run_id, "time") if m.step == 3]
    assert last_time.timestamp == int(records()[2]["time"] * 1000)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.info.run_name == "run-7"
    assert run.data.tags["run_error"] == "RuntimeError: boom"
    assert run.data.params["learner.lr"] == "0.0003"
    assert run.data.params["task.name"] == "arith"
    assert "generation_batch_seconds" not in run.data.metrics


@pytest.mark.parametrize(("state", "status"), [("succeeded", "FINISHED"), ("cancelled", "KILLED")])
def test_final_state_and_settings(tmp_path: Path, state: str, status: str) -> None:
    uri = (tmp_path / "store").as_uri()
    settings = {"tracking_uri": uri, "experiment": "study", "run_name": "kalman-1"}
    spec = RunSpec.model_validate({"tracking": {"mlflow": settings}})
    [tracker] = build_trackers(spec, tmp_path / "run")
    tracker.on_metrics(records()[0])
    tracker.on_status(state, step=1)  # type: ignore[arg-type]
    tracker.close()  # after the final state: nothing more

    client = MlflowClient(uri)
    run = client.get_run(run_in(client, "study"))
    assert (run.info.status, run.info.run_name) == (status, "kalman-1")
    assert run.data.metrics["reward_mean"] == 0.25
