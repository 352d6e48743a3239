"""A local Ray head with its job server, started as daemons that outlive the control plane.

`kpo serve` uses one when no `RAY_ADDRESS` names a cluster: runs are Ray jobs, and a head of its
own lets them survive a restart of the control plane process. Its address is kept in
`<data dir>/ray-head.json`, and a live head is reused.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

log = logging.getLogger(__name__)

HEAD_FILE = "ray-head.json"
HEAD_TOKEN_FILE = "ray-auth-token"
HEAD_LOG_FILE = "ray-head.log"
# Ray's CPUs are reservations, not cores: a head that offers at least what the shipped examples
# reserve (2.25) runs them on a small machine, oversubscribed, as `kpo run` does, instead of
# leaving an actor waiting forever for a CPU that never comes.
MIN_HEAD_CPUS = 4
LOG_TAIL_LINES = 30
REQUEST_TIMEOUT_S = 5.0


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
            if recorded is not None and job_server_answers(
                recorded.dashboard_url, _auth_headers(recorded)
            ):
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
            self.info is not None or job_server_answers(info.dashboard_url, _auth_headers(info))
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
        address = read_text_or_none(address_file) or f"127.0.0.1:{gcs_port}"
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
        while not job_server_answers(info.dashboard_url, _auth_headers(info), "/api/jobs/"):
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


def job_server_answers(url: str, headers: Mapping[str, str], path: str = "/api/version") -> bool:
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


def read_text_or_none(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return None


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
