"""A local Ray head with its job server, started as daemons that outlive the control plane.

`kpo serve` uses one when no `RAY_ADDRESS` names a cluster: runs are Ray jobs, and a head of its
own lets them survive a restart of the control plane process. Its files (the record of where it
listens, `ray-head.json`; Ray's auth token; its log) are kept in `<data dir>/ray-head/`, a
directory of this user only, and a live head is reused. `kpo serve --stop` ends it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from services.local_ray import NO_METRICS_EXPORTERS
from services.store.private_files import private_directory

log = logging.getLogger(__name__)

# Paths relative to the data directory.
HEAD_DIR = "ray-head"
HEAD_FILE = f"{HEAD_DIR}/ray-head.json"
HEAD_TOKEN_FILE = f"{HEAD_DIR}/ray-auth-token"
HEAD_LOG_FILE = f"{HEAD_DIR}/ray-head.log"
HEAD_LOCK_FILE = f"{HEAD_DIR}/ray-head.lock"
# Where releases before the head had a directory of its own kept its record: a head started by
# one of them is still found (and its record moved), so that its runs are not lost on upgrade.
LEGACY_HEAD_FILE = "ray-head.json"
# Ray's CPUs are reservations, not cores: a head that offers at least what the shipped examples
# reserve (2.25) runs them on a small machine, oversubscribed, as `kpo run` does, instead of
# leaving an actor waiting forever for a CPU that never comes.
MIN_HEAD_CPUS = 4
LOG_TAIL_LINES = 30
REQUEST_TIMEOUT_S = 5.0


class HeadFileError(RuntimeError):
    """A file of the local head that is malformed, someone else's, or writable by others."""


@dataclass(frozen=True)
class HeadInfo:
    """Where a local Ray head listens; kept in `<data dir>/ray-head/ray-head.json`."""

    address: str  # the GCS, HOST:PORT
    dashboard_url: str  # the job server, http://127.0.0.1:PORT
    temp_dir: str  # Ray's session files
    pgid: int  # the process group of its daemons (what `stop` ends)
    token_file: str  # Ray's auth token for this head


# The record's keys and their JSON types (bool is not an int here, though Python says it is).
_HEAD_KEYS: dict[str, type] = {
    "address": str,
    "dashboard_url": str,
    "temp_dir": str,
    "pgid": int,
    "token_file": str,
}
# The record sends Ray's token to this URL and `stop` signals this process group: only what
# `_start` writes is accepted, a job server on loopback and a group that is not ours or init's.
_LOOPBACK_URL = re.compile(r"http://127\.0\.0\.1:[0-9]{1,5}")


