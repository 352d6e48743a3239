"""Chaos: `kpo sandbox serve` killed (SIGKILL) while a call is in flight. The client's call is
retried once the server is back on the same port, or ends as one "unavailable" result if it
does not come back in time: one result per call, never lost, never two."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import httpx

from services.tools.client import HttpSandbox
from services.tools.sandbox import ToolResult
from tests.services.tools.sandbox_server import (
    free_port,
    needs_bwrap,
    subprocess_server,
    wait_healthy,
)

pytestmark = needs_bwrap

ENV = {"KPO_SANDBOX_TOKEN": "chaos-token-0123456789", "KPO_SANDBOX_TIMEOUT_S": "10"}


def wait_in_flight(url: str, deadline_s: float = 20.0) -> None:
    """Until the server has admitted a call (it is running in the sandbox)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/healthz", timeout=2.0).json()["admitted"] >= 1:
            return
        time.sleep(0.02)  # polling interval
    raise AssertionError("the call never reached the server")


def start_call(sandbox: HttpSandbox, code: str) -> tuple[threading.Thread, list[ToolResult]]:
    results: list[ToolResult] = []
    thread = threading.Thread(target=lambda: results.append(sandbox.run(code)))
    thread.start()
    return thread, results


def test_server_killed_mid_call() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    marker = uuid.uuid4().hex
    # Long enough to be killed in flight; prints its id so the result is tied to this call.
    code = f"import time; time.sleep(1.5); print({marker!r})"
    sandbox = HttpSandbox(url, ENV["KPO_SANDBOX_TOKEN"], timeout_s=10.0, retry_budget_s=30.0)
    with subprocess_server(port, ENV) as first:
        wait_healthy(url)
        thread, results = start_call(sandbox, code)
        wait_in_flight(url)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # Back on the same port: the client's retry finds it and the call runs to the end.
    with subprocess_server(port, ENV):
        wait_healthy(url)
        thread.join(40)
    assert not thread.is_alive()
    assert len(results) == 1
    assert (results[0].status, results[0].output) == ("ok", marker)
    assert sandbox.retries >= 1

    # Killed and not back within the retry budget: exactly one "unavailable" result.
    sandbox = HttpSandbox(url, ENV["KPO_SANDBOX_TOKEN"], timeout_s=10.0, retry_budget_s=1.0)
    with subprocess_server(port, ENV) as second:
        wait_healthy(url)
        thread, results = start_call(sandbox, code)
        wait_in_flight(url)
        os.killpg(second.pid, signal.SIGKILL)
        second.wait()
        thread.join(20)
    assert not thread.is_alive()
    assert [result.status for result in results] == ["unavailable"]
    assert sandbox.counts == {"unavailable": 1}
