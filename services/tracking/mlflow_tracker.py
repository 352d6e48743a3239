"""MLflow: the run's records as metrics of an MLflow run, the resolved spec as its params."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from services.observers import MetricsRecord, RunState
from services.spec import MlflowTracking
from services.tracking.base import Tracker, TrackingError, missing_library, run_id, scalar_metrics

STATUSES: dict[RunState, str] = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}
# MLflow's limits (mlflow.utils.validation): entities per log_batch call, a param's length.
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
PARAM_LENGTH = 6000


def tracking_uri(settings: MlflowTracking, run_dir: Path) -> str:
    """The spec's URI, else MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns: a run
    needs no MLflow server or database to be tracked."""
    configured = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    return configured or (run_dir.resolve() / "mlruns").as_uri()


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`config` as MLflow params: one per leaf, named by its dotted path (`learner.lr`); a list
    is one param, in JSON; a value longer than MLflow takes is cut to its limit."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(flat_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            params[name] = text[:PARAM_LENGTH]
    return params


class MlflowTracker(Tracker):
    """One MLflow run per run (per attempt of a resumed run), in `experiment` (made if new).
    Credentials of a server come from MLflow's environment variables (MLFLOW_TRACKING_TOKEN,
    MLFLOW_TRACKING_USERNAME/PASSWORD)."""

    key = "mlflow"

    def __init__(self, settings: MlflowTracking, run_dir: Path, config: dict[str, Any]) -> None:
        super().__init__()
        uri = tracking_uri(settings, run_dir)
        if urlparse(uri).scheme in ("", "file"):
            # MLflow 3 refuses its file store unless opted in (it is in maintenance mode). A
            # file store is what a run tracks into without a server or database packages.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as error:
            raise missing_library(self.key, "mlflow", error) from error
        self._metric = Metric
        try:
            self._client = MlflowClient(tracking_uri=uri)
            experiment = self._client.get_experiment_by_name(settings.experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self._client.create_experiment(settings.experiment)
            )
            run = self._client.create_run(
                experiment_id, run_name=settings.run_name or run_id(run_dir)
            )
            self._run_id = run.info.run_id
            params = [Param(key, value) for key, value in flat_params(config).items()]
            for start in range(0, len(params), PARAMS_PER_BATCH):
                self._client.log_batch(
                    self._run_id, params=params[start : start + PARAMS_PER_BATCH]
                )
        except Exception as error:
            raise TrackingError(
                f"tracking.mlflow: cannot start an MLflow run at {uri}: {error}"
            ) from error

    def _log(self, step: int, record: MetricsRecord) -> None:
        # Non-finite values are left out: MLflow's database stores replace +-inf by the largest
        # floats and its REST API has no NaN, so they would chart as something they are not.
        scalars = scalar_metrics(record, finite_only=True)
        wall = record.get("time")
        millis = int((wall if isinstance(wall, int | float) else time.time()) * 1000)
        metrics = [self._metric(key, value, millis, step) for key, value in scalars.items()]
        for start in range(0, len(metrics), METRICS_PER_BATCH):
            self._client.log_batch(self._run_id, metrics=metrics[start : start + METRICS_PER_BATCH])

    def _finish(self, state: RunState, error: str | None) -> None:
        if error:
            self._client.set_tag(self._run_id, "run_error", error[:PARAM_LENGTH])
        self._client.set_terminated(self._run_id, STATUSES[state])
