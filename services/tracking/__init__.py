"""Experiment trackers (W&B, MLflow, TensorBoard) that mirror a run's metrics records.

Each tracker configured under `tracking:` of the run spec is one more `RunObserver` of the run
(services/pipeline/launch.py): it logs every metrics record at its `step`, the resolved spec once
as the tool's config or params, and ends the tool's run when the run reaches a final state. The
libraries are the optional `tracking` extra and are imported only by a configured tracker.
"""

from services.tracking.base import Tracker, TrackingError
from services.tracking.registry import build_trackers

__all__ = ["Tracker", "TrackingError", "build_trackers"]
