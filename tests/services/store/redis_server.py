"""A real `redis-server` for tests: a subprocess on a free loopback port, with AOF persistence
(`appendfsync always`, no RDB snapshots) in a directory of its own.

Importable by any test that needs Redis (the store tests, later the API tests). It never uses a
server that is already running, and it fails, not skips, when `redis-server` is missing: CI
installs it (`apt-get install redis-server`).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from services.jobs.ray_head import free_port

INSTALL_HINT = "redis-server is not on PATH: install it with `apt-get install redis-server`"


class RedisServer:
    """One redis-server process; `stop`/`kill` and `start` again keep its port and data."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and return once it answers PING (its AOF loaded)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.directory.mkdir(parents=True, exist_ok=True)
        # The port is chosen before the process starts; another process could take it in between.
        # It is rare on a loopback port, and the log below says so when it happens.
        self.process = subprocess.Popen(
            [
                binary,
                *("--port", str(self.port), "--bind", "127.0.0.1"),
                *("--dir", str(self.directory), "--logfile", str(self.log_path)),
                *("--appendonly", "yes", "--appendfsync", "always", "--save", ""),
                *("--daemonize", "no", "--protected-mode", "yes"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        self._wait_until_ready(timeout_s)

    def stop(self) -> None:
        """Shut the server down cleanly (SIGTERM: it flushes its AOF and exits)."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """Kill the server with SIGKILL: no shutdown, no last flush."""
        self._end(signal.SIGKILL)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_until_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with {self.process.returncode}:\n{self._log_tail()}"
                    )
                try:
                    if client.ping():
                        return
                except redis.exceptions.ConnectionError:  # refused, or LOADING the AOF
                    pass
                if time.monotonic() > deadline:
                    self._end(signal.SIGKILL)
                    raise RuntimeError(
                        f"redis-server did not answer within {timeout_s} s:\n{self._log_tail()}"
                    )
                time.sleep(0.02)

    def _end(self, sig: signal.Signals) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=30)
        self.process = None

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-20:])
        except OSError:
            return "(no log)"
