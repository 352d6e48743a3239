"""TensorBoard: the run's records as scalars of an event file, the resolved spec as text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.observers import MetricsRecord, RunState
from services.spec import TensorboardTracking
from services.tracking.base import Tracker, TrackingError, missing_library, scalar_metrics

LOG_DIR = "tensorboard"  # under RUN_DIR unless `log_dir` says otherwise


class TensorboardTracker(Tracker):
    """Writes RUN_DIR/tensorboard (or `log_dir`) through torch's SummaryWriter, which needs the
    tensorboard package; a resumed run adds an event file beside the earlier attempts'."""

    key = "tensorboard"

    def __init__(
        self, settings: TensorboardTracking, run_dir: Path, config: dict[str, Any]
    ) -> None:
        super().__init__()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise missing_library(self.key, "tensorboard", error) from error
        self.log_dir = Path(settings.log_dir) if settings.log_dir else run_dir / LOG_DIR
        try:
            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        except Exception as error:
            raise TrackingError(
                f"tracking.tensorboard: cannot write to {self.log_dir}: {error}"
            ) from error
        # Markdown: TensorBoard's text tab renders a fenced block as it is.
        self._writer.add_text("config", f"```\n{json.dumps(config, indent=2)}\n```", 0)

    def _log(self, step: int, record: MetricsRecord) -> None:
        # Event files hold IEEE floats, so NaN and +-inf are kept as they are.
        for key, value in scalar_metrics(record, finite_only=False).items():
            self._writer.add_scalar(key, value, step)
        # Flushed every step (a step takes seconds): TensorBoard shows the run as it goes.
        self._writer.flush()

    def _finish(self, state: RunState, error: str | None) -> None:
        self._writer.add_text("run_state", f"{state}: {error}" if error else state)
        self._writer.close()
