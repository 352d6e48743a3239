"""A real local Ray run with shadow estimators: the learner group hands its ranks the spec's
algorithm with KPO's `reference_length: auto` resolved, the KPO shadow's too, and every step's
record carries the shadows' keys beside the training estimator's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from services.metrics import SHADOW_KEYS
from services.pipeline.launch import execute_run
from services.pipeline.outputs import RunDirectory, read_metrics
from tests.services.pipeline.conftest import tiny_spec


@pytest.mark.usefixtures("ray_instance")
@pytest.mark.timeout(300)
def test_a_run_records_its_shadow_estimators_every_step(tmp_path: Path) -> None:
    spec = tiny_spec(
        "algorithm.estimator.name=token",
        "algorithm.shadow=[kalman, sequence]",
        "pipeline.steps=2",
        "pipeline.checkpoint_every=0",
    )
    assert execute_run(spec, RunDirectory(tmp_path)) == "succeeded"
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    wanted = {key for key in SHADOW_KEYS if key.split("_")[1] in ("kalman", "sequence")}
    for record in records:
        assert {key for key in record if key.startswith("shadow_")} == wanted
        assert all(math.isfinite(record[key]) for key in wanted)
        assert "policy_loss" in record and "filtered_switch_frequency" in record
