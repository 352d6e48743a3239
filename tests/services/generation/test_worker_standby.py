"""A warm standby's worker (`load_when_idle`) loads each offer at once, with no work to do; a
serving worker's offer waits for work. On real Ray with the tiny model."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import ray
from transformers import AutoModelForCausalLM

from services.generation.worker import GenerationStats, GenerationWorker, offer_weights_to

pytestmark = [pytest.mark.usefixtures("ray_instance"), pytest.mark.timeout(180)]


def stats_of(worker: Any) -> GenerationStats:
    stats: GenerationStats = ray.get(worker.stats.remote())
    return stats


def wait_for_version(worker: Any, version: int, timeout: float) -> float:
    """Seconds until `worker` holds `version` (AssertionError past `timeout`)."""
    start = time.monotonic()
    while stats_of(worker).policy_version != version:
        assert time.monotonic() - start < timeout, f"version {version} never loaded"
        time.sleep(0.05)  # the load runs in the worker's engine thread: polled
    return time.monotonic() - start


def test_a_standby_loads_an_offer_with_no_work_and_a_serving_worker_waits_for_work(
    tiny_model_dir: Path,
) -> None:
    standby = GenerationWorker.options(num_cpus=0).remote(
        "hf", str(tiny_model_dir), load_when_idle=True
    )
    serving = GenerationWorker.options(num_cpus=0).remote("hf", str(tiny_model_dir))
    try:
        state = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict())
        _, acks = offer_weights_to([standby, serving], 1, state)
        assert ray.get(acks) == [True, True]
        wait_for_version(standby, 1, 60)
        standby_stats = stats_of(standby)
        assert standby_stats.pending_version is None and standby_stats.weight_swaps == 1
        # The serving worker was offered the same version at the same time and got no work:
        # it holds the offer, unloaded (a newer offer would replace it unfetched).
        serving_stats = stats_of(serving)
        assert serving_stats.policy_version == 0 and serving_stats.pending_version == 1
        assert serving_stats.weight_swaps == 0
    finally:
        for worker in (standby, serving):
            ray.kill(worker)
