"""A real process kill of the learner mid-run, then `kpo resume`: consecutive steps, none twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from services.pipeline.checkpoints import latest_checkpoint
from services.pipeline.outputs import read_metrics
from tests.services.pipeline.conftest import TINY_RUN

pytestmark = pytest.mark.timeout(600)


def kpo(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def wait_for(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def steps_in(out: Path) -> list[int]:
    try:
        return [r["step"] for r in read_metrics(out)]
    except (json.JSONDecodeError, OSError):  # a line being written
        return []


def run_until(
    tmp_path: Path,
    out: Path,
    steps: int,
    checkpoint_every: int,
    at_step: int,
    act: Callable[[subprocess.Popen[str]], None],
) -> tuple[subprocess.Popen[str], str]:
    """Start `kpo run` on TINY_RUN in its own process group, `act(process)` once `at_step` steps
    are recorded, and return the finished process and its output."""
    config = tmp_path / "run.yaml"
    pipeline = {**TINY_RUN["pipeline"], "steps": steps, "checkpoint_every": checkpoint_every}
    config.write_text(yaml.safe_dump({**TINY_RUN, "pipeline": pipeline}))
    driver = subprocess.Popen(
        kpo("run", str(config), "--out", str(out)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(lambda: len(steps_in(out)) >= at_step, 240, f"{at_step} learner steps")
        act(driver)
        output, _ = driver.communicate(timeout=120)
    finally:
        driver.kill()
    return driver, output


def test_a_killed_learner_fails_the_run_and_resume_continues_from_the_checkpoint(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"

    def kill_learner(_: subprocess.Popen[str]) -> None:
        learner_pid = json.loads((out / "status.json").read_text())["actors"]["learner"][0]
        os.kill(learner_pid, signal.SIGKILL)

    driver, output = run_until(
        tmp_path, out, steps=6, checkpoint_every=2, at_step=3, act=kill_learner
    )
    assert driver.returncode == 1, output
    assert "run failed" in output and "Traceback" not in output
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "failed" and "ActorDiedError" in status["error"]
    found = latest_checkpoint(out / "checkpoints")
    assert found is not None
    checkpoint_step = found[0]
    assert checkpoint_step >= 2 and checkpoint_step % 2 == 0
    before = steps_in(out)
    assert before[:checkpoint_step] == list(range(1, checkpoint_step + 1))

    resumed = subprocess.run(
        kpo("resume", str(out)), capture_output=True, text=True, timeout=400, check=False
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert steps_in(out) == [1, 2, 3, 4, 5, 6]
    status = json.loads((out / "status.json").read_text())
    assert [t["state"] for t in status["transitions"]] == [
        "running",
        "failed",
        "running",
        "succeeded",
    ]
    assert status["resumed_from"] == checkpoint_step
    records = read_metrics(out)
    # The resumed learner continued the versions: no step repeated or skipped.
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["tokens_trained_total"] == sum(r["tokens_trained"] for r in records)


def test_ctrl_c_finishes_the_step_checkpoints_and_records_the_run_as_cancelled(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    driver, output = run_until(
        tmp_path,
        out,
        steps=200,
        checkpoint_every=0,
        at_step=2,
        # The run has its own process group, as a terminal's foreground job has: Ctrl-C goes
        # to the whole group.
        act=lambda driver: os.killpg(driver.pid, signal.SIGINT),
    )
    assert driver.returncode == 130, output
    assert "Traceback" not in output
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "cancelled"
    steps = steps_in(out)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 200
    found = latest_checkpoint(out / "checkpoints")
    assert found is not None and found[0] == steps[-1]
