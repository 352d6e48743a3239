"""A control plane as `kpo serve` puts it together, on a real local Ray head and a real
redis-server, and the HTTP calls the end-to-end and chaos tests make of it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from services.api.app import create_app
from services.api.client import SseEvent, parse_sse
from services.api.settings import ApiSettings
from services.jobs.ray_head import LocalRayHead
from services.jobs.reconciler import Reconciler
from services.store import RedisStore
from tests.services.api.server import serve
from tests.services.jobs.ray_support import launcher_for, local_head, tiny_run, wait_until
from tests.services.store.redis_server import RedisServer

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
    reconciler = Reconciler(launcher, store, interval_s=1.0)
    reconciler.start()
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
        reconciler.close()
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
