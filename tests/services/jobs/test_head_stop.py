"""What needs a real local Ray head of its own: `kpo serve --stop` ends it cleanly (its live jobs
are stopped first); a job that waited longer than Ray's start timeout for a driver slot is
submitted again without counting as a restart of its driver; and a run whose whole Ray cluster
was restarted goes on, on the new one, from its checkpoint."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from ray.job_submission import JobStatus
from typer.testing import CliRunner

from services.cli import app
from services.jobs.launcher import never_started
from services.jobs.ray_head import HEAD_FILE, LocalRayHead, job_server_answers
from services.jobs.reconciler import Reconciler
from services.pipeline.checkpoints import latest_checkpoint
from services.pipeline.job import run_output_dir
from services.store import LocalStore, RunStatus
from tests.services.jobs.ray_support import (
    DRIVER_SLOT,
    HEAD_CPUS,
    driver_pid,
    final,
    job_status,
    launcher_for,
    release,
    stand_in_python,
    stop_live_jobs,
    tiny_run,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)

runner = CliRunner()


@contextmanager
def own_head(
    data_dir: Path, resources: Mapping[str, float] | None = None
) -> Iterator[LocalRayHead]:
    """A head for one test, which may stop it; whatever is left of it is stopped at the end."""
    temp_dir = Path(tempfile.mkdtemp(prefix="kr-", dir="/tmp"))
    head = LocalRayHead(data_dir, num_cpus=HEAD_CPUS, resources=resources, temp_dir=temp_dir)
    head.ensure()
    try:
        yield head
    finally:
        if head.live() is not None:
            stop_live_jobs(launcher_for(head, None))
        head.stop(timeout_s=2.0)
        shutil.rmtree(temp_dir, ignore_errors=True)


def gone(process: psutil.Process) -> bool:
    """Whether the process has ended: no longer there, or a zombie whose parent (Ray's job
    supervisor, dead with the head) is not there to reap it."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_serve_stop_stops_the_live_jobs_first_then_ends_the_head(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with own_head(data_dir) as head:
        info = head.info
        assert info is not None
        started, stopped = tmp_path / "started", tmp_path / "stopped"
        # A driver that, like the real one, takes SIGTERM as its cancel and exits 130.
        script = (
            f"trap 'touch {shlex.quote(str(stopped))}; exit 130' TERM; "
            f"touch {shlex.quote(str(started))}; sleep 600 & wait"
        )
        launcher = launcher_for(head, None, python=stand_in_python(tmp_path, script))
        store = LocalStore(tmp_path / "store")
        try:
            run = store.create_run(tiny_run())
            launcher.submit(run)
            wait_until(started.exists, 60, "the driver to start")
        finally:
            store.close()
        env = {"KPO_DATA_DIR": str(data_dir), "RAY_ADDRESS": None}
        result = runner.invoke(app, ["serve", "--stop"], env=env)
        assert result.exit_code == 0, result.output
        assert result.output == (
            f"[kpo] stopped the local Ray head at {info.dashboard_url}; "
            "its 1 live job(s) stopped first\n"
        )
        assert stopped.exists()  # the driver had its cancel, not the SIGKILL of a dying head
        assert not (data_dir / HEAD_FILE).exists()
        assert not job_server_answers(info.dashboard_url, head.auth_headers())
        with pytest.raises(ProcessLookupError):
            os.killpg(info.pgid, 0)  # every daemon of its process group is gone
        again = runner.invoke(app, ["serve", "--stop"], env=env)
        assert again.exit_code == 0, again.output
        assert again.output == f"[kpo] no local Ray head is running for {data_dir.resolve()}\n"


