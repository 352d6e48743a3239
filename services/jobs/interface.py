"""`RunLauncher`: what the control plane's API needs from a launcher of runs.

Imports no Ray, so that the API (and its tests, with a launcher of their own) never load it;
the launcher that runs each run as a Ray job is `services.jobs.launcher.RayJobLauncher`.
"""

from __future__ import annotations

from typing import Protocol

from services.store.records import RunRecord


class RunLauncher(Protocol):
    """What the API needs from a launcher."""

    def submit(self, run: RunRecord) -> None:
        """Start the run as a job whose id is the run id; idempotent."""

    def stop(self, run_id: str) -> None:
        """Ask the run's job to stop (SIGTERM: the driver checkpoints and records `cancelled`)."""

    def live_runs(self) -> set[str]:
        """Ids of the runs that have a job Ray has not ended (pending, running or stopping),
        whatever the store says of them: what the cap on active runs counts besides the store.
        Raises when Ray's job server cannot be reached."""

    def ready(self) -> bool:
        """Whether Ray's job server answers (for /readyz)."""

    def close(self) -> None:
        """Release what the launcher holds; the jobs go on."""
