"""Faults around runs that the control plane launched as real Ray jobs on a real local head:
the control plane restarted, Redis killed (SIGKILL) and restarted, and cancels in every phase of
a run. After each, the record must be consistent and no actor of the run may be left alive.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import httpx
import pytest

from services.jobs.ray_head import LocalRayHead
from services.pipeline.checkpoints import latest_checkpoint
from services.pipeline.job import run_output_dir
from services.store import RedisStore
from tests.services.jobs.live_control_plane import (
    all_events,
    control_plane,
    finished,
    first_steps,
    get,
    head,
    steps_of,
    submit,
)
from tests.services.jobs.ray_support import launcher_for, wait_until
from tests.services.store.redis_server import RedisServer

pytestmark = pytest.mark.timeout(300)

__all__ = ["head"]  # the module's Ray head fixture

RUN_ACTORS = {"GenerationWorker", "VerifierActor", "LearnerImpl"}


def live_run_actors(head: LocalRayHead) -> list[dict[str, Any]]:
    """Actors of any run still alive on the head, from Ray's state API."""
    assert head.info is not None
    response = httpx.get(
        f"{head.info.dashboard_url}/api/v0/actors",
        params={"limit": 10000, "detail": "false"},
        headers=head.auth_headers(),
        timeout=30,
    )
    response.raise_for_status()
    actors: list[dict[str, Any]] = response.json()["data"]["result"]["result"]
    return [a for a in actors if a["state"] != "DEAD" and a["class_name"] in RUN_ACTORS]


def assert_nothing_left_running(head: LocalRayHead, run_id: str) -> None:
    """The run's Ray job has ended and no actor of any run is alive."""
    jobs = launcher_for(head, None).client()
    wait_until(lambda: jobs.get_job_status(run_id).is_terminal(), 60, f"job {run_id} to end")
    # Actors of a finished job go when its driver process exits: allow Ray a moment for it.
    wait_until(lambda: not live_run_actors(head), 30, "the run's actors to be gone")


def assert_cancelled_consistently(client: httpx.Client, head: LocalRayHead, run_id: str) -> None:
    run = finished(client, run_id)
    assert run["status"] == "cancelled", run["error"]
    assert [t["status"] for t in run["transitions"]][-1] == "cancelled"
    steps = steps_of(client, run_id)
    assert steps == list(range(1, len(steps) + 1))
    found = latest_checkpoint(run_output_dir(head.data_dir, run_id) / "checkpoints")
    if steps:  # a run cancelled after a step ends with a checkpoint of its last step
        assert found is not None and found[0] == steps[-1]
    assert_nothing_left_running(head, run_id)


def test_a_run_goes_on_through_a_restart_of_the_control_plane(
    head: LocalRayHead, redis_server: RedisServer
) -> None:
    total = 40
    with control_plane(head, redis_server) as client:
        run_id = submit(client, f"pipeline.steps={total}")
        first_steps(client, run_id, 1)
    # The control plane is down; the run's job goes on (and keeps reporting into Redis).
    time.sleep(1.0)
    with control_plane(head, redis_server) as client:
        seen_at_restart = steps_of(client, run_id)
        run = finished(client, run_id)
        assert run["status"] == "succeeded", run["error"]
        assert steps_of(client, run_id) == list(range(1, total + 1))
        assert len(seen_at_restart) < total  # it was still running when the new one came up
    assert_nothing_left_running(head, run_id)


def test_every_metrics_record_is_stored_once_through_a_redis_crash(
    head: LocalRayHead, redis_server: RedisServer
) -> None:
    total = 40
    with control_plane(head, redis_server) as client:
        run_id = submit(client, f"pipeline.steps={total}")
        assert len(first_steps(client, run_id, 2)) < total
        redis_server.kill()  # SIGKILL: no shutdown, no last write
        # Longer than the writers' retry deadline (2 s): the run's reports go to its buffer.
        time.sleep(3.0)
        redis_server.start()
        run = finished(client, run_id)
        assert run["status"] == "succeeded", run["error"]
        assert steps_of(client, run_id) == list(range(1, total + 1))
        events = all_events(client, run_id)
        metric_steps = [e.data["step"] for e in events if e.kind == "metrics"]
        assert metric_steps == list(range(1, total + 1))
        progress = [
            line
            for line in get(client, f"/v1/runs/{run_id}/logs")["lines"]
            if line.startswith("step")
        ]
        assert len(progress) == total
    # And the stored history is the same read straight from a fresh connection to Redis.
    with RedisStore.from_url(redis_server.url) as store:
        assert [r["step"] for r in store.read_metrics(run_id)] == list(range(1, total + 1))


def test_cancel_while_the_run_starts(head: LocalRayHead, redis_server: RedisServer) -> None:
    with control_plane(head, redis_server) as client:
        run_id = submit(client, "pipeline.steps=300")
        response = client.post(f"/v1/runs/{run_id}/cancel")  # the job is just starting
        assert response.status_code == 202, response.text
        assert_cancelled_consistently(client, head, run_id)


def test_cancel_while_checkpointing_every_step(
    head: LocalRayHead, redis_server: RedisServer
) -> None:
    with control_plane(head, redis_server) as client:
        run_id = submit(client, "pipeline.steps=300", "pipeline.checkpoint_every=1")
        first_steps(client, run_id, 2)
        assert client.post(f"/v1/runs/{run_id}/cancel").status_code == 202
        assert_cancelled_consistently(client, head, run_id)


def test_cancel_while_the_learner_restarts(head: LocalRayHead, redis_server: RedisServer) -> None:
    with control_plane(head, redis_server) as client:
        run_id = submit(client, "pipeline.steps=300", "pipeline.checkpoint_every=1")
        first_steps(client, run_id, 2)
        status = run_output_dir(head.data_dir, run_id) / "status.json"
        os.kill(json.loads(status.read_text())["actors"]["learner"][0], signal.SIGKILL)
        assert client.post(f"/v1/runs/{run_id}/cancel").status_code == 202
        assert_cancelled_consistently(client, head, run_id)
