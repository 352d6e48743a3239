"""A launcher test double for the REST tests: it records what it is asked, and starts nothing.

The real launcher (Ray jobs) has its own tests; these test the API's side of the contract.
"""

from __future__ import annotations

from services.store import RunRecord


class RecordingLauncher:
    """Implements the launcher protocol (`services.jobs.interface.RunLauncher`) by remembering
    each call."""

    def __init__(self, ready: bool = True) -> None:
        self.submitted: list[str] = []
        self.stopped: list[str] = []
        self.is_ready = ready
        self.reachable = True  # False: `stop` fails as an unreachable job server would

    def submit(self, run: RunRecord) -> None:
        self.submitted.append(run.id)

    def stop(self, run_id: str) -> None:
        if not self.reachable:
            raise ConnectionError("job server unreachable")
        self.stopped.append(run_id)

    def live_runs(self) -> set[str]:
        # A job of this double ends the moment it is stopped.
        if not self.reachable:
            raise ConnectionError("job server unreachable")
        return set(self.submitted) - set(self.stopped)

    def ready(self) -> bool:
        return self.is_ready

    def close(self) -> None:
        pass
