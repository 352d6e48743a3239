"""Shared pieces of the tests that launch runs as real Ray jobs on a real local Ray head."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from ray.job_submission import JobStatus

from services.jobs.launcher import RayJobLauncher, local_job_env
from services.jobs.ray_head import LocalRayHead
from services.pipeline.specs import apply_overrides
from services.spec import RunSpec
from services.store import RunRecord, RunStatus, Store
from tests.services.pipeline.conftest import TINY_RUN

T = TypeVar("T")

# Two runs at a time fit: each reserves a generation worker and a learner (one CPU each).
HEAD_CPUS = 4
# The custom resource of the runs' drivers, as the Helm chart's head advertises it.
DRIVER_SLOT = "kpo_driver"
FINAL = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)


@contextmanager
def local_head(
    data_dir: Path, resources: Mapping[str, float] | None = None
) -> Iterator[LocalRayHead]:
    """A started `LocalRayHead` for `data_dir` (advertising custom `resources`), stopped (with
    its jobs) at the end.

    Its session files go to a short directory of its own: Ray's socket paths must stay short,
    and pytest's temporary paths are long.
    """
    temp_dir = Path(tempfile.mkdtemp(prefix="kr-", dir="/tmp"))
    head = LocalRayHead(data_dir, num_cpus=HEAD_CPUS, resources=resources, temp_dir=temp_dir)
    head.ensure()
    try:
        yield head
    finally:
        stop_live_jobs(launcher_for(head, None))
        head.stop(timeout_s=2.0)
        shutil.rmtree(temp_dir, ignore_errors=True)


def launcher_for(head: LocalRayHead, store_url: str | None, **options: Any) -> RayJobLauncher:
    """A launcher of jobs on `head` that report to the store at `store_url` (None: local)."""
    assert head.info is not None
    options = {"headers": head.auth_headers(), "env": local_job_env(), **options}
    return RayJobLauncher(head.info.dashboard_url, head.data_dir, store_url, **options)


def stop_live_jobs(launcher: RayJobLauncher) -> None:
    """Stop every job still running, so that the next test (or module) starts on an idle head."""
    client = launcher.client()
    live = [j for j in client.list_jobs() if j.submission_id and not j.status.is_terminal()]
    for job in live:
        assert job.submission_id is not None
        client.stop_job(job.submission_id)
    for job in live:
        submission_id = job.submission_id
        assert submission_id is not None

        def ended(job_id: str = submission_id) -> bool:
            return bool(client.get_job_status(job_id).is_terminal())

        wait_until(ended, 60, f"job {submission_id} to stop")


def stand_in_python(directory: Path, script: str) -> str:
    """An executable to give a launcher as its `python`: it runs the shell `script` instead of
    the driver (`$4` is the run id), for jobs whose driver must fail, hang or exit in a given
    way without running a pipeline."""
    path = directory / "stand-in-python"
    path.write_text(f"#!/bin/sh\n{script}\n", encoding="utf-8")
    path.chmod(0o755)
    return str(path)


def job_status(launcher: RayJobLauncher, run_id: str) -> JobStatus:
    status: JobStatus = launcher.client().get_job_status(run_id)
    return status


def driver_pid(launcher: RayJobLauncher, submission_id: str) -> int | None:
    """The pid of the job's driver, once Ray has started it."""
    info = launcher.client().get_job_info(submission_id).driver_info
    return int(info.pid) if info is not None and info.pid else None


def tiny_run(*overrides: str) -> dict[str, Any]:
    """TINY_RUN with overrides, resolved as the API stores it."""
    spec = RunSpec.model_validate(apply_overrides(TINY_RUN, overrides))
    return spec.model_dump(mode="json")


def wait_until(
    check: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 0.25
) -> T:
    """Call `check` until it returns something truthy (returned); fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def final(store: Store, run_id: str, timeout_s: float = 120) -> RunRecord:
    """The run once it has finished."""

    def finished() -> RunRecord | None:
        run = store.get_run(run_id)
        return run if run.status in FINAL else None

    return wait_until(finished, timeout_s, f"run {run_id} to finish")


def release(fifo: Path) -> None:
    """Let a stand-in driver blocked reading `fifo` go on: open it for writing once it has a
    reader (until then the open fails with ENXIO), and close it, which gives the reader EOF."""

    def opened() -> bool:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return False
        os.close(fd)
        return True

    wait_until(opened, 60, f"a reader of {fifo}")