def free_port() -> int:
    """A loopback TCP port that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class LocalRayHead:
    """A Ray head with a job server on this machine, run as daemons that outlive this process.

    `ensure()` reuses the head recorded in `<data dir>/ray-head/ray-head.json` if it answers, and
    starts one otherwise. That directory is this user's only (0700); a record that is not one this
    class writes, or a file there that is someone else's or that others may write, is refused
    with a `HeadFileError` naming it, since the record says where Ray's token is sent and which
    process group `stop` signals.

    What listens where: the job server (Ray's dashboard, the only port the control plane uses) on
    127.0.0.1 only. Ray has no option to bind its other ports to loopback: `ray start` binds the
    GCS, the raylet's, the object manager's, Ray Client's and its agents' ports on every interface
    or on the node's address (it turns a `--node-ip-address` of 127.0.0.1 into the machine's own
    address). So the head runs in Ray's token mode, in which those ports turn away a client
    without the token (kept in `<data dir>/ray-head/ray-auth-token`, readable by this user only),
    and without Ray's metrics exporters, which would answer anyone.

    Its session files go to a short directory under /tmp (`temp_dir`): Ray's Unix sockets live
    there and their paths are limited to about 100 characters. Ray makes that directory
    world-writable, so by default it lies inside a directory of this user only
    (`/tmp/kpo-<uid>-<hash of the data dir>/ray`), which keeps the sockets to this user.
    `resources` are custom Ray resources the head advertises (e.g. slots for the runs' drivers).
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        resources: Mapping[str, float] | None = None,
        temp_dir: Path | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.num_cpus = num_cpus or max(os.cpu_count() or 1, MIN_HEAD_CPUS)
        self.num_gpus = num_gpus
        self.resources = dict(resources or {})
        # The private directory around Ray's own (which Ray makes world-writable), if it is ours.
        self._private_temp: Path | None = None
        if temp_dir is None:
            self._private_temp = Path("/tmp") / f"kpo-{os.geteuid()}-{_short_hash(self.data_dir)}"
            temp_dir = self._private_temp / "ray"
        self.temp_dir = temp_dir
        self.start_timeout_s = start_timeout_s
        self.info: HeadInfo | None = None

    @property
    def head_dir(self) -> Path:
        return self.data_dir / HEAD_DIR

    @property
    def head_file(self) -> Path:
        return self.data_dir / HEAD_FILE

    def ensure(self) -> HeadInfo:
        """The live head of this data directory, started if there is none."""
        private_directory(self.data_dir)
        private_dir(self.head_dir)
        with _file_lock(self.data_dir / HEAD_LOCK_FILE):
            recorded = self._recorded()
            if recorded is not None and job_server_answers(
                recorded.dashboard_url, _auth_headers(recorded)
            ):
                log.info("reusing the Ray head at %s", recorded.dashboard_url)
                self.info = recorded
            else:
                self.info = self._start()
                _write_head_file(self.head_file, self.info)
        return self.info

    def live(self) -> HeadInfo | None:
        """The recorded head if its job server answers; None otherwise. Starts nothing."""
        info = self.info or self._recorded()
        if info is not None and job_server_answers(info.dashboard_url, _auth_headers(info)):
            return info
        return None

    def auth_headers(self) -> dict[str, str]:
        """The header that Ray's job server wants from clients of this head."""
        return _auth_headers(self.ensure() if self.info is None else self.info)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """End the head's daemons (SIGTERM, then SIGKILL) and forget it; whether one was live.

        The drivers of its jobs die with it, without a word to the store: `stop_local_head`
        (`kpo serve --stop`) stops the jobs first.
        """
        # A recorded head that no longer answers is gone, and its process group id may have
        # been reused by now: only a head known to be live is ended.
        info = self.info if self.info is not None else self.live()
        if info is not None:
            _end_process_group(info.pgid, timeout_s)
        self.head_file.unlink(missing_ok=True)
        self.info = None
        return info is not None

    def _recorded(self) -> HeadInfo | None:
        """The head recorded for this data directory, if any (moved from where releases before
        the head's own directory kept it)."""
        info = read_head_file(self.head_file)
        if info is not None:
            return info
        legacy = self.data_dir / LEGACY_HEAD_FILE
        info = read_head_file(legacy)
        if info is not None:
            _write_head_file(private_dir(self.head_dir) / Path(HEAD_FILE).name, info)
            legacy.unlink()
        return info

    def _start(self) -> HeadInfo:
        token_file = self._token_file()
        if self._private_temp is not None:
            private_dir(self._private_temp)
        gcs_port, dashboard_port = free_port(), free_port()
        command = [
            sys.executable,
            *("-m", "ray.scripts.scripts", "start", "--head", "--disable-usage-stats"),
            *("--port", str(gcs_port)),
            # The job server: the one port that Ray lets bind to loopback only.
            *("--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port)),
            # Fixed defaults (10001, 52365) would clash with another Ray on this machine.
            *("--ray-client-server-port", str(free_port())),
            *("--dashboard-agent-listen-port", str(free_port())),
            *("--num-cpus", str(self.num_cpus), "--temp-dir", str(self.temp_dir)),
            *(("--num-gpus", str(self.num_gpus)) if self.num_gpus is not None else ()),
            *(("--resources", json.dumps(self.resources)) if self.resources else ()),
        ]
        env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token_file),
            **NO_METRICS_EXPORTERS,
        }
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
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            _check_private_file(path, os.lstat(path), secret=True)
            return path
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


# --- the head's files: private, and validated on read --------------------------------------


