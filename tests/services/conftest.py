"""Fixtures shared by the service tests: a Redis server and a local Ray instance (the tiny model
on disk is tests/conftest.py's)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from services.pipeline.actors import ACTOR_ENV
from tests.services.store.redis_server import RedisServer

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server (AOF on) for one module, whose tests may stop, kill and restart it.

    The store tests override it with one server for the whole session (tests/services/store).
    """
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    """A local Ray instance for one module; reuses one that is already running.

    Three CPUs: a run's generation worker and learner take one each, its verifier a fraction.
    """
    if ray.is_initialized():
        yield
        return
    # Worker processes are told where the repository's packages live, installed or not.
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=3,
        include_dashboard=False,
        runtime_env={"env_vars": {**ACTOR_ENV, "PYTHONPATH": python_path}},
    )
    try:
        yield
    finally:
        # Object refs and actor handles the module's tests left in reference cycles (a failed
        # call's traceback holds the frames that hold them) are freed here, while Ray is up.
        # Left to the cyclic collector, one would be freed at some later allocation, in whatever
        # thread makes it, and a Ray call after shutdown ends the whole test process.
        gc.collect()
        ray.shutdown()
