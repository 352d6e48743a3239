"""Runs as Ray jobs: the control plane's launcher (the local Ray head it uses by default is
`services.jobs.ray_head`; the reconciler that repairs what a crash leaves is
`services.jobs.reconciler`).

Each run is a Ray job whose entrypoint is `python -m services.cli execute RUN_ID` (see
`services.pipeline.job`): the job's driver reads the spec from the store and reports status,
metrics and log lines back into it. The job's submission id is the run id; when its driver died
without recording the outcome, the reconciler submits the run again as `RUN_ID.r1`, `RUN_ID.r2`,
... (Ray's submission ids are unique), and that driver resumes from the run's latest checkpoint.
The run's newest attempt is the job with the highest suffix. The control plane keeps no state of
its own about a run, so it can restart at any time: the jobs go on, and the reconciler picks them
up again.

What each job gets (`JobSettings`): `KPO_DATA_DIR`, and `KPO_STORE_URL` unless
`KPO_PASS_STORE_URL_TO_JOBS=false` (the Ray nodes then have it in their own environment: Ray's
job API shows every job's runtime environment, password and all); one unit of the custom resource
`KPO_RAY_DRIVER_RESOURCE` of the head, if set (on a cluster), so that the head runs at most as
many drivers as it advertises units and further jobs wait in Ray's queue; and
`KPO_RAY_DRIVER_CPUS` CPUs for the driver (default none, as Ray's own default: the driver waits on
its actors, which reserve their CPUs themselves).

Where the jobs run (the variables are `JobSettings`'s):

- `RAY_ADDRESS` set (a KubeRay cluster): that cluster's job server. Accepted forms:
  `http://HOST:PORT` / `https://HOST:PORT` (the job server, i.e. the dashboard: used as it is);
  `ray://HOST[:PORT]` (Ray Client) and `HOST:PORT` (the GCS, e.g. `raycluster-head-svc:6379`):
  the job server is taken to be the dashboard on the same host at port 8265, KubeRay's default.
  `RAY_API_SERVER_ADDRESS`, when set, names the job server directly and wins. A cluster with
  Ray's token authentication gets the token Ray's settings name (`ray_auth_headers`).
- Otherwise a `LocalRayHead`: a Ray head with its job server started on this machine as
  daemons of their own (`ray start --head`), so that runs survive a restart of the control plane;
  its address is kept in `<data dir>/ray-head/ray-head.json` and a live head is reused.
  `stop_local_head` (`kpo serve --stop`) ends it.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ray.job_submission import JobDetails, JobErrorType, JobStatus, JobSubmissionClient

import services
from services.jobs.ray_head import LocalRayHead, job_server_answers, read_text_or_none
from services.jobs.settings import JobSettings
from services.store import RunRecord
from services.store.base import RUN_ID_PATTERN

log = logging.getLogger(__name__)

DEFAULT_DASHBOARD_PORT = 8265  # Ray's, and KubeRay's head service's
# Ray's default time between the SIGTERM of `stop_job` and a SIGKILL is 3 s; a cancelled run
# needs longer to finish its learner step and write its checkpoint.
DEFAULT_STOP_WAIT_S = 120
DEFAULT_DRIVER_RESTARTS = 2  # JobSettings.driver_restarts
# A run's job ids: the run id (its first attempt), then `.r1`, `.r2`, ... for its resubmissions.
JOB_ID_PATTERN = re.compile(rf"(?P<run>{RUN_ID_PATTERN.pattern})(?:\.r(?P<attempt>[1-9][0-9]*))?")


def job_server_url(ray_address: str) -> str:
    """The job server URL of the cluster that a `RAY_ADDRESS` value names (forms: module doc)."""
    address = ray_address.strip().rstrip("/")
    if address.startswith(("http://", "https://")):
        return address
    if address.startswith("ray://"):
        address = address.removeprefix("ray://")
    elif "://" in address:
        raise ValueError(
            f"RAY_ADDRESS {ray_address!r}: use http(s)://HOST:PORT (the job server), "
            "ray://HOST:PORT or HOST:PORT"
        )
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or "]:" in address else address
    if not host:
        raise ValueError(f"RAY_ADDRESS {ray_address!r} names no host")
    return f"http://{host}:{DEFAULT_DASHBOARD_PORT}"


def cluster_job_server_url(settings: JobSettings | None = None) -> str | None:
    """The job server of the cluster that the settings name; None when they name none."""
    settings = JobSettings() if settings is None else settings
    if settings.ray_api_server_address:
        return settings.ray_api_server_address.rstrip("/")
    if settings.ray_address:
        return job_server_url(settings.ray_address)
    return None


def ray_auth_headers(settings: JobSettings | None = None) -> dict[str, str]:
    """The header a token-authenticated Ray cluster wants, from Ray's own settings.

    With `RAY_AUTH_MODE=token`: the token of `RAY_AUTH_TOKEN`, else of the file at
    `RAY_AUTH_TOKEN_PATH`, else of `~/.ray/auth_token` (Ray's order). No header otherwise.
    """
    settings = JobSettings() if settings is None else settings
    if settings.ray_auth_mode.lower() != "token":
        return {}
    secret = settings.ray_auth_token
    token = (secret.get_secret_value() if secret else "") or read_text_or_none(
        settings.ray_auth_token_path or Path.home() / ".ray" / "auth_token"
    )
    return {"Authorization": f"Bearer {token}"} if token else {}


def local_job_env(settings: JobSettings | None = None) -> dict[str, str]:
    """Environment that lets a job on this machine import this very checkout of the package."""
    settings = JobSettings() if settings is None else settings
    root = str(Path(services.__file__).resolve().parents[1])
    paths = [root, *settings.pythonpath.split(os.pathsep)]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(p for p in paths if p))}


# --- a run's jobs --------------------------------------------------------------------------


def job_id(run_id: str, attempt: int) -> str:
    """The submission id of the run's job for `attempt` (0: its first)."""
    return run_id if attempt == 0 else f"{run_id}.r{attempt}"


def parse_job_id(submission_id: str) -> tuple[str, int] | None:
    """(run id, attempt) of a run's job id; None for any other job's."""
    match = JOB_ID_PATTERN.fullmatch(submission_id)
    if match is None:
        return None
    return match["run"], int(match["attempt"] or 0)


def never_started(job: JobDetails) -> bool:
    """Whether the job failed before its driver started because Ray found no room for it in time
    (`RAY_JOB_START_TIMEOUT_SECONDS` on the head, 15 minutes by default): it waited for a driver
    slot or for CPUs, and its driver never had a chance to fail."""
    return (
        job.status == JobStatus.FAILED
        and job.error_type == JobErrorType.JOB_SUPERVISOR_ACTOR_START_TIMEOUT.value
    )


@dataclass(frozen=True)
class RunJobs:
    """A run's Ray jobs, one per attempt, oldest first (never empty)."""

    run_id: str
    jobs: tuple[JobDetails, ...]

    @property
    def latest(self) -> JobDetails:
        """The newest attempt: the one that is (or was last) the run's."""
        return self.jobs[-1]

    @property
    def next_attempt(self) -> int:
        latest = self.latest.submission_id
        parsed = parse_job_id(latest) if latest else None
        return (parsed[1] if parsed else len(self.jobs) - 1) + 1

    @property
    def driver_attempts(self) -> int:
        """The attempts whose driver had a chance to run (what the restart limit counts)."""
        return sum(1 for job in self.jobs if not never_started(job))


# --- runs as Ray jobs -----------------------------------------------------------------------


class RayJobLauncher:
    """Starts and stops runs as jobs of the Ray job server at `dashboard_url` (a `RunLauncher`).

    `data_dir` and `store_url` are what the jobs get as `KPO_DATA_DIR` and `KPO_STORE_URL`: where
    run outputs go, and the store they report to, as seen from the Ray cluster (with a local
    store, the jobs open the same SQLite file as the control plane); with `pass_store_url` false
    the jobs get no `KPO_STORE_URL` and read the Ray nodes' own. `env` adds variables; `python`
    is the interpreter that runs the entrypoint on the cluster. Each job reserves `driver_cpus`
    CPUs and, with `driver_resource`, one unit of that custom resource. `driver_restarts` is how
    often the reconciler resubmits a run whose driver died without recording its outcome.
    """

    def __init__(
        self,
        dashboard_url: str,
        data_dir: Path,
        store_url: str | None,
        *,
        headers: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        stop_wait_s: int = DEFAULT_STOP_WAIT_S,
        pass_store_url: bool = True,
        driver_resource: str | None = None,
        driver_cpus: float = 0.0,
        driver_restarts: int = DEFAULT_DRIVER_RESTARTS,
    ) -> None:
        self.dashboard_url = dashboard_url.rstrip("/")
        self.data_dir = Path(data_dir).expanduser()
        self.store_url = store_url
        self.headers = dict(headers or {})
        self.env = dict(env or {})
        self.python = python
        self.stop_wait_s = stop_wait_s
        self.pass_store_url = pass_store_url
        self.driver_resource = driver_resource
        self.driver_cpus = driver_cpus
        self.driver_restarts = driver_restarts
        self._client_instance: JobSubmissionClient | None = None
        self._lock = threading.Lock()

    # --- the launcher protocol ---------------------------------------------------------------

    def submit(self, run: RunRecord) -> None:
        """Submit the run's first job; a job that exists already (a resubmission) is left as it
        is."""
        self.submit_attempt(run, 0)

    def stop(self, run_id: str) -> None:
        """Ask the run's newest job to stop; nothing to do if it never started or has ended.

        Nothing is remembered here: a cancel is kept in the store (`Store.request_cancel`, which
        the API calls first), where the reconciler of every control plane finds it.
        """
        jobs = self.jobs_of(run_id)
        if jobs is None or jobs.latest.status.is_terminal():
            return
        latest = jobs.latest.submission_id
        assert latest is not None  # found by its submission id
        try:
            self.client().stop_job(latest)
        except RuntimeError as error:
            if "does not exist" in str(error) or "404" in str(error):
                return
            raise

    def live_runs(self) -> set[str]:
        """Ids of the runs with a job that has not ended on Ray. A job stopped before its driver
        started stays pending until Ray places its supervisor (which then stops at once): Ray's
        job server can neither delete a job that has not ended nor cancel a pending one, so such
        a job counts until it has really gone."""
        return {
            run_id
            for run_id, jobs in self.run_jobs().items()
            if any(not job.status.is_terminal() for job in jobs.jobs)
        }

    def ready(self) -> bool:
        return job_server_answers(self.dashboard_url, self.headers)

    def close(self) -> None:
        """Nothing to release: the job server's client keeps no connection open, and the jobs
        go on."""

    # --- attempts, for the reconciler --------------------------------------------------------

    def submit_attempt(self, run: RunRecord, attempt: int) -> bool:
        """Submit the run's job for `attempt` (0: the first; `.rN`: a resubmission whose driver
        resumes from the run's latest checkpoint); whether it is new. A job that exists already
        (a retry, or another control plane's reconciler was first) is left as it is."""
        submission_id = job_id(run.id, attempt)
        resources = {self.driver_resource: 1.0} if self.driver_resource else None
        try:
            self.client().submit_job(
                entrypoint=self.entrypoint(run.id),
                submission_id=submission_id,
                runtime_env={"env_vars": self.job_env()},
                metadata={
                    "kpo_run_id": run.id,
                    "kpo_run_name": str(run.spec.get("name", "")),
                    "kpo_attempt": str(attempt),
                },
                # None rather than 0: Ray's default, and no version check of the server for it.
                entrypoint_num_cpus=self.driver_cpus or None,
                entrypoint_resources=resources,
            )
        except RuntimeError as error:
            if "already exists" in str(error):
                return False
            raise
        log.info("submitted run %s as the Ray job %s", run.id, submission_id)
        return True

    def stop_live_jobs(self, timeout_s: float) -> list[str]:
        """Stop every job of the job server that is still pending or running and wait up to
        `timeout_s` for them to end; their submission ids. For a head about to be stopped."""
        client = self.client()
        live = [
            job.submission_id
            for job in client.list_jobs()
            if job.submission_id and not job.status.is_terminal()
        ]
        for submission_id in live:
            client.stop_job(submission_id)
        deadline = time.monotonic() + timeout_s
        waiting = list(live)
        while waiting and time.monotonic() < deadline:
            waiting = [j for j in waiting if not client.get_job_status(j).is_terminal()]
            if waiting:
                time.sleep(0.5)
        if waiting:
            log.warning("jobs still live after %.0f s: %s", timeout_s, ", ".join(waiting))
        return live

    # --- what a job gets ---------------------------------------------------------------------

    def entrypoint(self, run_id: str) -> str:
        return shlex.join([self.python, "-m", "services.cli", "execute", run_id])

    def job_env(self) -> dict[str, str]:
        # Not ACTOR_ENV: the driver passes it to `ray.init` itself, and Ray refuses a driver whose
        # runtime env repeats a variable of its job's.
        env = {
            "KPO_DATA_DIR": str(self.data_dir),
            # Read by Ray's job supervisor: how long a stopped run may take to cancel cleanly.
            "RAY_JOB_STOP_WAIT_TIME_S": str(self.stop_wait_s),
            **self.env,
        }
        if self.store_url and self.pass_store_url:
            env["KPO_STORE_URL"] = self.store_url
        return env

    # --- what the reconciler reads -----------------------------------------------------------

    def run_jobs(self) -> dict[str, RunJobs]:
        """The jobs of the job server that are runs' jobs, by run id."""
        attempts: dict[str, list[tuple[int, JobDetails]]] = {}
        for job in self.client().list_jobs():
            parsed = parse_job_id(job.submission_id) if job.submission_id else None
            if parsed is not None:
                attempts.setdefault(parsed[0], []).append((parsed[1], job))
        return {
            run_id: RunJobs(run_id, tuple(job for _, job in sorted(found, key=lambda a: a[0])))
            for run_id, found in attempts.items()
        }

    def jobs_of(self, run_id: str) -> RunJobs | None:
        """The run's jobs; None if there is none.

        From the list of every job, not by asking for attempt 0, 1, ... until one is missing:
        on a Ray cluster restarted since the run began, its first job is a later attempt.
        """
        return self.run_jobs().get(run_id)

    def log_tail(self, submission_id: str, lines: int) -> str:
        """The last `lines` lines of a job's log (or why there are none), for an error."""
        try:
            text: str = self.client().get_job_logs(submission_id)
        except RuntimeError as error:
            return f"(no log: {error})"
        tail = text.rstrip().splitlines()[-lines:]
        return "\n".join(tail) if tail else "(the log is empty)"

    def client(self) -> JobSubmissionClient:
        """The job server's client, made on first use (its constructor calls the server)."""
        with self._lock:
            if self._client_instance is None:
                self._client_instance = JobSubmissionClient(
                    self.dashboard_url, headers=self.headers
                )
            return self._client_instance


def launcher_from_env(
    data_dir: Path,
    store_url: str | None,
    settings: JobSettings | None = None,
    head_cpus: int | None = None,
) -> RayJobLauncher:
    """The launcher `kpo serve` uses: on the cluster that `settings` name (RAY_ADDRESS), else on
    a local head (with `head_cpus` CPUs when it has to be started). `settings`: default, read
    from the environment.

    On a cluster the entrypoint runs `python` from the PATH of the cluster's image, and the
    data directory and store URL must mean the same there as here (a shared volume, Redis).
    """
    settings = JobSettings() if settings is None else settings
    data_dir = Path(data_dir).expanduser().resolve()
    url = cluster_job_server_url(settings)
    if url is not None:
        if not store_url or "://" not in store_url:
            log.warning(
                "runs go to the Ray cluster at %s but the store is local to this machine: "
                "set KPO_STORE_URL=redis://... so that the jobs can report",
                url,
            )
        return RayJobLauncher(
            url,
            data_dir,
            store_url,
            headers=ray_auth_headers(settings),
            python="python",
            pass_store_url=settings.pass_store_url_to_jobs,
            driver_resource=settings.ray_driver_resource,
            driver_cpus=settings.ray_driver_cpus,
            driver_restarts=settings.driver_restarts,
        )
    if settings.ray_driver_resource:
        # The local head advertises no such resource: jobs reserving it would wait forever.
        log.warning(
            "KPO_RAY_DRIVER_RESOURCE=%s is for a Ray cluster whose head advertises it; the "
            "local Ray head does not, so its jobs reserve none",
            settings.ray_driver_resource,
        )
    head = LocalRayHead(data_dir, num_cpus=head_cpus)
    info = head.ensure()
    return RayJobLauncher(
        info.dashboard_url,
        data_dir,
        store_url,
        headers=head.auth_headers(),
        env=local_job_env(settings),
        pass_store_url=settings.pass_store_url_to_jobs,
        driver_cpus=settings.ray_driver_cpus,
        driver_restarts=settings.driver_restarts,
    )


def stop_local_head(data_dir: Path, stop_wait_s: float = DEFAULT_STOP_WAIT_S) -> str:
    """Stop the local Ray head of `data_dir` (`kpo serve --stop`); what it did, in words.

    Its live jobs are stopped first, as a cancel does, so that each run's driver checkpoints
    and records `cancelled` (it has up to `stop_wait_s`) instead of dying with the head and
    leaving its run `running` with no one to finish it. Raises `HeadFileError` for a record of
    the head that is not to be trusted.
    """
    head = LocalRayHead(data_dir)
    info = head.live()
    if info is None:
        head.stop()  # forgets a recorded head that is gone
        return f"no local Ray head is running for {head.data_dir}"
    launcher = RayJobLauncher(info.dashboard_url, head.data_dir, None, headers=head.auth_headers())
    stopped = launcher.stop_live_jobs(stop_wait_s + 10)
    head.stop()
    cancelled = f"; its {len(stopped)} live job(s) stopped first" if stopped else ""
    return f"stopped the local Ray head at {info.dashboard_url}{cancelled}"
