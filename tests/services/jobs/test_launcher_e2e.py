"""End to end: the control plane under a real uvicorn server, a real redis-server (AOF), and
runs as real Ray jobs on a real local Ray head.

A run is submitted over HTTP and watched to the end; a running run is cancelled. (Restarts of
the control plane and of Redis under a run are in tests/chaos.) One Ray head and one
redis-server serve the whole module.
"""

from __future__ import annotations

import pytest

from services.jobs.ray_head import LocalRayHead
from services.pipeline.checkpoints import latest_checkpoint
from services.pipeline.job import run_output_dir
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
from tests.services.store.redis_server import RedisServer

pytestmark = pytest.mark.timeout(300)

__all__ = ["head"]  # the module's Ray head fixture


def test_a_run_submitted_over_http_succeeds_with_its_whole_history(
    head: LocalRayHead, redis_server: RedisServer
) -> None:
    with control_plane(head, redis_server) as client:
        run_id = submit(client, "pipeline.steps=2")
        run = finished(client, run_id)
        assert run["status"] == "succeeded", run["error"]
        assert [t["status"] for t in run["transitions"]] == ["queued", "running", "succeeded"]
        metrics = get(client, f"/v1/runs/{run_id}/metrics")
        assert [r["step"] for r in metrics["records"]] == [1, 2] and metrics["last_step"] == 2
        assert {"reward_mean", "entropy", "staleness_mean"} <= metrics["records"][0].keys()
        events = all_events(client, run_id)
        assert [(e.kind, e.data.get("status", e.data.get("step"))) for e in events] == [
            ("status", "queued"),
            ("status", "running"),
            ("metrics", 1),
            ("metrics", 2),
            ("status", "succeeded"),
        ]
        lines = get(client, f"/v1/runs/{run_id}/logs")["lines"]
        assert lines[0] == "[kpo] run running" and lines[-1] == "[kpo] run succeeded"
        assert get(client, "/readyz") == {"store": True, "ray": True}


def test_a_running_run_is_cancelled_with_a_checkpoint(
    head: LocalRayHead, redis_server: RedisServer
) -> None:
    with control_plane(head, redis_server) as client:
        run_id = submit(client, "pipeline.steps=300", "pipeline.checkpoint_every=0")
        first_steps(client, run_id, 1)
        response = client.post(f"/v1/runs/{run_id}/cancel")
        assert response.status_code == 202, response.text
        run = finished(client, run_id)
        assert run["status"] == "cancelled", run["error"]
        steps = steps_of(client, run_id)
        assert steps == list(range(1, len(steps) + 1)) and len(steps) < 300
        found = latest_checkpoint(run_output_dir(head.data_dir, run_id) / "checkpoints")
        assert found is not None and found[0] == steps[-1]
        again = client.post(f"/v1/runs/{run_id}/cancel")
        assert again.status_code == 409
        assert "cancelled" in again.json()["error"]["message"]
