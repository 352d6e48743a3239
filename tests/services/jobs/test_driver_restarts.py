"""Runs as real Ray jobs on a real local head that advertises one driver slot.

Each job reserves the slot and a job beyond it waits in Ray's queue; the store URL stays out of
the jobs when told; a run whose driver died, or whose job the cluster no longer knows, is
submitted again (`RUN_ID.r1`, ...) and resumes from its checkpoint, fails with its log tail once
the restarts (counted in the store) are used up, and is never submitted again once cancelled,
even when only the store knows of the cancel. Also the head's record and ports.

Drivers that must fail, hang or exit in a given way are stand-ins (`stand_in_python`); the one
that is killed runs a real pipeline. Each test has a store of its own, so that its reconciler
never touches another test's runs.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
from fastapi import HTTPException
from ray.job_submission import JobStatus

from services.api.routes_runs import cancel_run
from services.jobs.launcher import RayJobLauncher, parse_job_id
from services.jobs.ray_head import (
    HEAD_DIR,
    HEAD_FILE,
    LEGACY_HEAD_FILE,
    LocalRayHead,
    read_head_file,
)
from services.jobs.reconciler import Reconciler
from services.pipeline.checkpoints import latest_checkpoint
from services.pipeline.job import run_output_dir
from services.store import LocalStore, RunRecord, RunStatus, Store
from tests.services.jobs.ray_support import (
    DRIVER_SLOT,
    driver_pid,
    final,
    job_status,
    launcher_for,
    local_head,
    release,
    stand_in_python,
    tiny_run,
    wait_until,
)
from tests.services.listeners import http_answers_without_token, listening

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    data_dir = tmp_path_factory.mktemp("kpo-data")
    with local_head(data_dir, resources={DRIVER_SLOT: 1}) as started:
        yield started


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = LocalStore(tmp_path / "store")
    try:
        yield opened
    finally:
        opened.close()


def reconciled_until_final(
    reconciler: Reconciler, store: Store, run_id: str, timeout_s: float = 120
) -> RunRecord:
    """The run once it has finished, with `reconciler` running in the background meanwhile."""
    reconciler.start()
    try:
        return final(store, run_id, timeout_s)
    finally:
        reconciler.close()


def held_running_driver(
    head: LocalRayHead, store: Store, tmp_path: Path
) -> tuple[RayJobLauncher, RunRecord, Path]:
    """A running run whose stand-in driver waits on a fifo until the test releases it (or its
    job is stopped), then dies as a lost driver does: exit 3, no report."""
    hold = tmp_path / "hold"
    os.mkfifo(hold)
    script = f"cat {shlex.quote(str(hold))} >/dev/null; exit 3"
    launcher = launcher_for(head, None, python=stand_in_python(tmp_path, script))
    run = store.create_run(tiny_run())
    launcher.submit(run)
    store.transition(run.id, RunStatus.RUNNING)
    wait_until(lambda: job_status(launcher, run.id) == JobStatus.RUNNING, 60, "the job")
    return launcher, run, hold


def cancel_cut_off_from_ray(head: LocalRayHead, store: Store, run_id: str) -> int:
    """The API's cancel from a control plane whose stop never reaches Ray (nothing listens on
    port 1): the request is stored, the route refuses; its status code."""
    cut_off = RayJobLauncher("http://127.0.0.1:1", head.data_dir, None)
    with pytest.raises(HTTPException) as refused:
        cancel_run(run_id, store, cut_off)
    return refused.value.status_code


def jobs_of(launcher: RayJobLauncher, run_id: str) -> list[tuple[str, JobStatus]]:
    """(submission id, status) of every job of the run, by attempt."""
    found = []
    for job in launcher.client().list_jobs():
        parsed = parse_job_id(job.submission_id or "")
        if parsed is not None and parsed[0] == run_id:
            found.append((parsed[1], job.submission_id or "", job.status))
    return [(submission_id, status) for _, submission_id, status in sorted(found)]


def supervisor(head: LocalRayHead, submission_id: str) -> dict[str, Any] | None:
    """Ray's record of the job's supervisor actor: what holds the job's entrypoint resources."""
    assert head.info is not None
    response = httpx.get(
        f"{head.info.dashboard_url}/api/v0/actors",
        params={"limit": 10000, "detail": "true"},
        headers=head.auth_headers(),
        timeout=30,
    )
    response.raise_for_status()
    name = f"_ray_internal_job_actor_{submission_id}"
    for actor in response.json()["data"]["result"]["result"]:
        if actor.get("name") == name:
            found: dict[str, Any] = actor
            return found
    return None


