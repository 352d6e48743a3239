"""End to end: the control plane under a real uvicorn server, a real redis-server (AOF), and
runs as real Ray jobs on a real local Ray head.

A run is submitted over HTTP and watched to the end; a running run is cancelled; the control
plane is restarted in the middle of a run; Redis is killed (SIGKILL) and restarted in the middle
of a run. One Ray head and one redis-server serve the whole module.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from services.api.app import create_app
from services.api.client import SseEvent, parse_sse
from services.api.ray_head import LocalRayHead
from services.api.settings import ApiSettings
from services.pipeline.checkpoints import latest_checkpoint
from services.pipeline.job import run_output_dir
from services.store import RedisStore
from tests.services.api.ray_support import launcher_for, local_head, tiny_run, wait_until
from tests.services.api.server import serve
from tests.services.store.redis_server import RedisServer

pytestmark = pytest.mark.timeout(300)

TOKEN = "e2e-token-0123456789abcdef"
FINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    with local_head(tmp_path_factory.mktemp("kpo-data")) as started:
        yield started


@contextmanager
def control_plane(head: LocalRayHead, redis: RedisServer) -> Iterator[httpx.Client]:
    """The control plane as `kpo serve` puts it together; yields a client that has the token."""
    store = RedisStore.from_url(redis.url)
    launcher = launcher_for(head, redis.url)
    launcher.start_reconciler(store, interval_s=1.0)
    settings = ApiSettings.model_validate(
        {"KPO_API_TOKEN": TOKEN, "KPO_DATA_DIR": str(head.data_dir), "KPO_STORE_URL": redis.url}
    )
    try:
        with (
            serve(create_app(settings, store, launcher)) as url,
            httpx.Client(
                base_url=url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}
            ) as client,
        ):
            yield client
    finally:
        launcher.close()
        store.close()


def get(client: httpx.Client, path: str) -> Any:
    """GET a JSON resource, waiting out a 503 (the store is down while Redis restarts)."""

    def answer() -> Any:
        response = client.get(path)
        if response.status_code == 503:
            return None
        response.raise_for_status()
        return response.json()

    return wait_until(answer, 60, f"GET {path} to answer")


def submit(client: httpx.Client, *overrides: str) -> str:
    response = client.post("/v1/runs", json=tiny_run(*overrides))
    assert response.status_code == 201, response.text
    run_id: str = response.json()["id"]
    return run_id


def finished(client: httpx.Client, run_id: str, timeout_s: float = 180) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        run: dict[str, Any] = get(client, f"/v1/runs/{run_id}")
        return run if run["status"] in FINAL else None

    return wait_until(done, timeout_s, f"run {run_id} to finish", every_s=0.5)


def steps_of(client: httpx.Client, run_id: str) -> list[int]:
    return [r["step"] for r in get(client, f"/v1/runs/{run_id}/metrics")["records"]]


def first_steps(client: httpx.Client, run_id: str, count: int) -> list[int]:
    def enough() -> list[int] | None:
        steps = steps_of(client, run_id)
        return steps if len(steps) >= count else None

    return wait_until(enough, 180, f"{count} learner steps of {run_id}")


def all_events(client: httpx.Client, run_id: str) -> list[SseEvent]:
    """The run's whole event stream (it ends once the run has finished)."""
    with client.stream("GET", f"/v1/runs/{run_id}/events", timeout=60) as response:
        assert response.status_code == 200
        return list(parse_sse(response.iter_lines()))


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
