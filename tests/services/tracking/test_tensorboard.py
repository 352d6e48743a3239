"""The TensorBoard tracker, read back from its event files with TensorBoard's own reader."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from services.spec import RunSpec
from services.tracking import build_trackers
from tests.services.tracking.records import EXPECTED_FINITE, records


def read_scalars(log_dir: Path) -> tuple[EventAccumulator, dict[str, dict[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    scalars = {
        tag: {event.step: event.value for event in events.Scalars(tag)}
        for tag in events.Tags()["scalars"]
    }
    return events, scalars


def test_every_record_is_scalars_at_its_step(tmp_path: Path) -> None:
    spec = RunSpec.model_validate({"tracking": {"tensorboard": {}}})
    [tracker] = build_trackers(spec, tmp_path)
    for record in records():
        tracker.on_metrics(record)
    tracker.on_status("succeeded", step=3)

    events, scalars = read_scalars(tmp_path / "tensorboard")
    for key, expected in EXPECTED_FINITE.items():
        if key == "clip_fraction":  # kept as NaN at step 2: checked below
            continue
        # Event files hold float32.
        assert scalars[key] == pytest.approx(expected, rel=1e-6), key
    clip = EXPECTED_FINITE["clip_fraction"]
    assert {step: scalars["clip_fraction"][step] for step in clip} == pytest.approx(clip)
    assert math.isnan(scalars["clip_fraction"][2])
    assert scalars["time"][3] == pytest.approx(records()[2]["time"], rel=1e-6)
    assert "generation_batch_seconds" not in scalars  # a list: metrics.jsonl only
    assert {"config/text_summary", "run_state/text_summary"} <= set(events.Tags()["tensors"])


def test_log_dir_from_the_spec(tmp_path: Path) -> None:
    log_dir = tmp_path / "elsewhere"
    spec = RunSpec.model_validate({"tracking": {"tensorboard": {"log_dir": str(log_dir)}}})
    [tracker] = build_trackers(spec, tmp_path / "run")
    tracker.on_metrics(records()[0])
    tracker.on_status("cancelled", "stopped", step=1)
    tracker.on_metrics(records()[1])  # after the final state: not logged

    assert read_scalars(log_dir)[1]["reward_mean"] == {1: 0.25}


def test_the_final_evaluation_is_the_last_point_of_the_evaluation_curves(tmp_path: Path) -> None:
    spec = RunSpec.model_validate({"tracking": {"tensorboard": {}}})
    [tracker] = build_trackers(spec, tmp_path)
    tracker.on_metrics({"step": 1, "eval_pass_at_k": 0.25, "eval_step": 0})
    final = {"eval_accuracy_avg_at_k": 0.125, "eval_pass_at_k": 0.5, "eval_step": 2.0}
    tracker.on_status("succeeded", step=2, final_eval=final)

    scalars = read_scalars(tmp_path / "tensorboard")[1]
    assert scalars["eval_pass_at_k"] == {1: 0.25, 2: 0.5}
    assert scalars["eval_accuracy_avg_at_k"] == {2: 0.125}