def test_each_job_reserves_a_driver_slot_and_a_job_beyond_the_slots_waits(
    head: LocalRayHead, store: Store, tmp_path: Path
) -> None:
    hold, first_done = tmp_path / "hold", tmp_path / "first-done"
    os.mkfifo(hold)
    first, second = store.create_run(tiny_run()), store.create_run(tiny_run())
    # The first driver holds its slot until the test lets it go; the second succeeds only if it
    # started after the first had finished its work.
    script = (
        f'if [ "$4" = {first.id} ]; then cat {shlex.quote(str(hold))} >/dev/null '
        f"&& touch {shlex.quote(str(first_done))}; else test -e {shlex.quote(str(first_done))}; fi"
    )
    python = stand_in_python(tmp_path, script)
    launcher = launcher_for(head, None, python=python, driver_resource=DRIVER_SLOT)
    launcher.submit(first)
    wait_until(lambda: job_status(launcher, first.id) == JobStatus.RUNNING, 60, "the first job")
    launcher.submit(second)

    def waiting_for_a_slot() -> dict[str, Any] | None:
        actor = supervisor(head, second.id)
        return actor if actor and actor["state"] == "PENDING_CREATION" else None

    # Ray has tried to place the second job and holds it for want of the one slot.
    pending = wait_until(waiting_for_a_slot, 60, "Ray to hold the second job back")
    assert pending["required_resources"] == {DRIVER_SLOT: 1.0}
    held = supervisor(head, first.id)
    assert held is not None and held["required_resources"] == {DRIVER_SLOT: 1.0}
    assert job_status(launcher, second.id) == JobStatus.PENDING
    release(hold)
    wait_until(lambda: job_status(launcher, second.id).is_terminal(), 60, "the second job")
    assert job_status(launcher, first.id) == JobStatus.SUCCEEDED
    assert job_status(launcher, second.id) == JobStatus.SUCCEEDED, launcher.log_tail(second.id, 9)


def test_the_store_url_stays_out_of_the_jobs_when_told(
    head: LocalRayHead, store: Store, tmp_path: Path
) -> None:
    """Ray's job API shows each job's runtime env to whoever reaches it: with
    KPO_PASS_STORE_URL_TO_JOBS=false the URL (and its password) is not in it."""
    assert head.info is not None
    url = "redis://:hunter2-password@127.0.0.1:1/0"
    python = stand_in_python(tmp_path, "exit 0")
    kept_out, passed = store.create_run(tiny_run()), store.create_run(tiny_run())
    launcher_for(head, url, python=python, pass_store_url=False).submit(kept_out)
    launcher = launcher_for(head, url, python=python)
    launcher.submit(passed)
    shown = httpx.get(
        f"{head.info.dashboard_url}/api/jobs/{kept_out.id}", headers=head.auth_headers()
    )
    shown.raise_for_status()
    assert kept_out.id in shown.text
    assert "KPO_STORE_URL" not in shown.text and "hunter2" not in shown.text
    env = launcher.client().get_job_info(passed.id).runtime_env
    assert env is not None and env["env_vars"]["KPO_STORE_URL"] == url