def test_a_job_that_waited_too_long_for_a_slot_is_submitted_again_uncounted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Read by the head's job manager (it inherits this environment): 15 minutes by default.
    monkeypatch.setenv("RAY_JOB_START_TIMEOUT_SECONDS", "2")
    with own_head(tmp_path / "data", resources={DRIVER_SLOT: 1}) as head:
        store = LocalStore(tmp_path / "store")
        hold, first_done = tmp_path / "hold", tmp_path / "first-done"
        os.mkfifo(hold)
        first, second = store.create_run(tiny_run()), store.create_run(tiny_run())
        script = (
            f'if [ "$4" = {first.id} ]; then cat {shlex.quote(str(hold))} >/dev/null '
            f"&& touch {shlex.quote(str(first_done))}; "
            f"else test -e {shlex.quote(str(first_done))}; fi"
        )
        python = stand_in_python(tmp_path, script)
        # No restarts at all: only an attempt that never started may be followed by another.
        launcher = launcher_for(
            head, None, python=python, driver_resource=DRIVER_SLOT, driver_restarts=0
        )
        launcher.submit(first)
        wait_until(lambda: job_status(launcher, first.id) == JobStatus.RUNNING, 60, "first job")
        reconciler = Reconciler(launcher, store, interval_s=0.5)
        reconciler.start()  # it submits the second run, queued without a job
        try:

            def timed_out_and_resubmitted() -> bool:
                jobs = launcher.jobs_of(second.id)
                return jobs is not None and len(jobs.jobs) > 1 and never_started(jobs.jobs[0])

            wait_until(timed_out_and_resubmitted, 90, "the second job to time out and come back")
            release(hold)
            done = final(store, second.id)
            lines = store.tail_logs(second.id)
        finally:
            reconciler.close()
            store.close()
        assert done.status == RunStatus.SUCCEEDED, done.error
        jobs = launcher.jobs_of(second.id)
        assert jobs is not None and jobs.latest.status == JobStatus.SUCCEEDED
        assert all(never_started(job) for job in jobs.jobs[:-1]) and jobs.driver_attempts == 1
        assert any(
            "Ray found no room to start its job in time" in line
            and "(not counted as a restart)" in line
            for line in lines
        ), lines


@pytest.mark.slow
def test_a_run_whose_ray_cluster_is_restarted_resumes_on_the_new_one_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    """The head (and with it every daemon, actor and driver of the cluster) is ended while a
    real run trains; a new head starts for the same data directory, knowing no jobs. The
    reconciler submits the run there, and its driver resumes from the last checkpoint."""
    store_dir = tmp_path / "store"  # a local store both the jobs and the test open
    store = LocalStore(store_dir)
    try:
        run = store.create_run(tiny_run("pipeline.steps=8", "pipeline.checkpoint_every=2"))
        with own_head(tmp_path / "data") as head:
            launcher = launcher_for(head, str(store_dir), driver_restarts=1)
            launcher.submit(run)
            checkpoints = run_output_dir(head.data_dir, run.id) / "checkpoints"
            pid = wait_until(lambda: driver_pid(launcher, run.id), 120, "the run's driver")
            driver = psutil.Process(pid)
            wait_until(
                lambda: latest_checkpoint(checkpoints),
                180,
                "the run's first checkpoint",
                every_s=0.02,
            )
            # Frozen the moment its first checkpoint shows, the driver writes nothing more while
            # the head stops (seconds, in which a fast machine would otherwise finish the run).
            driver.suspend()
            # A head pod that dies takes every process in it along, the driver too. Here the
            # driver runs in a session of its own, outside the head's process group, so it is
            # killed as the pod's end would kill it, at once and without a word to the store.
            head.stop(timeout_s=2.0)
            with contextlib.suppress(psutil.NoSuchProcess):
                driver.kill()
            wait_until(lambda: gone(driver), 60, "the driver to go with its cluster")
            lost = store.get_run(run.id)
            assert lost.status == RunStatus.RUNNING and lost.driver_restarts == 0
            assert len(store.read_metrics(run.id)) < 8

            head.ensure()  # the new cluster
            launcher = launcher_for(head, str(store_dir), driver_restarts=1)
            assert launcher.jobs_of(run.id) is None
            reconciler = Reconciler(launcher, store, interval_s=0.5)
            reconciler.start()
            try:
                done = final(store, run.id, 240)
            finally:
                reconciler.close()
            assert done.status == RunStatus.SUCCEEDED, done.error
            resumed = launcher.jobs_of(run.id)
            assert resumed is not None
            assert [job.submission_id for job in resumed.jobs] == [f"{run.id}.r1"]
        assert done.driver_restarts == 1
        assert [t.status.value for t in done.transitions] == ["queued", "running", "succeeded"]
        assert [r["step"] for r in store.read_metrics(run.id)] == list(range(1, 9))
        lines = store.tail_logs(run.id, 1000)
        assert any(
            "(no job of the run on this Ray cluster); submitted it again as attempt 1 "
            "(restart 1 of 1)" in line
            for line in lines
        ), lines
        assert any("resumed from the checkpoint of step" in line for line in lines), lines
    finally:
        store.close()
