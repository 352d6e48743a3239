"""The adaptive staleness bound in the run driver: the bound it sets for the buffer and the
admission budget, its keys in each record, its state in the driver's checkpoints, and a real
local Ray run with the tiny model."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.pipeline.calls import LearnerCall
from services.pipeline.checkpoints import (
    DRIVER_STATE,
    checkpoint_name,
    latest_checkpoint,
    read_driver_state,
)
from services.pipeline.driver import RunDriver
from services.pipeline.launch import execute_run
from services.pipeline.outputs import RunDirectory, read_metrics
from services.pipeline.staleness import PATIENCE, WARMUP, StalenessController
from tests.services.pipeline.conftest import tiny_spec

AUTO = ("pipeline.max_staleness.auto.min=0", "pipeline.max_staleness.auto.max=3")


def train(run: RunDriver, **learner: float) -> None:
    """One learner step's result handed to the driver (no actors; no checkpoint is due)."""
    metrics = {"tokens_trained": 6.0, "clip_fraction": 0.02, "approx_kl": 0.002, **learner}
    no_actors: Any = SimpleNamespace(generation=[])
    run._on_trained(no_actors, LearnerCall(time.perf_counter()), metrics)


def test_the_bound_is_the_buffers_and_the_admission_budgets(tmp_path: Path) -> None:
    run_dir = RunDirectory(tmp_path)
    run = RunDriver(tiny_spec("pipeline.checkpoint_every=0", *AUTO), run_dir, [])
    batch = run.spec.pipeline.batch_groups
    assert run.staleness is not None and run.buffer.max_staleness == 2
    # Nothing admitted yet, version 0: (0 + bound + 1) batches may be asked for.
    assert run._generation_room() == 3 * batch
    for _ in range(WARMUP):
        train(run)
    train(run, clip_fraction=0.5)  # far above the band learnt in the warm-up
    assert run.buffer.max_staleness == 1
    assert run._generation_room() == 2 * batch
    for _ in range(PATIENCE):  # held after the move, however bad
        train(run, clip_fraction=0.5)
    assert run.buffer.max_staleness == 1
    train(run, clip_fraction=math.nan)
    assert run.buffer.max_staleness == 0
    assert run._generation_room() == batch
    records = run_dir.read_metrics()
    assert [r["staleness_bound"] for r in records] == [2] * WARMUP + [1] * (PATIENCE + 1) + [0]
    assert [r["staleness_bound_changes_total"] for r in records][-1] == 2


def test_a_static_bound_has_no_controller_and_no_keys(tmp_path: Path) -> None:
    run_dir = RunDirectory(tmp_path)
    spec = tiny_spec("pipeline.checkpoint_every=0", "pipeline.max_staleness=1")
    run = RunDriver(spec, run_dir, [])
    assert run.staleness is None and run.buffer.max_staleness == 1
    assert run._generation_room() == 2 * run.spec.pipeline.batch_groups
    train(run, clip_fraction=0.9)
    (record,) = run_dir.read_metrics()
    assert "staleness_bound" not in record and run.buffer.max_staleness == 1


@pytest.mark.parametrize("saved", [True, False])
def test_a_resumed_driver_takes_the_controller_over_or_starts_it_afresh(
    tmp_path: Path, saved: bool
) -> None:
    """`_start` of a resumed attempt reads the controller's state from the checkpoint; one
    without it (written by a run with a fixed bound) starts the controller afresh."""
    controller = StalenessController(0, 3, start=1)
    for step in range(1, 8):
        controller.observe({"step": step, "clip_fraction": 0.01})
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    state: dict[str, Any] = {"counters": {}}
    if saved:
        state["staleness"] = controller.state()
    (checkpoint / DRIVER_STATE).write_text(json.dumps(state))
    run = RunDriver(tiny_spec(*AUTO), RunDirectory(tmp_path / "run"), [])
    run._resume_path = checkpoint
    run._resume_staleness()
    assert run.staleness is not None
    if saved:
        assert run.staleness.state() == controller.state()
        assert run.buffer.max_staleness == controller.bound == 1
    else:
        assert run.staleness.state() == StalenessController(0, 3).state()
        assert run.buffer.max_staleness == 2


@pytest.mark.usefixtures("ray_instance")
@pytest.mark.timeout(300)
def test_a_run_with_an_adaptive_bound(tmp_path: Path) -> None:
    spec = tiny_spec(
        *AUTO, "pipeline.steps=6", "pipeline.checkpoint_every=3", "pipeline.keep_checkpoints=10"
    )
    assert execute_run(spec, RunDirectory(tmp_path)) == "succeeded"
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    bounds = [r["staleness_bound"] for r in records]
    assert all(0 <= bound <= 3 for bound in bounds)
    assert bounds[:WARMUP] == [2] * WARMUP  # the warm-up: no move
    # Each step's batch was taken under the bound in force after the previous step (the first
    # under the start, 2): none of its groups is staler.
    in_force = [2, *bounds[:-1]]
    for record, bound in zip(records, in_force, strict=True):
        assert record["staleness_max"] <= bound, record
    # The count of moves goes up exactly when the bound changes.
    changes = [r["staleness_bound_changes_total"] for r in records]
    moved = [int(after != before) for before, after in zip(in_force, bounds, strict=True)]
    assert changes == [sum(moved[: i + 1]) for i in range(len(moved))]
    # Each checkpoint carries the controller as it was at its step.
    middle = read_driver_state(tmp_path / "checkpoints" / checkpoint_name(3))["staleness"]
    assert middle["seen"] == 3 and middle["bound"] == bounds[2]
    found = latest_checkpoint(tmp_path / "checkpoints")
    assert found is not None and found[0] == 6
    saved = read_driver_state(found[1])["staleness"]
    assert saved["seen"] == 6 and saved["bound"] == bounds[-1]
    assert saved["changes"] == changes[-1]
    assert len(saved["values"]["clip_fraction"]) == 6
    # A driver resuming from it takes the controller over as it was.
    resumed = RunDriver(spec, RunDirectory(tmp_path), [])
    assert resumed.restore() == 6
    resumed._resume_staleness()
    assert resumed.staleness is not None and resumed.staleness.state() == saved
    assert resumed.buffer.max_staleness == bounds[-1]
