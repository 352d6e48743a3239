"""Stopping `kpo run` with the signals a terminal or `ray job stop` sends, in each phase."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from services.pipeline.checkpoints import latest_checkpoint
from tests.chaos.runs import KpoRun, status_of, steps_in

pytestmark = pytest.mark.timeout(600)


def test_ctrl_c_finishes_the_step_checkpoints_and_records_the_run_as_cancelled(
    tmp_path: Path,
) -> None:
    with KpoRun(tmp_path, "pipeline.steps=200", "pipeline.checkpoint_every=0") as run:
        run.wait_for_steps(2)
        # The run has its own process group, as a terminal's foreground job has: Ctrl-C goes
        # to the whole group.
        os.killpg(run.process.pid, signal.SIGINT)
        assert run.finish() == 130, run.output
    assert "Traceback" not in run.output
    assert status_of(run.out)["state"] == "cancelled"
    steps = steps_in(run.out)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 200
    found = latest_checkpoint(run.out / "checkpoints")
    assert found is not None and found[0] == steps[-1]


def test_sigterm_while_the_run_starts_records_it_as_cancelled(tmp_path: Path) -> None:
    with KpoRun(tmp_path, "pipeline.steps=200") as run:
        assert run.process.stdout is not None
        first = run.process.stdout.readline()  # printed just before Ray starts
        assert first.startswith("[kpo] run 'tiny'"), first
        run.process.send_signal(signal.SIGTERM)
        assert run.finish() == 130, first + run.output
    assert "Traceback" not in run.output
    status = status_of(run.out)
    assert status["state"] == "cancelled" and steps_in(run.out) == []
