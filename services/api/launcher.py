"""Runs as Ray jobs: the control plane's launcher, and the local Ray head it uses by default.

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

import fcntl
import hashlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import httpx
from ray.job_submission import JobDetails, JobStatus, JobSubmissionClient

import services
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
HEAD_FILE = "ray-head.json"
HEAD_TOKEN_FILE = "ray-auth-token"
HEAD_LOG_FILE = "ray-head.log"
# Ray's default time between the SIGTERM of `stop_job` and a SIGKILL is 3 s; a cancelled run
# needs longer to finish its learner step and write its checkpoint.
DEFAULT_STOP_WAIT_S = 120
# Ray's CPUs are reservations, not cores: a head that offers at least what the shipped examples
# reserve (2.25) runs them on a small machine, oversubscribed, as `kpo run` does, instead of
# leaving an actor waiting forever for a CPU that never comes.
MIN_HEAD_CPUS = 4
LOG_TAIL_LINES = 30
REQUEST_TIMEOUT_S = 5.0


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
    token = env.get("RAY_AUTH_TOKEN") or _read_text(
        Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    )
    return {"Authorization": f"Bearer {token}"} if token else {}


def local_job_env() -> dict[str, str]:
    """Environment that lets a job on this machine import this very checkout of the package."""
    root = str(Path(services.__file__).resolve().parents[1])
    paths = [root, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(p for p in paths if p))}


# --- the local Ray head ---------------------------------------------------------------------


@dataclass(frozen=True)
class HeadInfo:
    """Where a local Ray head listens; kept in `<data dir>/ray-head.json`."""

    address: str  # the GCS, HOST:PORT
    dashboard_url: str  # the job server
    temp_dir: str  # Ray's session files
    pgid: int  # the process group of its daemons (what `stop` ends)
    token_file: str  # Ray's auth token for this head


def free_port() -> int:
    """A loopback TCP port that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class LocalRayHead:
    """A Ray head with a job server on this machine, run as daemons that outlive this process.

    `ensure()` reuses the head recorded in `<data dir>/ray-head.json` if it answers, and starts
    one otherwise. Its job server listens on 127.0.0.1; Ray's other ports listen on every
    interface, as `ray start` makes them, and every one of them requires Ray's auth token (kept in
    `<data dir>/ray-auth-token`, readable by this user only). Its session files go to a short
    directory under /tmp (`temp_dir`): Ray's Unix sockets live there and their paths are limited
    to about 100 characters.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        temp_dir: Path | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.num_cpus = num_cpus or max(os.cpu_count() or 1, MIN_HEAD_CPUS)
        self.num_gpus = num_gpus
        self.temp_dir = temp_dir or Path("/tmp") / f"kpo-ray-{_short_hash(self.data_dir)}"
        self.start_timeout_s = start_timeout_s
        self.info: HeadInfo | None = None

    @property
    def head_file(self) -> Path:
        return self.data_dir / HEAD_FILE

    def ensure(self) -> HeadInfo:
        """The live head of this data directory, started if there is none."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with _file_lock(self.data_dir / f"{HEAD_FILE}.lock"):
            recorded = self._recorded()
            if recorded is not None and _answers(recorded.dashboard_url, _auth_headers(recorded)):
                log.info("reusing the Ray head at %s", recorded.dashboard_url)
                self.info = recorded
            else:
                self.info = self._start()
                self.head_file.write_text(json.dumps(asdict(self.info), indent=2) + "\n")
        return self.info

    def auth_headers(self) -> dict[str, str]:
        """The header that Ray's job server wants from clients of this head."""
        return _auth_headers(self.ensure() if self.info is None else self.info)

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the head's daemons (SIGTERM, then SIGKILL) and forget it. For tests and tools."""
        info = self.info or self._recorded()
        # A recorded head that no longer answers is gone, and its process group id may have
        # been reused by now: only a head known to be live is ended.
        if info is not None and (
            self.info is not None or _answers(info.dashboard_url, _auth_headers(info))
        ):
            _end_process_group(info.pgid, timeout_s)
        self.head_file.unlink(missing_ok=True)
        self.info = None

    def _recorded(self) -> HeadInfo | None:
        try:
            return HeadInfo(**json.loads(self.head_file.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None

    def _start(self) -> HeadInfo:
        token_file = self._token_file()
        gcs_port, dashboard_port = free_port(), free_port()
        command = [
            sys.executable,
            *("-m", "ray.scripts.scripts", "start", "--head", "--disable-usage-stats"),
            *("--port", str(gcs_port)),
            *("--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port)),
            # Fixed defaults (10001, 52365) would clash with another Ray on this machine.
            *("--ray-client-server-port", str(free_port())),
            *("--dashboard-agent-listen-port", str(free_port())),
            *("--num-cpus", str(self.num_cpus), "--temp-dir", str(self.temp_dir)),
            *(("--num-gpus", str(self.num_gpus)) if self.num_gpus is not None else ()),
        ]
        env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
        # Not for the head (nor, through it, every job): Ray's address and auth settings of this
        # process, and the control plane's own secret.
        for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "KPO_API_TOKEN", "KPO_API_TOKEN_FILE"):
            env.pop(name, None)
        log_path = self.data_dir / HEAD_LOG_FILE
        with log_path.open("ab") as log_file:
            # A session of its own: the daemons outlive this process and its terminal's signals,
            # and `stop` can end exactly them through their process group.
            starter = subprocess.Popen(
                command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                code: int | str = starter.wait(timeout=self.start_timeout_s)
            except subprocess.TimeoutExpired:
                code = f"no answer within {self.start_timeout_s:.0f} s"
        if code != 0:
            _end_process_group(starter.pid, 5.0)
            raise RuntimeError(f"`ray start --head` failed ({code}):\n{_tail(log_path)}")
        # Where Ray says its GCS is (it picks the node's address itself).
        address_file = self.temp_dir / "ray_current_cluster"
        address = _read_text(address_file) or f"127.0.0.1:{gcs_port}"
        info = HeadInfo(
            address=address,
            dashboard_url=f"http://127.0.0.1:{dashboard_port}",
            temp_dir=str(self.temp_dir),
            pgid=starter.pid,
            token_file=str(token_file),
        )
        self._wait_for_job_server(info, log_path)
        log.info("started a Ray head at %s (job server %s)", info.address, info.dashboard_url)
        return info

    def _token_file(self) -> Path:
        """Ray's auth token for this head, created once, readable by this user only."""
        path = self.data_dir / HEAD_TOKEN_FILE
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as file:
                file.write(os.urandom(32).hex())
        return path

    def _wait_for_job_server(self, info: HeadInfo, log_path: Path) -> None:
        """Wait until the job server lists jobs: `ray start` returns before it is up."""
        deadline = time.monotonic() + self.start_timeout_s
        while not _answers(info.dashboard_url, _auth_headers(info), "/api/jobs/"):
            if time.monotonic() > deadline:
                _end_process_group(info.pgid, 5.0)
                raise RuntimeError(
                    f"the Ray job server at {info.dashboard_url} did not answer within "
                    f"{self.start_timeout_s:.0f} s:\n{_tail(log_path)}"
                )
            time.sleep(0.25)


def _short_hash(path: Path) -> str:
    return hashlib.sha256(str(path).encode()).hexdigest()[:8]


def _auth_headers(info: HeadInfo) -> dict[str, str]:
    try:
        token = Path(info.token_file).read_text(encoding="utf-8").strip()
    except OSError:
        return {}
    return {"Authorization": f"Bearer {token}"}


def _answers(url: str, headers: Mapping[str, str], path: str = "/api/version") -> bool:
    """Whether the job server at `url` answers `path` with a success."""
    try:
        response = httpx.get(f"{url}{path}", headers=dict(headers), timeout=REQUEST_TIMEOUT_S)
    except httpx.HTTPError:
        return False
    return response.is_success


def _end_process_group(pgid: int, timeout_s: float) -> None:
    """SIGTERM the process group, SIGKILL what is left after `timeout_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between processes: two control planes must not start two heads."""
    with path.open("a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return None


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


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
        return _answers(self.dashboard_url, self.headers)

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
