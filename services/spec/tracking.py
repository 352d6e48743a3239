"""The `tracking` section: the experiment trackers that mirror every metrics record."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
)

from kpo_core.config import StrictModel
from services.spec.bounds import MAX_LIST_ITEMS, NameItem, NameText, PathText


class WandbTracking(StrictModel):
    """Weights & Biases: every metrics record as the W&B run's history, the resolved spec as its
    config. The API key comes from the environment (WANDB_API_KEY) or `wandb login`, never the
    spec."""

    project: NameText = Field(description="W&B project to log the run to")
    entity: NameText | None = Field(
        None, description="W&B team or user; default: the API key's default entity"
    )
    name: NameText | None = Field(
        None, description="W&B run name; default: the run id (RUN_DIR's name)"
    )
    mode: Literal["online", "offline", "disabled"] = Field(
        "online",
        description="online: stream to the W&B server; offline: files only, for `wandb sync` "
        "later; disabled: log nothing",
    )
    tags: tuple[NameItem, ...] = Field((), max_length=MAX_LIST_ITEMS, description="W&B run tags")
    dir: PathText | None = Field(
        None, description="W&B writes its files in DIR/wandb; default RUN_DIR"
    )


class MlflowTracking(StrictModel):
    """MLflow: every metrics record as the MLflow run's metrics, the resolved spec as its params.
    Server credentials come from the environment (MLFLOW_TRACKING_TOKEN, ...), never the spec."""

    tracking_uri: PathText | None = Field(
        None,
        description="MLflow tracking URI; default: MLFLOW_TRACKING_URI when set, else a file "
        "store in RUN_DIR/mlruns",
    )
    experiment: NameText = Field("kpo-rl", description="MLflow experiment (made if new)")
    run_name: NameText | None = Field(
        None, description="MLflow run name; default: the run id (RUN_DIR's name)"
    )


class TensorboardTracking(StrictModel):
    """TensorBoard: every metrics record as scalars of an event file, the resolved spec as text."""

    log_dir: PathText | None = Field(
        None, description="where the event files go; default RUN_DIR/tensorboard"
    )


class TrackingConfig(StrictModel):
    """Experiment trackers that mirror every metrics record (services/tracking), beside
    metrics.jsonl and Prometheus. Each is off when absent (null); `{}` turns one on with its
    defaults. They need the `tracking` extra: pip install 'kpo-rl[tracking]'."""

    wandb: WandbTracking | None = None
    mlflow: MlflowTracking | None = None
    tensorboard: TensorboardTracking | None = None
