"""The driver samples training rollouts with the kept sets recorded exactly when the run
replays truncated sampling (`RunSpec.replay_max_kept`), and evaluation never records them."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.pipeline import driver
from services.pipeline.outputs import RunDirectory
from tests.services.pipeline.conftest import tiny_spec


@pytest.mark.parametrize(
    ("overrides", "recorded"),
    [
        ((), None),
        (("generation.top_k=5", "generation.min_p=0.05", "generation.replay_max_kept=32"), 32),
        (("generation.top_p=0.9",), 256),
        (("generation.top_p=0.9", "algorithm.off_policy.truncated_sampling=allow"), None),
    ],
)
def test_training_sampling_records_kept_sets_only_when_replayed(
    tmp_path: Path, overrides: tuple[str, ...], recorded: int | None
) -> None:
    spec = tiny_spec("pipeline.checkpoint_every=0", *overrides)
    run = driver.RunDriver(spec, RunDirectory(tmp_path), [])
    sampling = run._sampling()
    assert sampling.replay_max_kept == recorded
    generation = spec.generation
    assert (sampling.top_p, sampling.top_k, sampling.min_p) == (
        generation.top_p,
        generation.top_k,
        generation.min_p,
    )
