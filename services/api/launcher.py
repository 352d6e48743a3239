"""Runs as Ray jobs: the control plane's launcher (the local Ray head it uses by default is
`services.api.ray_head`).

Each run is one Ray job whose submission id is the run id and whose entrypoint is
`python -m services.cli execute RUN_ID` (see `services.pipeline.job`): the job's driver reads the
spec from the store and reports status, metrics and log lines back into it. The control plane
keeps no state of its own about a run, so it can restart at any time: the jobs go on, and the
reconciler (`RayJobLauncher.start_reconciler`) picks them up again.

Where the jobs run:

- `RAY_ADDRESS` set (a KubeRay cluster): that cluster's job server. Accepted forms:
  `http://HOST:PORT` / `https://HOST:PORT` (the job server, i.e. the dashboard: used as it is);
  `ray://HOST[:PORT]` (Ray Client) and `HOST:PORT` (the GCS, e.g. `raycluster-head-svc:6379`):
  the job server is taken to be the dashboard on the same host at port 8265, KubeRay's default.
  `RAY_API_SERVER_ADDRESS`, when set, names the job server directly and wins. A cluster with
  Ray's token authentication gets the token Ray's settings name (`ray_auth_headers`).
- Otherwise a `LocalRayHead`: a Ray head with its job server started on this machine as
  daemons of their own (`ray start --head`), so that runs survive a restart of the control plane;
  its address is kept in `<data dir>/ray-head.json` and a live head is reused.

The reconciler closes the gaps a crash can leave between the store and Ray: a run whose job
ended without recording its outcome (its driver died, or was killed before it could report) gets
the final state with the tail of the job's log as its error; a queued run with no job yet (the
control plane died between storing and submitting it) is submitted; a job whose run was
finished elsewhere (cancelled while still queued) is stopped.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

from ray.job_submission import JobDetails, JobStatus, JobSubmissionClient

import services
from services.api.ray_head import (
    LOG_TAIL_LINES,
    LocalRayHead,
    job_server_answers,
    read_text_or_none,
)
from services.store import (
    TERMINAL_STATUSES,
    InvalidTransition,
    RunNotFound,
    RunRecord,
    RunStatus,
    Store,
)
from services.store.base import RUN_ID_PATTERN

log = logging.getLogger(__name__)

DEFAULT_DASHBOARD_PORT = 8265  # Ray's, and KubeRay's head service's
# Ray's default time between the SIGTERM of `stop_job` and a SIGKILL is 3 s; a cancelled run
# needs longer to finish its learner step and write its checkpoint.
DEFAULT_STOP_WAIT_S = 120


class RunLauncher(Protocol):
    """What the API needs from a launcher."""

    def submit(self, run: RunRecord) -> None:
        """Start the run as a job whose id is the run id; idempotent."""

    def stop(self, run_id: str) -> None:
        """Ask the run's job to stop (SIGTERM: the driver checkpoints and records `cancelled`)."""

    def ready(self) -> bool:
        """Whether Ray's job server answers (for /readyz)."""

    def close(self) -> None:
        """Release what the launcher holds; the jobs go on."""


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


def cluster_job_server_url(environ: Mapping[str, str] | None = None) -> str | None:
    """The job server of the cluster named by the environment; None when there is none."""
    env = os.environ if environ is None else environ
    if env.get("RAY_API_SERVER_ADDRESS"):
        return env["RAY_API_SERVER_ADDRESS"].rstrip("/")
    if env.get("RAY_ADDRESS"):
        return job_server_url(env["RAY_ADDRESS"])
    return None