def test_a_run_whose_driver_is_killed_is_resubmitted_and_resumes_from_its_checkpoint(
    head: LocalRayHead, store: Store, tmp_path: Path
) -> None:
    # The jobs report into this test's store, a directory (a local store) both sides open.
    launcher = launcher_for(head, str(tmp_path / "store"), driver_restarts=1)
    run = store.create_run(tiny_run("pipeline.steps=8", "pipeline.checkpoint_every=2"))
    launcher.submit(run)
    checkpoints = run_output_dir(head.data_dir, run.id) / "checkpoints"
    pid = wait_until(lambda: driver_pid(launcher, run.id), 120, "the run's driver")
    # Killed the moment its first checkpoint shows, before a fast machine finishes the run.
    wait_until(
        lambda: latest_checkpoint(checkpoints), 180, "the run's first checkpoint", every_s=0.02
    )
    os.kill(pid, signal.SIGKILL)  # no checkpoint, no report: the driver is just gone
    assert store.get_run(run.id).status == RunStatus.RUNNING
    assert len(store.read_metrics(run.id)) < 8
    reconciler = Reconciler(launcher, store, interval_s=0.5)
    done = reconciled_until_final(reconciler, store, run.id, 240)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert [t.status.value for t in done.transitions] == ["queued", "running", "succeeded"]
    assert [r["step"] for r in store.read_metrics(run.id)] == list(range(1, 9))
    resumed = f"{run.id}.r1"
    wait_until(lambda: job_status(launcher, resumed).is_terminal(), 60, "the second job to end")
    assert jobs_of(launcher, run.id) == [
        (run.id, JobStatus.FAILED),
        (resumed, JobStatus.SUCCEEDED),
    ]
    lines = store.tail_logs(run.id, 1000)
    assert any(
        f"(Ray job {run.id}: FAILED" in line
        and "submitted it again as attempt 1 (restart 1 of 1)" in line
        for line in lines
    ), lines
    assert any("resumed from the checkpoint of step" in line for line in lines), lines
    assert reconciler.reconcile() == []


def test_a_driver_that_keeps_dying_fails_its_run_with_the_log_tail_after_the_restarts(
    head: LocalRayHead, store: Store, tmp_path: Path
) -> None:
    script = 'echo "stand-in driver of $4: its node went away"; exit 3'
    launcher = launcher_for(head, None, python=stand_in_python(tmp_path, script), driver_restarts=1)
    run = store.create_run(tiny_run())
    launcher.submit(run)
    store.transition(run.id, RunStatus.RUNNING)  # what its driver reports before it dies
    reconciler = Reconciler(launcher, store, interval_s=0.5)
    done = reconciled_until_final(reconciler, store, run.id)
    assert done.status == RunStatus.FAILED
    assert done.error is not None
    assert "its Ray job ended FAILED before the run recorded its outcome" in done.error
    assert f"job {run.id}.r1, driver exit code 3, after 2 attempts" in done.error
    assert f"stand-in driver of {run.id}: its node went away" in done.error  # the log tail
    assert jobs_of(launcher, run.id) == [
        (run.id, JobStatus.FAILED),
        (f"{run.id}.r1", JobStatus.FAILED),
    ]
    lines = store.tail_logs(run.id, 100)
    assert [line for line in lines if "submitted it again" in line] == [
        f"[kpo] its driver ended without recording an outcome (Ray job {run.id}: FAILED, "
        f"{launcher.client().get_job_info(run.id).message}); submitted it again as attempt 1 "
        "(restart 1 of 1), which resumes from the run's latest checkpoint, if it has one"
    ]
    assert reconciler.reconcile() == []


def test_a_run_whose_job_is_gone_is_resubmitted_within_the_budget_the_store_keeps(
    head: LocalRayHead, store: Store, tmp_path: Path
) -> None:
    """A running run of which this cluster knows no job is what a restarted Ray cluster shows
    (its job history went with the old one). It is submitted again, counted in the store, and
    the restart it used counts when its new driver dies too."""
    script = 'echo "stand-in driver of $4: its node went away"; exit 3'
    launcher = launcher_for(head, None, python=stand_in_python(tmp_path, script), driver_restarts=1)
    run = store.create_run(tiny_run())
    store.transition(run.id, RunStatus.RUNNING)  # its driver was on the cluster that was lost
    reconciler = Reconciler(launcher, store, interval_s=0.5)
    done = reconciled_until_final(reconciler, store, run.id)
    assert done.status == RunStatus.FAILED and done.driver_restarts == 1
    assert done.error is not None
    assert f"job {run.id}.r1, driver exit code 3, after 2 attempts" in done.error, done.error
    assert jobs_of(launcher, run.id) == [(f"{run.id}.r1", JobStatus.FAILED)]
    lines = store.tail_logs(run.id, 100)
    assert [line for line in lines if "submitted it again" in line] == [
        "[kpo] its Ray job no longer exists (was the Ray cluster restarted?) (no job of the run "
        "on this Ray cluster); submitted it again as attempt 1 (restart 1 of 1), which resumes "
        "from the run's latest checkpoint, if it has one"
    ]
    assert reconciler.reconcile() == []


