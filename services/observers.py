"""What a run reports as it goes, and the interface of whoever listens.

The driver reports each state change and each metrics record to its `RunObserver`s: the run
directory and the progress line (services.pipeline.outputs), the control plane's store
(services.pipeline.store_observer) and the experiment trackers (services.tracking). Declared
here, below all of them, so that a tracker need not import the driver it observes.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

RunState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
MetricsRecord = dict[str, Any]  # one learner step's record (keys: services.metrics)


class RunObserver(Protocol):
    """Receives a run's status changes and metrics records, in order."""

    def on_status(self, state: RunState, error: str | None = None, **details: Any) -> None: ...

    def on_metrics(self, record: MetricsRecord) -> None: ...