def ray_auth_headers(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The header a token-authenticated Ray cluster wants, from Ray's own settings.

    With `RAY_AUTH_MODE=token`: the token of `RAY_AUTH_TOKEN`, else of the file at
    `RAY_AUTH_TOKEN_PATH`, else of `~/.ray/auth_token` (Ray's order). No header otherwise.
    """
    env = os.environ if environ is None else environ
    if env.get("RAY_AUTH_MODE", "").lower() != "token":
        return {}
    token = env.get("RAY_AUTH_TOKEN") or read_text_or_none(
        Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    )
    return {"Authorization": f"Bearer {token}"} if token else {}


def local_job_env() -> dict[str, str]:
    """Environment that lets a job on this machine import this very checkout of the package."""
    root = str(Path(services.__file__).resolve().parents[1])
    paths = [root, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(p for p in paths if p))}


# --- runs as Ray jobs -----------------------------------------------------------------------


class RayJobLauncher:
    """Starts, stops and reconciles runs as jobs of the Ray job server at `dashboard_url`.

    `data_dir` and `store_url` are what the jobs get as `KPO_DATA_DIR` and `KPO_STORE_URL`: where
    run outputs go, and the store they report to, as seen from the Ray cluster (with a local
    store, the jobs open the same SQLite file as the control plane). `env` adds variables;
    `python` is the interpreter that runs the entrypoint on the cluster. A job still alive
    `finish_grace_s` after its run finished (cancelled while it was queued) is stopped by the
    reconciler.
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
        log_tail_lines: int = LOG_TAIL_LINES,
        finish_grace_s: float = 30.0,
    ) -> None:
        self.dashboard_url = dashboard_url.rstrip("/")
        self.data_dir = Path(data_dir).expanduser()
        self.store_url = store_url
        self.headers = dict(headers or {})
        self.env = dict(env or {})
        self.python = python
        self.stop_wait_s = stop_wait_s
        self.log_tail_lines = log_tail_lines
        self.finish_grace_s = finish_grace_s
        self._client_instance: JobSubmissionClient | None = None
        self._lock = threading.Lock()
        self._stop_reconciler = threading.Event()
        self._reconciler: threading.Thread | None = None

    # --- the launcher protocol ---------------------------------------------------------------

    def submit(self, run: RunRecord) -> None:
        """Submit the run's job; a job that exists already (a resubmission) is left as it is."""
        try:
            self.client().submit_job(
                entrypoint=self.entrypoint(run.id),
                submission_id=run.id,
                runtime_env={"env_vars": self.job_env()},
                metadata={"kpo_run_id": run.id, "kpo_run_name": str(run.spec.get("name", ""))},
            )
        except RuntimeError as error:
            if "already exists" in str(error):
                return
            raise
        log.info("submitted run %s as a Ray job", run.id)

    def stop(self, run_id: str) -> None:
        """Ask the run's job to stop; nothing to do if it never started or has ended."""
        try:
            self.client().stop_job(run_id)
        except RuntimeError as error:
            if "does not exist" in str(error) or "404" in str(error):
                return
            raise

    def ready(self) -> bool:
        return job_server_answers(self.dashboard_url, self.headers)

    def close(self) -> None:
        """Stop the reconciler; the jobs themselves go on."""
        self._stop_reconciler.set()
        if self._reconciler is not None:
            self._reconciler.join(timeout=30)
            self._reconciler = None

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
        if self.store_url:
            env["KPO_STORE_URL"] = self.store_url
        return env

    # --- reconciliation ----------------------------------------------------------------------

    def start_reconciler(self, store: Store, interval_s: float = 5.0) -> None:
        """Reconcile now and then every `interval_s` in a background thread, until `close()`."""
        if self._reconciler is not None:
            return
        self._stop_reconciler.clear()

        def loop() -> None:
            while True:
                try:
                    self.reconcile(store)
                except Exception as error:  # Ray or the store is down: the next pass retries
                    log.warning("reconciling runs with Ray jobs failed: %s", error)
                if self._stop_reconciler.wait(interval_s):
                    return

        self._reconciler = threading.Thread(target=loop, name="kpo-reconciler", daemon=True)
        self._reconciler.start()

    def reconcile(self, store: Store) -> list[str]:
        """One pass of bringing the store and Ray's jobs into agreement; what it did, in words.

        Ray's jobs are listed before the store is read, so a job seen as ended has made every
        write it will ever make: a run that still looks unfinished afterwards really is.
        """
        jobs = {
            job.submission_id: job
            for job in self.client().list_jobs()
            if job.submission_id and RUN_ID_PATTERN.fullmatch(job.submission_id)
        }
        actions: list[str] = []
        for run in _unfinished_runs(store):
            action = self._reconcile_run(store, run, jobs.get(run.id))
            if action:
                actions.append(action)
        for job in jobs.values():
            if not job.status.is_terminal():
                action = self._stop_if_finished(store, job)
                if action:
                    actions.append(action)
        for action in actions:
            log.info("reconciler: %s", action)
        return actions

    def _reconcile_run(self, store: Store, run: RunRecord, job: JobDetails | None) -> str | None:
        if job is None and run.status == RunStatus.QUEUED:
            self.submit(run)
            return f"{run.id}: queued without a job; submitted"
        if job is None:
            job = self._job_info(run.id)  # listed before it was submitted, perhaps
            if job is None:
                gone = "its Ray job no longer exists (was the Ray cluster restarted?)"
                return self._record_outcome(store, run, RunStatus.FAILED, gone)
        if not job.status.is_terminal():
            return None
        state = {
            JobStatus.SUCCEEDED: RunStatus.SUCCEEDED,
            JobStatus.STOPPED: RunStatus.CANCELLED,
        }.get(job.status, RunStatus.FAILED)
        error: str | None = None
        if state != RunStatus.SUCCEEDED:
            error = (
                f"its Ray job ended {job.status.value} before the run recorded its outcome "
                f"({job.message or 'no message'}); last lines of its log:\n{self._log_tail(run.id)}"
            )
        return self._record_outcome(store, run, state, error)

    def _record_outcome(
        self, store: Store, run: RunRecord, state: RunStatus, error: str | None
    ) -> str | None:
        try:
            if state == RunStatus.SUCCEEDED and run.status == RunStatus.QUEUED:
                store.transition(run.id, RunStatus.RUNNING)  # its own report was lost
            store.transition(run.id, state, error)
        except InvalidTransition:
            return None  # its driver (or a cancel) got there in between
        return f"{run.id}: its job ended without a recorded outcome; recorded {state.value}"

    def _stop_if_finished(self, store: Store, job: JobDetails) -> str | None:
        """Stop a live job whose run has finished already (cancelled while it was queued)."""
        assert job.submission_id is not None
        try:
            run = store.get_run(job.submission_id)
        except RunNotFound:
            return None  # a job of another control plane sharing this cluster
        if run.status not in TERMINAL_STATUSES:
            return None
        if time.time() - run.transitions[-1].at.timestamp() < self.finish_grace_s:
            return None  # its driver recorded the outcome and is on its way out
        self.stop(run.id)
        return f"{run.id}: {run.status.value} but its job was {job.status.value}; stopped it"

    def _job_info(self, run_id: str) -> JobDetails | None:
        try:
            info: JobDetails = self.client().get_job_info(run_id)
        except RuntimeError as error:
            if "does not exist" in str(error) or "404" in str(error):
                return None
            raise
        return info

    def _log_tail(self, run_id: str) -> str:
        try:
            text: str = self.client().get_job_logs(run_id)
        except RuntimeError as error:
            return f"(no log: {error})"
        lines = text.rstrip().splitlines()[-self.log_tail_lines :]
        return "\n".join(lines) if lines else "(the log is empty)"

    def client(self) -> JobSubmissionClient:
        """The job server's client, made on first use (its constructor calls the server)."""
        with self._lock:
            if self._client_instance is None:
                self._client_instance = JobSubmissionClient(
                    self.dashboard_url, headers=self.headers
                )
            return self._client_instance


def _unfinished_runs(store: Store) -> Iterator[RunRecord]:
    """Every run that is queued or running, oldest pages last."""
    for status in (RunStatus.RUNNING, RunStatus.QUEUED):
        cursor: str | None = None
        while True:
            runs, cursor = store.list_runs(status, limit=100, cursor=cursor)
            yield from runs
            if cursor is None:
                break


def launcher_from_env(
    data_dir: Path,
    store_url: str | None,
    environ: Mapping[str, str] | None = None,
    head_cpus: int | None = None,
) -> RayJobLauncher:
    """The launcher `kpo serve` uses: on the cluster at RAY_ADDRESS, else on a local head (with
    `head_cpus` CPUs when it has to be started).

    On a cluster the entrypoint runs `python` from the PATH of the cluster's image, and the
    data directory and store URL must mean the same there as here (a shared volume, Redis).
    """
    data_dir = Path(data_dir).expanduser().resolve()
    url = cluster_job_server_url(environ)
    if url is not None:
        if not store_url or "://" not in store_url:
            log.warning(
                "runs go to the Ray cluster at %s but the store is local to this machine: "
                "set KPO_STORE_URL=redis://... so that the jobs can report",
                url,
            )
        headers = ray_auth_headers(environ)
        return RayJobLauncher(url, data_dir, store_url, headers=headers, python="python")
    head = LocalRayHead(data_dir, num_cpus=head_cpus)
    info = head.ensure()
    return RayJobLauncher(
        info.dashboard_url, data_dir, store_url, headers=head.auth_headers(), env=local_job_env()
    )
