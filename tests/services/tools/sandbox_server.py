"""A real sandbox server for the tests: uvicorn in a thread (in-process) or `kpo sandbox serve`
as a subprocess (for the chaos test, which kills it), both on a free loopback port."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from services.tools.sandbox import SandboxLimits, SandboxRunner, SandboxUnavailable
from services.tools.server import SandboxSettings, create_app

REPO_ROOT = Path(__file__).resolve().parents[3]


def bwrap_problem() -> str | None:
    """Why bubblewrap cannot sandbox code here (not installed, no user namespaces), or None."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (make system-deps installs Debian's bubblewrap)"
    try:
        SandboxRunner("bwrap", SandboxLimits(), slots=1)
    except SandboxUnavailable as error:
        return f"bwrap cannot create its namespaces on this machine: {error}"
    return None


_PROBLEM = bwrap_problem()
# Skips only where bwrap cannot run, and says why; never silently.
needs_bwrap = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, deadline_s: float = 30.0) -> dict[str, object]:
    """Poll /healthz until it answers 200 (readiness), or fail at the deadline."""
    deadline = time.monotonic() + deadline_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{url}/healthz", timeout=2.0)
            if response.status_code == 200:
                body: dict[str, object] = response.json()
                return body
            last = response.status_code
        except httpx.TransportError as error:
            last = error
        time.sleep(0.05)  # polling interval
    raise AssertionError(f"sandbox server at {url} not healthy after {deadline_s} s: {last}")


class ThreadServer:
    """uvicorn serving create_app(settings) in a thread of the test process."""

    def __init__(self, settings: SandboxSettings) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            create_app(settings), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        wait_healthy(self.url)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@contextmanager
def subprocess_server(
    port: int, env: dict[str, str], *args: str
) -> Iterator[subprocess.Popen[bytes]]:
    """`kpo sandbox serve` on `port` as a child process (its own group); killed on exit."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "sandbox", "serve", "--port", str(port), *args],
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
