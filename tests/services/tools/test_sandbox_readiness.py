"""`GET /readyz`: the sandbox server is ready while its calls start. After consecutive calls
that could not even start the sandbox (no process left to fork, nothing to exec) it answers 503,
so the Service stops sending it calls, while `/healthz` still says the process is up; once a
call starts again (its own probe, or a call) it is ready again.

The failures are real: an interpreter that does not exist (bwrap's exec fails inside the
sandbox), and, as root, a process budget of one (bwrap cannot fork its namespace)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from services.tools.sandbox import SandboxLimits, SandboxRunner, find_python
from services.tools.server import SandboxSettings, create_app
from tests.services.tools.sandbox_server import free_port, needs_bwrap, wait_healthy

pytestmark = [needs_bwrap, pytest.mark.timeout(120)]

TOKEN = "readiness-token-0123456789"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
UID_BASE = 212_000
LIMITS = SandboxLimits(timeout_s=5.0)


@contextmanager
def serving(runner: SandboxRunner) -> Iterator[str]:
    """uvicorn serving create_app with `runner`, in a thread of the test process."""
    port = free_port()
    settings = SandboxSettings(max_concurrency=1, max_queue=4, token=TOKEN)
    config = uvicorn.Config(
        create_app(settings, runner), host="127.0.0.1", port=port, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


def call(url: str, code: str = "print(6*7)") -> dict[str, object]:
    response = httpx.post(f"{url}/v1/run", json={"code": code}, headers=HEADERS, timeout=30.0)
    assert response.status_code == 200
    body: dict[str, object] = response.json()
    return body


def broken_runner(how: str) -> SandboxRunner:
    if how == "no interpreter":
        return SandboxRunner(
            limits=LIMITS,
            slots=1,
            uid_base=UID_BASE,
            python="/usr/bin/no-such-python3",
            check=False,
        )
    if os.geteuid() != 0:
        pytest.skip("a process budget of its own per call needs per-slot uids (root)")
    return SandboxRunner(
        limits=SandboxLimits(timeout_s=5.0, nproc=1), slots=1, uid_base=UID_BASE + 1, check=False
    )


def mend(runner: SandboxRunner) -> None:
    """What was wrong goes away, as an exhausted process budget does once it is reaped."""
    runner.python = find_python()
    runner.limits = LIMITS


@pytest.mark.parametrize("how", ["no interpreter", "no process to fork"])
def test_unready_after_calls_that_cannot_start_and_ready_once_one_does(how: str) -> None:
    runner = broken_runner(how)
    with serving(runner) as url:
        assert httpx.get(f"{url}/readyz").status_code == 200
        for _ in range(3):
            result = call(url)
            assert result["status"] == "error", result
        ready = httpx.get(f"{url}/readyz")
        assert ready.status_code == 503, ready.text
        assert "could not start" in ready.json()["detail"]
        # Alive, not ready: restarting it would not help, taking it out of the Service does.
        assert httpx.get(f"{url}/healthz").status_code == 200
        # Still broken: its own probe cannot start a call either, and it stays unready.
        assert httpx.get(f"{url}/readyz").status_code == 503
        mend(runner)
        # No call reaches an unready server (the Service sends none): its probe finds out.
        assert httpx.get(f"{url}/readyz").status_code == 200
        result = call(url)
        assert (result["status"], result["output"]) == ("ok", "42")


def test_code_that_fails_or_fakes_bwraps_errors_leaves_it_ready() -> None:
    """The model's code failing, even printing bwrap's own error and exiting 1 like bwrap does,
    is a call that started: only bwrap's status (a channel the code cannot write) says a call
    did not."""
    runner = SandboxRunner(limits=LIMITS, slots=1, uid_base=UID_BASE + 2)
    fake = 'import sys; sys.stderr.write("bwrap: Can\'t fork for pid 1\\n"); sys.exit(1)'
    with serving(runner) as url:
        for code in (fake, "1/0", "import os; os._exit(1)", fake):
            assert call(url, code)["status"] == "error"
        assert httpx.get(f"{url}/readyz").status_code == 200
