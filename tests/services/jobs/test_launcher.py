"""Runs as real Ray jobs on a real local Ray head: start, reuse, submit, stop, reconcile.

One head for the module (starting one takes about 10 s); runs report into a local store in the
head's data directory, as `kpo serve` sets them up without Redis.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource
from ray.job_submission import JobStatus

from services.jobs.launcher import (
    cluster_job_server_url,
    job_server_url,
    launcher_from_env,
    local_job_env,
    ray_auth_headers,
)
from services.jobs.ray_head import HEAD_FILE, LocalRayHead
from services.jobs.reconciler import Reconciler
from services.jobs.settings import JobSettings
from services.pipeline.checkpoints import latest_checkpoint
from services.pipeline.job import run_output_dir
from services.store import LocalStore, RunRecord, RunStatus, Store
from tests.services.jobs.ray_support import (
    job_status,
    launcher_for,
    local_head,
    tiny_run,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    with local_head(tmp_path_factory.mktemp("kpo-data")) as started:
        yield started


@pytest.fixture
def store(head: LocalRayHead) -> Iterator[Store]:
    opened = LocalStore(head.data_dir)
    try:
        yield opened
    finally:
        opened.close()


def final(store: Store, run_id: str, timeout_s: float = 120) -> RunRecord:
    """The run once it has finished."""

    def finished() -> RunRecord | None:
        run = store.get_run(run_id)
        return run if run.status in ("succeeded", "failed", "cancelled") else None

    return wait_until(finished, timeout_s, f"run {run_id} to finish")


def test_job_server_url_accepts_the_documented_ray_address_forms() -> None:
    assert job_server_url("http://head-svc:8265/") == "http://head-svc:8265"
    assert job_server_url("https://ray.example.com") == "https://ray.example.com"
    assert job_server_url("ray://head-svc:10001") == "http://head-svc:8265"
    assert job_server_url("head-svc:6379") == "http://head-svc:8265"
    assert job_server_url("[fd00::1]:6379") == "http://[fd00::1]:8265"
    with pytest.raises(ValueError, match="use http"):
        job_server_url("grpc://head-svc:6379")
    env = {"RAY_ADDRESS": "ray://head:10001", "RAY_API_SERVER_ADDRESS": "http://jobs:9000"}
    assert cluster_job_server_url(settings(env)) == "http://jobs:9000"
    assert cluster_job_server_url(settings({"RAY_ADDRESS": "head:6379"})) == "http://head:8265"
    assert cluster_job_server_url(settings({})) is None


def test_ray_auth_headers_follow_rays_settings(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("abc123\n")
    assert ray_auth_headers(settings({"RAY_AUTH_TOKEN": "abc123"})) == {}  # token mode is off
    assert ray_auth_headers(settings({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "xyz"})) == {
        "Authorization": "Bearer xyz"
    }
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    assert ray_auth_headers(settings(env)) == {"Authorization": "Bearer abc123"}


def test_job_settings_come_from_the_environment_and_empty_means_unset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "")
    monkeypatch.setenv("PYTHONPATH", "/extra")
    read = JobSettings()
    assert read.ray_address == "head:6379" and read.ray_api_server_address is None
    assert read.ray_auth_token is None and read.ray_auth_token_path is None
    assert cluster_job_server_url() == "http://head:8265"  # default: read from the environment
    paths = local_job_env()["PYTHONPATH"].split(":")
    assert paths[0] == str(Path(__file__).resolve().parents[3]) and paths[1:] == ["/extra"]


class _ExactlyGiven(JobSettings):
    """JobSettings read from the values given only: `model_validate` of a settings class still
    reads the process environment, where earlier tests' Ray may have left RAY_AUTH_MODE."""

    @classmethod
    def settings_customise_sources(  # type: ignore[override]
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        **_: Any,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def settings(env: dict[str, str]) -> JobSettings:
    """JobSettings of exactly `env`, whatever this process's environment holds."""
    return _ExactlyGiven(**env)


def test_with_ray_address_the_launcher_uses_that_cluster(
    head: LocalRayHead, tmp_path: Path
) -> None:
    assert head.info is not None
    environ = {
        "RAY_ADDRESS": head.info.dashboard_url,  # the module's head, standing in for a cluster
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": head.info.token_file,
    }
    launcher = launcher_from_env(tmp_path / "elsewhere", "redis://redis:6379/0", settings(environ))
    assert launcher.dashboard_url == head.info.dashboard_url and launcher.ready()
    assert not (tmp_path / "elsewhere" / HEAD_FILE).exists()  # no local head was started
    assert launcher.entrypoint("run-0123456789ab") == (
        "python -m services.cli execute run-0123456789ab"
    )
    assert launcher.job_env()["KPO_STORE_URL"] == "redis://redis:6379/0"


def test_the_local_head_is_recorded_and_reused(head: LocalRayHead) -> None:
    assert head.info is not None
    recorded = json.loads((head.data_dir / HEAD_FILE).read_text())
    assert recorded["dashboard_url"] == head.info.dashboard_url
    again = LocalRayHead(head.data_dir, num_cpus=1, temp_dir=Path("/tmp/unused"))
    assert again.ensure() == head.info  # the live head, not a second one
    assert launcher_for(head, None).ready()
    # The job server wants Ray's token: a client without it is turned away.
    assert not launcher_for(head, None, headers={}).ready()


def test_a_submitted_run_succeeds_and_resubmitting_starts_no_second_job(
    head: LocalRayHead, store: Store
) -> None:
    launcher = launcher_for(head, None)
    run = store.create_run(tiny_run("pipeline.steps=2"))
    launcher.submit(run)
    launcher.submit(run)  # a retry of the same submission: accepted, nothing new starts
    done = final(store, run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert [t.status.value for t in done.transitions] == ["queued", "running", "succeeded"]
    assert [r["step"] for r in store.read_metrics(run.id)] == [1, 2]
    assert store.tail_logs(run.id)[-1] == "[kpo] run succeeded"
    jobs = [j for j in launcher.client().list_jobs() if j.submission_id == run.id]
    assert len(jobs) == 1
    assert wait_until(lambda: job_status(launcher, run.id).is_terminal(), 30, "the job to end")
    assert job_status(launcher, run.id) == JobStatus.SUCCEEDED
    assert Reconciler(launcher, store).reconcile() == []  # nothing to repair


def test_stopping_a_running_run_cancels_it_with_a_checkpoint(
    head: LocalRayHead, store: Store
) -> None:
    launcher = launcher_for(head, None)
    run = store.create_run(tiny_run("pipeline.steps=200", "pipeline.checkpoint_every=0"))
    launcher.submit(run)
    wait_until(lambda: store.read_metrics(run.id), 120, "the first learner step")
    launcher.stop(run.id)
    done = final(store, run.id)
    assert done.status == RunStatus.CANCELLED, done.error
    steps = [r["step"] for r in store.read_metrics(run.id)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 200
    found = latest_checkpoint(run_output_dir(head.data_dir, run.id) / "checkpoints")
    assert found is not None and found[0] == steps[-1]  # checkpointed where it stopped
    wait_until(lambda: job_status(launcher, run.id).is_terminal(), 60, "the job to end")
    assert job_status(launcher, run.id) == JobStatus.STOPPED
    launcher.stop(run.id)  # stopping an ended job again is harmless


def test_a_job_that_dies_at_once_is_reconciled_to_failed_with_its_log_tail(
    head: LocalRayHead, store: Store
) -> None:
    # The entrypoint's interpreter does not exist: the job fails before any driver reports.
    launcher = launcher_for(head, None, python="/nonexistent/python")
    run = store.create_run(tiny_run("pipeline.steps=2"))
    # Never submitted (as if the control plane died right after storing it): the reconciler
    # submits it, then finds its job failed while the run is still queued.
    reconciler = Reconciler(launcher, store, interval_s=0.5)
    reconciler.start()
    try:
        done = final(store, run.id)
    finally:
        reconciler.close()
    assert done.status == RunStatus.FAILED
    assert done.error is not None
    assert "its Ray job ended FAILED before the run recorded its outcome" in done.error
    assert "/nonexistent/python" in done.error and "not found" in done.error  # the log tail
    assert reconciler.reconcile() == []


def test_stop_of_a_run_that_never_started_is_harmless(head: LocalRayHead) -> None:
    launcher_for(head, None).stop("run-000000000000")
