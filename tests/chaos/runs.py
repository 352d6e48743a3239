"""`kpo run` in a process of its own, and what the chaos tests read back from its directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from services.pipeline.checkpoints import latest_checkpoint, read_driver_state
from services.pipeline.outputs import read_metrics
from services.pipeline.specs import apply_overrides
from tests.services.pipeline.conftest import TINY_RUN


def kpo(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def steps_in(out: Path) -> list[int]:
    try:
        return [r["step"] for r in read_metrics(out)]
    except (json.JSONDecodeError, OSError):  # a line being written, or no file yet
        return []


def status_of(out: Path) -> dict[str, Any]:
    status: dict[str, Any] = json.loads((out / "status.json").read_text())
    return status


def actor_pid(out: Path, role: str, index: int = 0) -> int:
    """The pid of a run's actor as status.json has it (role: generation, verifiers, learner)."""
    pid: int = status_of(out)["actors"][role][index]
    return pid


def kill(pid: int, signum: int = signal.SIGKILL) -> None:
    os.kill(pid, signum)


class KpoRun:
    """`kpo run` of TINY_RUN with overrides, in its own process group (as a shell job is)."""

    def __init__(self, tmp_path: Path, *overrides: str, base: dict[str, Any] | None = None) -> None:
        """`base`: the run file before the overrides (TINY_RUN by default)."""
        self.out = tmp_path / "out"
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump(apply_overrides(base or TINY_RUN, overrides)))
        self.process = subprocess.Popen(
            kpo("run", str(config), "--out", str(self.out)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.output = ""

    def wait_for_steps(self, count: int, timeout: float = 240) -> list[int]:
        wait_for(lambda: len(steps_in(self.out)) >= count, timeout, f"{count} learner steps")
        return steps_in(self.out)

    def finish(self, timeout: float = 300) -> int:
        """Wait for the process to end; its exit code (its output is in `self.output`)."""
        self.output, _ = self.process.communicate(timeout=timeout)
        return self.process.returncode

    def __enter__(self) -> KpoRun:
        return self

    def __exit__(self, *_: object) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def assert_ledger_balances(out: Path, batch_groups: int) -> dict[str, Any]:
    """Every prompt drawn is accounted for exactly once by the final checkpoint: trained,
    buffered, dropped as stale, dropped as refused by generation, or handed back to be issued
    again. A rollout lost on the way leaves a prompt unaccounted for; one trained twice counts a
    prompt twice."""
    found = latest_checkpoint(out / "checkpoints")
    assert found is not None, "no checkpoint"
    state = read_driver_state(found[1])
    counters = state["counters"]
    accounted = (
        counters["step"] * batch_groups
        + len(state["buffer"])
        + counters["groups_dropped_stale"]
        + counters["groups_dropped_invalid"]
        + len(state["handed_back"])
    )
    assert accounted == state["prompt_position"], (accounted, state["prompt_position"])
    return state