def test_a_run_resubmitted_after_its_job_was_gone_is_cancelled_through_the_api(
    head: LocalRayHead, store: Store, tmp_path: Path
) -> None:
    """On a restarted cluster the run's only job is a later attempt (`.r1`, no `RUN_ID`): the
    cancel still finds it and stops it."""
    launcher = launcher_for(head, None, python=stand_in_python(tmp_path, "exec sleep 600"))
    run = store.create_run(tiny_run())
    store.transition(run.id, RunStatus.RUNNING)
    reconciler = Reconciler(launcher, store)
    assert reconciler.reconcile() == [
        f"{run.id}: its Ray job no longer exists (was the Ray cluster restarted?) (no job of the "
        "run on this Ray cluster); resubmitted (restart 1 of 2)"
    ]
    resumed = f"{run.id}.r1"
    wait_until(lambda: job_status(launcher, resumed) == JobStatus.RUNNING, 60, "the new job")
    assert cancel_run(run.id, store, launcher).cancel_requested_at is not None
    wait_until(lambda: job_status(launcher, resumed).is_terminal(), 60, "the job to stop")
    assert jobs_of(launcher, run.id) == [(resumed, JobStatus.STOPPED)]
    done = reconciled_until_final(reconciler, store, run.id)
    assert done.status == RunStatus.CANCELLED, done.error


@pytest.mark.parametrize("how", ["restarts-used-up", "cancel-requested"])
def test_a_run_whose_job_is_gone_is_not_resubmitted_past_its_budget_or_its_cancel(
    head: LocalRayHead, store: Store, tmp_path: Path, how: str
) -> None:
    launcher = launcher_for(
        head, None, python=stand_in_python(tmp_path, "exit 0"), driver_restarts=2
    )
    run = store.create_run(tiny_run())
    store.transition(run.id, RunStatus.RUNNING)
    if how == "restarts-used-up":
        store.record_driver_restarts(run.id, 2)  # both spent on clusters lost before this one
    else:
        store.request_cancel(run.id)
    actions = Reconciler(launcher, store).reconcile()
    assert actions == [
        f"{run.id}: its job ended without a recorded outcome; recorded "
        + ("failed" if how == "restarts-used-up" else "cancelled")
    ]
    done = store.get_run(run.id)
    gone = "its Ray job no longer exists (was the Ray cluster restarted?)"
    if how == "restarts-used-up":
        assert done.status == RunStatus.FAILED
        assert done.error == f"{gone}; not submitted again: its restarts (2) were used up"
    else:
        assert done.status == RunStatus.CANCELLED and done.error == gone
    assert jobs_of(launcher, run.id) == []


@pytest.mark.parametrize("how", ["stopped", "exited-as-cancelled", "cancelled-after-it-died"])
def test_a_cancelled_run_is_never_resubmitted(
    head: LocalRayHead, store: Store, tmp_path: Path, how: str
) -> None:
    script = {
        "stopped": "exec sleep 600",  # a driver that runs until it is stopped
        "exited-as-cancelled": "exit 130",  # `kpo execute` of a cancelled run, its report lost
        "cancelled-after-it-died": "exit 3",
    }[how]
    python = stand_in_python(tmp_path, script)
    launcher = launcher_for(head, None, python=python)
    run = store.create_run(tiny_run())
    launcher.submit(run)
    store.transition(run.id, RunStatus.RUNNING)
    if how == "stopped":
        wait_until(lambda: job_status(launcher, run.id) == JobStatus.RUNNING, 60, "the job")
        launcher.stop(run.id)  # the stop alone, without the request the API stores first
    else:
        wait_until(lambda: job_status(launcher, run.id).is_terminal(), 60, "the job to end")
        if how == "cancelled-after-it-died":
            # What the API's cancel of a running run does; its stop finds no live job.
            store.request_cancel(run.id)
            launcher.stop(run.id)
    # Seen by a launcher that was never asked to stop anything, as by a control plane
    # restarted since: from Ray's side, or from the store's.
    reconciler = Reconciler(launcher_for(head, None), store, interval_s=0.5)
    done = reconciled_until_final(reconciler, store, run.id)
    assert done.status == RunStatus.CANCELLED, done.error
    assert reconciler.reconcile() == []
    ended = JobStatus.STOPPED if how == "stopped" else JobStatus.FAILED
    assert jobs_of(launcher, run.id) == [(run.id, ended)]


