"""The control plane's listeners against clients that open connections and send nothing.

Real servers on real sockets, started as `kpo serve` starts them (`ControlPlaneServer`, the
`MetricsServer`): idle sockets past the API's connection limit leave the probe listener
answering, and are closed once they have sent no request head for `KPO_HEADER_TIMEOUT_S`; idle
sockets to /metrics hold no thread each; a trailing-slash redirect never names the Host header.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from services.api.app import create_app
from services.api.listeners import ControlPlaneServer
from services.api.metrics_server import MAX_SCRAPES, MetricsServer
from services.api.settings import ApiSettings
from services.jobs.ray_head import free_port
from services.store import LocalStore
from tests.services.api.conftest import TOKEN, Api
from tests.services.api.launchers import RecordingLauncher
from tests.services.api.raw_http import raw_request
from tests.services.idle_sockets import closed_by_server, idle_sockets, status
from tests.services.jobs.ray_support import wait_until

pytestmark = pytest.mark.timeout(120)

LIMIT = 20
IDLE = 30  # past LIMIT: the figures
HEADER_TIMEOUT_S = 2.0


@contextmanager
def control_plane(tmp_path: Path, **env: str) -> Iterator[ControlPlaneServer]:
    settings = ApiSettings.model_validate({"KPO_DATA_DIR": str(tmp_path), **env})
    app = create_app(settings, LocalStore(tmp_path / "store"), RecordingLauncher())
    server = ControlPlaneServer(app, settings, "127.0.0.1", 0, log_config=None)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), 20, "the servers to start")
    assert thread.is_alive()
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout=20)


def test_idle_sockets_past_the_api_limit_leave_the_probes_answering(tmp_path: Path) -> None:
    env = {
        "KPO_MAX_CONCURRENCY": str(LIMIT),
        "KPO_MAX_STREAMS": "4",
        "KPO_MAX_STREAMS_PER_CLIENT": "4",
        "KPO_PROBE_PORT": str(free_port()),
        "KPO_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
    }
    with control_plane(tmp_path, **env) as server, ExitStack() as stack:
        api = f"http://127.0.0.1:{server.port}"
        probes = f"http://127.0.0.1:{server.probe_port}"
        held = idle_sockets(server.port, IDLE, stack)
        # The API is past its limit: everything on its port is a 503, its /healthz included.
        wait_until(lambda: status(f"{api}/healthz") == 503, 10, "the API's limit to be reached")
        # The probes' listener has no such limit, and idle sockets of its own do not starve it.
        held += idle_sockets(server.probe_port or 0, IDLE, stack)
        assert status(f"{probes}/healthz") == 200
        assert status(f"{probes}/readyz") == 200
        assert status(f"{probes}/v1/runs") == 404  # the probes, and nothing else
        # No request head within the timeout: the server closes every one of them, and the
        # API answers again.
        assert all(closed_by_server(sock, HEADER_TIMEOUT_S + 10) for sock in held)
        wait_until(lambda: status(f"{api}/healthz") == 200, 10, "the API to answer again")


def test_a_connection_between_requests_is_closed_after_the_header_timeout(
    tmp_path: Path,
) -> None:
    """A kept-alive connection that sends the next head too slowly is closed as well."""
    env = {"KPO_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)}
    with (
        control_plane(tmp_path, **env) as server,
        socket.create_connection(("127.0.0.1", server.port)) as sock,
    ):
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # a head begun, never finished
        assert closed_by_server(sock, HEADER_TIMEOUT_S + 10)


def threads_of_this_process() -> int:
    return len(os.listdir("/proc/self/task"))


def test_idle_sockets_to_metrics_hold_no_thread_each(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    app = create_app(ApiSettings.model_validate({}), store, RecordingLauncher())
    registry, trusted = app.state.registry, app.state.trusted_hosts
    with MetricsServer(registry, "127.0.0.1", 0, trusted, 60.0) as metrics, ExitStack() as stack:
        url = f"http://127.0.0.1:{metrics.port}/metrics"
        assert status(url) == 200
        before = threads_of_this_process()
        idle_sockets(metrics.port, 400, stack)
        # Connections are accepted in order: this scrape's turn comes after all 400.
        assert status(url) == 200
        during = threads_of_this_process()
        assert during - before <= MAX_SCRAPES, f"{during - before} threads more for 400 sockets"


def test_a_trailing_slash_is_no_redirect_to_the_host_header(secured: Api) -> None:
    """With a token the API answers any Host; a redirect built from it would send a client
    (and its token, on a resend) wherever the header says."""
    for path in ("/healthz/", "/v1/runs/"):
        head = f"GET {path} HTTP/1.1\r\nHost: evil.example\r\nAuthorization: Bearer {TOKEN}"
        response = raw_request(secured.url, head.encode())
        assert response.status == 404, (path, response.status)
        assert "evil.example" not in response.headers.get("location", "")
