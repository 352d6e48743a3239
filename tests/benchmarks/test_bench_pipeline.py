"""The pipeline benchmark's modes: each is a valid run spec that sets what its name says."""

from __future__ import annotations

import bench_pipeline
import pytest
from bench_pipeline import MODES, mode_spec
from worker_loss import worker_loss_spec

from services.pipeline.specs import load_run_spec


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_is_a_run_spec_of_that_mode(mode: str) -> None:
    base = load_run_spec(bench_pipeline.DEFAULT_CONFIG, [])
    spec = mode_spec(base, mode, steps=6, long_tail=True)
    assert spec.pipeline.steps == 6 and spec.pipeline.checkpoint_every == 0
    assert spec.pipeline.mode == ("sync" if mode == "sync" else "async")
    assert spec.generation.streaming == (mode != "sync" and mode != "async-batch")
    assert spec.overlaps_publish == (mode != "sync" and mode != "async-stream-sequential-publish")
    assert spec.pipeline.in_flight_updates == (mode == "async-inflight")
    assert (spec.task.difficulty, spec.task.difficulty_max) == (1, 5)
    assert spec.generation.max_new_tokens == bench_pipeline.LONG_TAIL_MAX_NEW_TOKENS


def test_without_long_tail_the_configs_task_stays() -> None:
    base = load_run_spec(bench_pipeline.DEFAULT_CONFIG, [])
    spec = mode_spec(base, "async-stream", steps=6, long_tail=False)
    assert spec.task == base.task
    assert spec.generation.max_new_tokens == base.generation.max_new_tokens


def test_modes_without_the_sync_baseline_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_pipeline.main(["--modes", "async-stream"])
    assert "must include sync" in capsys.readouterr().err


def test_the_worker_loss_run_has_two_serving_workers_one_standby_and_two_replacements() -> None:
    base = load_run_spec(bench_pipeline.DEFAULT_CONFIG, [])
    spec = worker_loss_spec(base, steps=50)
    assert (spec.generation.num_workers, spec.generation.standby) == (2, 1)
    # Both serving workers are killed: one promotion and one replacement, both in the budget.
    assert spec.pipeline.actor_replacements == 2
    assert spec.pipeline.steps == 50 and spec.pipeline.checkpoint_every == 0
    assert spec.task == base.task and spec.model == base.model
