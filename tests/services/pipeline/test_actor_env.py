"""What every actor of a run runs with (ACTOR_ENV): among it, the hub off."""

from __future__ import annotations

import pytest
import ray

pytestmark = pytest.mark.usefixtures("ray_instance")


@ray.remote(num_cpus=0)
def hub_offline_in_a_worker() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def test_actors_never_reach_the_hub() -> None:
    """The driver resolves models and datasets to local files; a worker that tried to download
    (a model, a tokenizer, a hub kernel) fails at once instead."""
    assert ray.get(hub_offline_in_a_worker.remote()) is True