def test_a_cancel_stored_before_its_driver_died_holds_for_another_control_plane(
    head: LocalRayHead, store: Store, tmp_path: Path
) -> None:
    """One control plane takes the cancel, stores it and cannot reach Ray's job server; then the
    driver dies without a report. Another control plane, whose launcher never heard of the
    cancel, records the run cancelled and does not submit it again."""
    launcher, run, hold = held_running_driver(head, store, tmp_path)
    assert cancel_cut_off_from_ray(head, store, run.id) == 503
    requested = store.get_run(run.id).cancel_requested_at
    assert requested is not None
    release(hold)
    wait_until(lambda: job_status(launcher, run.id).is_terminal(), 60, "the driver to die")
    assert job_status(launcher, run.id) == JobStatus.FAILED  # Ray saw no stop

    reconciler = Reconciler(launcher_for(head, None), store, interval_s=0.5)
    done = reconciled_until_final(reconciler, store, run.id)
    assert done.status == RunStatus.CANCELLED, done.error
    assert done.error is not None
    assert f"driver exit code 3, cancel requested at {requested.isoformat()}" in done.error
    assert reconciler.reconcile() == []
    assert jobs_of(launcher, run.id) == [(run.id, JobStatus.FAILED)]  # no `.r1`


def test_a_stored_cancel_whose_stop_never_reached_ray_is_carried_out_by_the_reconciler(
    head: LocalRayHead, store: Store, tmp_path: Path
) -> None:
    """The cancel route stored the request but could not reach Ray (503): the job would run on.
    The reconciler stops it, and the run ends cancelled without being submitted again."""
    launcher, run, _ = held_running_driver(head, store, tmp_path)  # never released
    cancel_cut_off_from_ray(head, store, run.id)
    assert job_status(launcher, run.id) == JobStatus.RUNNING

    reconciler = Reconciler(launcher_for(head, None), store, interval_s=0.5, finish_grace_s=0)
    done = reconciled_until_final(reconciler, store, run.id)
    assert done.status == RunStatus.CANCELLED, done.error
    assert jobs_of(launcher, run.id) == [(run.id, JobStatus.STOPPED)]


def test_a_head_recorded_where_older_releases_kept_it_is_found_and_its_record_moved(
    head: LocalRayHead, tmp_path: Path
) -> None:
    assert head.info is not None
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    legacy = data_dir / LEGACY_HEAD_FILE
    legacy.write_text(json.dumps(asdict(head.info)))
    legacy.chmod(0o600)
    assert LocalRayHead(data_dir, temp_dir=Path("/tmp/unused")).ensure() == head.info
    assert not legacy.exists() and read_head_file(data_dir / HEAD_FILE) == head.info
    assert (data_dir / HEAD_DIR).stat().st_mode & 0o777 == 0o700


def test_the_job_server_listens_on_loopback_only_and_no_port_serves_without_the_token(
    head: LocalRayHead,
) -> None:
    assert head.info is not None
    daemons = set()
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == head.info.pgid:
                daemons.add(process.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    sockets = listening(daemons)
    job_server = urlsplit(head.info.dashboard_url).port
    assert {c.laddr.ip for c in sockets if c.laddr.port == job_server} == {"127.0.0.1"}
    # Ray binds its other ports beyond loopback (see LocalRayHead): none of them may answer an
    # HTTP client without the token. (Ray's gRPC ports do not speak HTTP/1.1 at all.)
    answered = http_answers_without_token(sockets)
    assert answered and set(answered.values()) <= {401, 403}, answered
