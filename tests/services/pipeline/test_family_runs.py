"""`kpo run` on a model of each decoder family: two synchronous steps on a real local Ray
instance (hf generation, verifier, learner actors), whose on-policy log-ratios are 0.

Synchronous, each step trains on responses the learner's own current weights sampled, so every
token's ratio is 1 up to float32 rounding between the hf engine's cached, batched decoding and
the learner's padded forward: a family masked differently by the two sides (a window, a chunk,
soft-capping) shows here as ratios far from 1 that the clip would then act on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.learner.step import ratio_file
from services.pipeline.driver import RATIO_DIR
from services.pipeline.launch import execute_run
from services.pipeline.outputs import RunDirectory, read_metrics
from tests.services.model_families import FAMILIES, save_family_model
from tests.services.pipeline.conftest import tiny_spec

pytestmark = [pytest.mark.usefixtures("ray_instance"), pytest.mark.timeout(600)]

ON_POLICY_TOLERANCE = 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_two_step_run_of_each_family_trains_on_ratios_of_one(tmp_path: Path, family: str) -> None:
    model_dir = save_family_model(family, tmp_path / "model")
    spec = tiny_spec(
        f"model={model_dir}",
        "generation.prompts_per_batch=2",
        "generation.group_size=2",
        "generation.max_new_tokens=24",
        "pipeline.mode=sync",
        "pipeline.batch_groups=2",
        "pipeline.steps=2",
        "pipeline.checkpoint_every=0",
        "learner.record_ratios_every=1",
    )
    run_dir = tmp_path / "run"
    assert execute_run(spec, RunDirectory(run_dir)) == "succeeded"
    assert [record["step"] for record in read_metrics(run_dir)] == [1, 2]
    for version in (0, 1):
        record = torch.load(ratio_file(run_dir / RATIO_DIR, version))
        mask, log_ratio = record["mask"], record["log_ratio"]
        assert int(mask.sum()) > 0 and int(record["staleness"].max()) == 0
        error = float(log_ratio[mask].abs().max())
        print(f"{family} step {version + 1}: max |log-ratio| {error:.1e} over {int(mask.sum())}")
        assert error < ON_POLICY_TOLERANCE
