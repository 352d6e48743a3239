"""Starting the trackers that a run spec's `tracking:` sets.

Apart from `base`, which every tracker imports, so that `base` imports none of them. Importing
a tracker's module does not import its library: the tracker does when it starts.
"""

from __future__ import annotations

from pathlib import Path

from services.spec import RunSpec
from services.tracking.base import Tracker
from services.tracking.mlflow_tracker import MlflowTracker
from services.tracking.tensorboard_tracker import TensorboardTracker
from services.tracking.wandb_tracker import WandbTracker


def build_trackers(spec: RunSpec, run_dir: Path) -> list[Tracker]:
    """A started tracker for each one `spec.tracking` sets, in the order wandb, mlflow,
    tensorboard; none without any. `TrackingError` if one cannot start (the others started
    before it are closed again)."""
    tracking = spec.tracking
    config = spec.model_dump(mode="json")
    trackers: list[Tracker] = []
    try:
        if tracking.wandb is not None:
            trackers.append(WandbTracker(tracking.wandb, run_dir, config))
        if tracking.mlflow is not None:
            trackers.append(MlflowTracker(tracking.mlflow, run_dir, config))
        if tracking.tensorboard is not None:
            trackers.append(TensorboardTracker(tracking.tensorboard, run_dir, config))
    except BaseException:
        for tracker in trackers:
            tracker.close("failed", "another tracker could not start")
        raise
    return trackers
