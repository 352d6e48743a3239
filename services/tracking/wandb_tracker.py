"""Weights & Biases: the run's records as W&B history, the resolved spec as the W&B config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.observers import MetricsRecord, RunState
from services.spec import WandbTracking
from services.tracking.base import Tracker, TrackingError, missing_library, run_id, scalar_metrics

# W&B has no cancelled state: a cancelled run ends with the exit code `kpo run` exits with.
EXIT_CODES: dict[RunState, int] = {"succeeded": 0, "failed": 1, "cancelled": 130}


class WandbTracker(Tracker):
    """One W&B run per run (per attempt of a resumed run). The API key comes from the
    environment (WANDB_API_KEY) or `wandb login`, as with any W&B script."""

    key = "wandb"

    def __init__(self, settings: WandbTracking, run_dir: Path, config: dict[str, Any]) -> None:
        super().__init__()
        try:
            import wandb
        except ImportError as error:
            raise missing_library(self.key, "wandb", error) from error
        directory = Path(settings.dir) if settings.dir else run_dir
        directory.mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(
                project=settings.project,
                entity=settings.entity,
                name=settings.name or run_id(run_dir),
                mode=settings.mode,
                tags=list(settings.tags),
                dir=str(directory),
                config=config,
                # Its own run, whatever else this process logs to W&B: never finish another.
                reinit="create_new",
            )
        except Exception as error:
            raise TrackingError(f"tracking.wandb: cannot start a W&B run: {error}") from error

    def _log(self, step: int, record: MetricsRecord) -> None:
        # W&B stores NaN and +-inf as such, so they are kept. Its steps only increase: the steps
        # a run redoes after its learner restarted from a checkpoint are dropped, with W&B's
        # warning (metrics.jsonl holds the redone values).
        self._run.log(scalar_metrics(record, finite_only=False), step=step)

    def _finish(self, state: RunState, error: str | None) -> None:
        self._run.summary["run_state"] = state
        if error:
            self._run.summary["run_error"] = error
        self._run.finish(exit_code=EXIT_CODES[state])
