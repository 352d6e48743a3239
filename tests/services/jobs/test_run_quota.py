"""The cap on active runs holds on Ray, not only in the store: a run cancelled while its job
waits in Ray's queue for a driver slot is finished in the store at once, but Ray's job server
cannot cancel a job that has not started (its supervisor stops it once placed), so until the job
has ended it still counts. Before, a loop of creates and cancels filled Ray's queue with jobs
under a cap of 2 (every create a 201)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.api.app import create_app
from services.api.settings import ApiSettings
from services.jobs.launcher import RayJobLauncher
from services.jobs.ray_head import LocalRayHead
from services.store import LocalStore
from tests.services.api.server import serve
from tests.services.jobs.ray_support import (
    DRIVER_SLOT,
    launcher_for,
    local_head,
    stand_in_python,
    tiny_run,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)

CAP = 2


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    # As many driver slots as the cap (the chart's rule), so that Ray queues the jobs beyond.
    with local_head(tmp_path_factory.mktemp("kpo-data"), resources={DRIVER_SLOT: CAP}) as started:
        yield started


@pytest.fixture
def api(head: LocalRayHead, tmp_path: Path) -> Iterator[tuple[httpx.Client, RayJobLauncher]]:
    """The control plane as `kpo serve` puts it together, with a cap of CAP active runs; each
    run's driver stands in for a long run (it holds its slot until stopped)."""
    store = LocalStore(tmp_path / "store")
    launcher = launcher_for(
        head,
        None,
        python=stand_in_python(tmp_path, "exec sleep 3600"),
        driver_resource=DRIVER_SLOT,
    )
    settings = ApiSettings.model_validate(
        {"KPO_DATA_DIR": str(head.data_dir), "KPO_MAX_ACTIVE_RUNS": str(CAP)}
    )
    try:
        with (
            serve(create_app(settings, store, launcher)) as url,
            httpx.Client(base_url=url, timeout=60) as client,
        ):
            yield client, launcher
    finally:
        launcher.close()
        store.close()


def test_creates_and_cancels_leave_at_most_the_cap_of_live_ray_jobs(
    api: tuple[httpx.Client, RayJobLauncher],
) -> None:
    client, launcher = api
    created, refused, most_live = [], 0, 0
    for _ in range(20):
        response = client.post("/v1/runs", json=tiny_run())
        if response.status_code == 429:
            refused += 1
            assert response.headers["Retry-After"]
        else:
            assert response.status_code == 201, response.text
            run_id = response.json()["id"]
            created.append(run_id)
            cancel = client.post(f"/v1/runs/{run_id}/cancel")
            assert cancel.status_code == 202, cancel.text
            assert cancel.json()["status"] == "cancelled"
        most_live = max(most_live, len(launcher.live_runs()))
    assert most_live <= CAP, most_live
    assert len(created) + refused == 20
    assert created, "a run is accepted while the cap has room"
    # The stopped jobs do end on Ray, and their slots come back.
    wait_until(lambda: not launcher.live_runs(), 120, "the cancelled runs' jobs to end")
    response = client.post("/v1/runs", json=tiny_run())
    assert response.status_code == 201, response.text
    assert client.post(f"/v1/runs/{response.json()['id']}/cancel").status_code == 202
