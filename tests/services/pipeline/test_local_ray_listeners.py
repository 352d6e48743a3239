"""The Ray instance `kpo run` starts on its own machine (no RAY_ADDRESS) leaves nothing that
answers without the token on an address other than loopback: its processes' listening sockets
are read from /proc, and every one beyond loopback is a port of a process in Ray's token mode
that answers an HTTP client without the token with 401/403, or not at all (Ray's gRPC ports).
Before, the metrics agent's Prometheus exporter answered anyone on 0.0.0.0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.services.listeners import (
    LOOPBACK,
    descendants,
    http_answers_without_token,
    listening,
)

REPO = Path(__file__).resolve().parents[3]
# What `kpo run` does before its driver starts its actors (services/pipeline/launch.py).
START_LIKE_KPO_RUN = """
import os
import sys
from services.pipeline.actors import connect_ray
from services.spec import RunSpec
from tests.services.pipeline.conftest import TINY_RUN

connect_ray(RunSpec.model_validate(TINY_RUN))
# The mode this process (the driver) runs in; /proc shows only the environment it started with.
print("ready", os.environ.get("RAY_AUTH_MODE"), flush=True)
sys.stdin.read()
"""
# Ray's processes that listen once ray.init has returned (the raylet waits for its agents).
LISTENERS = ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent")


@pytest.fixture
def kpo_run_ray(tmp_path: Path) -> Iterator[int]:
    """The pid of a process that started Ray as `kpo run` does, until the test ends. It inherits
    RAY_AUTH_MODE=disabled, which must not turn the token off."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    env.pop("RAY_ADDRESS", None)
    env["RAY_AUTH_MODE"] = "disabled"
    process = subprocess.Popen(
        [sys.executable, "-c", START_LIKE_KPO_RUN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().split() == ["ready", "token"]
        yield process.pid
    finally:
        assert process.stdin is not None
        process.stdin.close()  # the script returns; ray's atexit hook stops its processes
        process.wait(timeout=60)


def names(pids: set[int]) -> dict[int, str]:
    found = {}
    for pid in pids:
        try:
            found[pid] = psutil.Process(pid).name()
        except psutil.NoSuchProcess:
            continue
    return found


def test_kpo_runs_ray_listens_beyond_loopback_only_behind_its_token(kpo_run_ray: int) -> None:
    deadline = time.monotonic() + 60
    while True:  # ray.init returned: its daemons are up; wait for each to have bound its ports
        pids = descendants(kpo_run_ray)
        by_pid = names(pids)
        sockets = listening(pids)
        bound = {by_pid.get(c.pid) for c in sockets}
        if set(LISTENERS) <= bound or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert set(LISTENERS) <= bound, bound
    beyond_loopback = [c for c in sockets if c.laddr.ip not in LOOPBACK]
    assert beyond_loopback, "Ray binds its gRPC ports on every interface (the check is live)"
    # Token mode in each daemon's environment, where /proc still shows it: Ray's agents retitle
    # themselves over it, and the driver's is the one it started with (see the fixture).
    environments = {pid: psutil.Process(pid).environ() for pid in pids - {kpo_run_ray}}
    shown = {by_pid[pid]: env.get("RAY_AUTH_MODE") for pid, env in environments.items() if env}
    assert {"gcs_server", "raylet"} <= set(shown), shown
    assert set(shown.values()) == {"token"}, shown
    answered = http_answers_without_token(beyond_loopback)
    unguarded = {
        f"{by_pid[c.pid]} {c.laddr.ip}:{c.laddr.port}": answered[c.laddr.port]
        for c in beyond_loopback
        if answered.get(c.laddr.port) not in (None, 401, 403)
    }
    assert unguarded == {}
