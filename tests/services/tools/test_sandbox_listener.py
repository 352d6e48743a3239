"""`kpo sandbox serve` against clients that open connections and send nothing: past its
connection limit it answers 503, and once those connections have sent no request head for
`KPO_SANDBOX_HEADER_TIMEOUT_S` it closes them and answers again (services.http_listener)."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from services.tools.server import EXTRA_CONNECTIONS
from tests.services.idle_sockets import closed_by_server, idle_sockets, status
from tests.services.jobs.ray_support import wait_until
from tests.services.tools.sandbox_server import free_port, subprocess_server, wait_healthy

pytestmark = pytest.mark.timeout(120)

HEADER_TIMEOUT_S = 2.0


def test_idle_sockets_do_not_hold_the_sandbox_server_at_503() -> None:
    port = free_port()
    env = {
        # The process backend: what is under test is the listener, not the sandbox.
        "KPO_SANDBOX_BACKEND": "process",
        "KPO_SANDBOX_ALLOW_UNSAFE_PROCESS": "true",
        "KPO_SANDBOX_TOKEN": "sandbox-listener-token-0123456789",  # the process backend's due
        "KPO_SANDBOX_MAX_CONCURRENCY": "1",
        "KPO_SANDBOX_MAX_QUEUE": "0",
        "KPO_SANDBOX_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
    }
    url = f"http://127.0.0.1:{port}"
    with subprocess_server(port, env), ExitStack() as stack:
        wait_healthy(url)
        held = idle_sockets(port, 1 + EXTRA_CONNECTIONS + 5, stack)
        wait_until(lambda: status(f"{url}/healthz") == 503, 10, "the connection limit")
        assert all(closed_by_server(sock, HEADER_TIMEOUT_S + 10) for sock in held)
        wait_until(lambda: status(f"{url}/healthz") == 200, 10, "the server to answer again")
