"""What a lost generation worker costs, replaced vs taken over by a warm standby, in one run.

A run with two serving workers and one standby (`generation.standby: 1`): after step
`kill_at` both serving workers' processes are killed (SIGKILL) at the same instant. The driver
notices both; the first it handles takes the standby (a promotion), the second finds none up
(the new standby is still being built) and is replaced as without standby: a new actor that
loads the model, then the current weights. For each place the time measured is from the kill
to the first group the worker in that place returned (the driver's `generation.worker_restored`
event): the generation the run went without there. The run is cancelled once both came.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from services.observers import MetricsRecord, RunState
from services.pipeline.driver import RESTORED_EVENT, RunDriver
from services.pipeline.outputs import RunDirectory
from services.spec import RunSpec

# Long enough for a replacement's model load on a few shared cores; the run is cancelled as
# soon as both places served again.
MAX_STEPS = 400


def worker_loss_spec(base: RunSpec, steps: int = MAX_STEPS) -> RunSpec:
    """`base` with two serving workers and one standby, no checkpoints, room for two
    replacements."""
    data = base.model_dump(mode="json")
    data["generation"].update(num_workers=2, standby=1)
    data["pipeline"].update(steps=steps, checkpoint_every=0, actor_replacements=2)
    return RunSpec.model_validate(data)


class _KillBoth:
    """Kills both serving workers after step `kill_at`; times each place's return."""

    def __init__(self, kill_at: int) -> None:
        self.kill_at = kill_at
        self.pids: dict[str, list[int]] = {}  # the supervisor's, live
        self.killed_at: float | None = None
        self.seconds: dict[str, float] = {}  # via ("standby", "replacement") -> seconds
        self.noticed: dict[str, float] = {}  # via -> seconds from the kill to the driver's notice
        self.driver: RunDriver | None = None
        self.groups: list[tuple[float, float]] = []  # before the kill: (groups, mean seconds)

    def on_status(self, state: RunState, error: str | None = None, **details: Any) -> None:
        self.pids = details.get("actors", self.pids)

    def on_metrics(self, record: MetricsRecord) -> None:
        if self.killed_at is None:
            self.groups.append((record["generation_batches"], record["generation_batch_seconds"]))
        if record["step"] == self.kill_at and self.killed_at is None:
            for pid in self.pids["generation"]:
                os.kill(pid, signal.SIGKILL)
            self.killed_at = time.perf_counter()

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        if kind != RESTORED_EVENT or self.killed_at is None:
            return
        seconds = time.perf_counter() - self.killed_at
        self.seconds[data["via"]] = seconds
        self.noticed[data["via"]] = seconds - data["seconds"]
        if len(self.seconds) == 2 and self.driver is not None:
            self.driver.cancel()  # measured: the rest of the run is not


def worker_loss_recovery(spec: RunSpec, kill_at: int = 3) -> dict[str, float]:
    """Seconds from a worker's death to its place's next group, by how the place was taken
    (`spec` from `worker_loss_spec`, Ray connected); printed with their ratio."""
    watcher = _KillBoth(kill_at)
    with tempfile.TemporaryDirectory() as out:
        driver = RunDriver(spec, RunDirectory(Path(out)), [watcher])
        watcher.driver = driver
        driver.run()
    if set(watcher.seconds) != {"standby", "replacement"}:
        raise RuntimeError(f"the run ended before both places served again: {watcher.seconds}")
    standby, replaced = watcher.seconds["standby"], watcher.seconds["replacement"]
    noticed = watcher.noticed
    count = sum(n for n, _ in watcher.groups)
    group_s = sum(n * mean for n, mean in watcher.groups) / max(count, 1)
    print(
        f"worker loss, death to the place's next group: replacement {replaced:.2f} s, "
        f"standby {standby:.2f} s ({replaced / standby:.1f}x shorter with a standby); the "
        f"driver noticed the deaths {noticed['replacement']:.2f} s and "
        f"{noticed['standby']:.2f} s after the kill; before it, a group took {group_s:.2f} s "
        "from its hand-over to its end (the floor of both)",
        flush=True,
    )
    return {
        "replacement_s": replaced,
        "standby_s": standby,
        "ratio": replaced / standby,
        "group_s": group_s,
    }
