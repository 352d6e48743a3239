"""What the trackers share: the observer's life cycle, the scalars of a record, start errors."""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from services.observers import MetricsRecord, RunState

log = logging.getLogger(__name__)

FINAL_STATES: frozenset[RunState] = frozenset({"succeeded", "failed", "cancelled"})
INSTALL = "pip install 'kpo-rl[tracking]'"


class TrackingError(RuntimeError):
    """A configured tracker cannot start; the message names its key and what to do."""


def missing_library(key: str, library: str, error: ImportError) -> TrackingError:
    """The error of a tracker whose library is not installed (the extra is optional)."""
    return TrackingError(
        f"tracking.{key} is set, but {library} cannot be imported ({error}); install the "
        f"trackers with: {INSTALL}"
    )


def run_id(run_dir: Path) -> str:
    """The run's id: its output directory's name (the control plane's run id, or the name
    `kpo run` gave the directory)."""
    return run_dir.resolve().name


def scalar_metrics(record: MetricsRecord, *, finite_only: bool) -> dict[str, float]:
    """The numeric values of `record` as floats, `step` (the x axis) left out.

    None (a value the step did not have, or a NaN read back from JSON) is left out: a tracker's
    chart shows a gap there. Non-numeric values (a list of durations) stay in metrics.jsonl only:
    every tracker here charts scalars. `finite_only` also leaves out NaN and +-inf, for tools
    that would store them as something else.
    """
    scalars: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or value is None or not isinstance(value, int | float):
            continue
        number = float(value)
        if finite_only and not math.isfinite(number):
            continue
        scalars[key] = number
    return scalars


class Tracker(ABC):
    """A `RunObserver` that mirrors the run into one experiment tracker.

    Its constructor starts the tool's run (raising `TrackingError` when it cannot); a final
    state, or `close()`, ends it, once. A failure while logging is a warning, never the run's
    failure: a tracker that is down must not stop training.
    """

    key: ClassVar[str]  # the tracker's key under `tracking:` of the spec

    def __init__(self) -> None:
        self._closed = False

    def on_status(self, state: RunState, error: str | None = None, **details: Any) -> None:
        final_eval = details.get("final_eval")
        if isinstance(final_eval, dict) and "step" in details:
            # The run's final evaluation: one more point of the evaluation's curves, at the
            # last step (`eval_step` says which policy it sampled).
            self.on_metrics({"step": details["step"], **final_eval})
        if state in FINAL_STATES:
            self.close(state, error)

    def on_metrics(self, record: MetricsRecord) -> None:
        if self._closed:
            return
        step = int(record["step"])
        try:
            self._log(step, record)
        except Exception as problem:
            log.warning("tracking.%s: step %d not logged: %s", self.key, step, problem)

    def close(self, state: RunState = "failed", error: str | None = None) -> None:
        """End the tool's run as `state`; only the first call does. The default, failed, is for
        a run that ended without a final state (an exception before the driver reported one)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish(state, error)
        except Exception as problem:
            log.warning("tracking.%s: ending the run as %s failed: %s", self.key, state, problem)

    @abstractmethod
    def _log(self, step: int, record: MetricsRecord) -> None: ...

    @abstractmethod
    def _finish(self, state: RunState, error: str | None) -> None: ...