def private_dir(path: Path) -> Path:
    """`path` as a directory of this user only (0700): made so, or checked if it exists.

    A link, someone else's directory, or one that its group or others may write (they may have
    put files in it) is refused; one of ours that others may only read is tightened to 0700.
    """
    with suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise HeadFileError(f"refusing {path}: it is not a directory (a link or a file)")
    _check_owner(path, st)
    if st.st_mode & 0o022:
        raise HeadFileError(
            f"refusing {path}: mode {stat.S_IMODE(st.st_mode):04o} lets its group or others "
            "write in it; remove it (a new Ray head is started) or make it 0700 if you trust "
            "what it holds"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:  # made under an odd umask, or readable by others
        os.chmod(path, 0o700)
    return path


def read_head_file(path: Path) -> HeadInfo | None:
    """The head recorded in `path`; None if there is no such file.

    Raises `HeadFileError`, naming the file (and the key), for anything but a record that
    `LocalRayHead` writes: not JSON, another shape, a missing or foreign key, a value of another
    type or not what `_start` records; a link, a file that is not this user's or that others may
    write; a token file that others may read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise HeadFileError(f"cannot read {path}: {error.strerror} (is it a link?)") from None
    with os.fdopen(fd, "rb") as file:
        _check_private_file(path, os.fstat(file.fileno()), secret=False)
        raw = file.read()
    info = _parse_head_record(path, raw)
    try:
        token_stat = os.lstat(info.token_file)
    except FileNotFoundError:
        return info  # no token, no header: the head turns the launcher away and a new one starts
    try:
        _check_private_file(Path(info.token_file), token_stat, secret=True)
    except HeadFileError as error:
        raise HeadFileError(f"{error} (the 'token_file' of {path})") from None
    return info


def _parse_head_record(path: Path, raw: bytes) -> HeadInfo:
    fix = "remove it to have a new Ray head started"
    try:
        data: Any = json.loads(raw.decode("utf-8"))
    except ValueError as error:
        raise HeadFileError(f"{path}: not the JSON record of a Ray head ({error}); {fix}") from None
    if not isinstance(data, dict):
        raise HeadFileError(
            f"{path}: holds a JSON {type(data).__name__}, not the record of a Ray head; {fix}"
        )
    unknown = sorted(set(data) - set(_HEAD_KEYS))
    if unknown:
        raise HeadFileError(f"{path}: unknown key {unknown[0]!r}: not a record of kpo's; {fix}")
    for key, kind in _HEAD_KEYS.items():
        if key not in data:
            raise HeadFileError(f"{path}: key {key!r} is missing; {fix}")
        if type(data[key]) is not kind:
            what = "a string" if kind is str else "an integer"
            shown = json.dumps(data[key])[:60]
            raise HeadFileError(f"{path}: key {key!r} must be {what}, not {shown}; {fix}")
    info = HeadInfo(**data)
    if not _LOOPBACK_URL.fullmatch(info.dashboard_url):
        raise HeadFileError(
            f"{path}: key 'dashboard_url' must be http://127.0.0.1:PORT (the local head's job "
            f"server), not {info.dashboard_url!r}; {fix}"
        )
    if info.pgid < 2:
        raise HeadFileError(f"{path}: key 'pgid' must be a process group id >= 2; {fix}")
    for key in ("temp_dir", "token_file"):
        if not os.path.isabs(data[key]):
            raise HeadFileError(f"{path}: key {key!r} must be an absolute path; {fix}")
    return info


def _write_head_file(path: Path, info: HeadInfo) -> None:
    """Write the record whole or not at all: a torn record would be refused on the next read."""
    partial = path.with_name(f"{path.name}.partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(json.dumps(asdict(info), indent=2) + "\n")
    os.replace(partial, path)


def _check_owner(path: Path, st: os.stat_result) -> None:
    if st.st_uid != os.geteuid():
        raise HeadFileError(
            f"refusing {path}: it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
        )


def _check_private_file(path: Path, st: os.stat_result, *, secret: bool) -> None:
    """A regular file of this user that no one else may write (nor read, if it is `secret`)."""
    if not stat.S_ISREG(st.st_mode):
        raise HeadFileError(f"refusing {path}: it is not a regular file")
    _check_owner(path, st)
    others = 0o077 if secret else 0o022
    if st.st_mode & others:
        who = (
            "its group or others may read or write it"
            if secret
            else "its group or others may write it"
        )
        raise HeadFileError(
            f"refusing {path}: mode {stat.S_IMODE(st.st_mode):04o}: {who}; remove it (a new Ray "
            "head is started)"
        )


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
