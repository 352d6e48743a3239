"""`/metrics` on a port of its own (`KPO_METRICS_PORT`): a small WSGI server on its own threads.

With the export apart from the API, Prometheus scrapes it without the API token while the API
port stays guarded (and behind the Ingress); who may reach the metrics port is the network's
say (the Helm chart's NetworkPolicy admits Prometheus only). The server renders the API's own
registry (`services.api.prometheus`: run metrics read from the store, the API's request
metrics), on threads of its own, so that a scrape neither waits for the API's worker threads
nor holds them. Like the API, it answers only the Host names the API answers (DNS rebinding),
and at most `MAX_SCRAPES` scrapes at once (a 503 beyond).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIEnvironment

from prometheus_client import CollectorRegistry

from services.api.prometheus import render

log = logging.getLogger(__name__)

PATH = "/metrics"
MAX_SCRAPES = 4


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds the process up at exit


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """No access line on stderr per scrape (every 15 s, forever); debug logging instead."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics server: " + format, *args)


class MetricsServer:
    """Serves `GET /metrics` of `registry` on `host`:`port` until `close`."""

    def __init__(
        self, registry: CollectorRegistry, host: str, port: int, trusted_hosts: Sequence[str]
    ) -> None:
        self._registry = registry
        self._trusted = [pattern.lower() for pattern in trusted_hosts]
        self._scrapes = threading.BoundedSemaphore(MAX_SCRAPES)
        server_class = _Server6 if _is_ipv6(host) else _Server
        self._server = make_server(
            host, port, self._app, server_class=server_class, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kpo-metrics-server", daemon=True
        )

    @property
    def port(self) -> int:
        """The port it listens on (the one given, or the one the system chose for 0)."""
        return int(self._server.server_port)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _app(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if not host_allowed(environ.get("HTTP_HOST", ""), self._trusted):
            return _plain(start_response, "400 Bad Request", "Invalid host header")
        if environ.get("PATH_INFO") != PATH:
            return _plain(start_response, "404 Not Found", f"only {PATH} is served here")
        method = environ.get("REQUEST_METHOD")
        if method not in ("GET", "HEAD"):
            return _plain(start_response, "405 Method Not Allowed", "GET only", [("Allow", "GET")])
        if not self._scrapes.acquire(blocking=False):
            return _plain(start_response, "503 Service Unavailable", "too many scrapes at once")
        try:
            body, content_type = render(self._registry)
        finally:
            self._scrapes.release()
        start_response(
            "200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))]
        )
        return [] if method == "HEAD" else [body]


def host_allowed(host_header: str, trusted: Sequence[str]) -> bool:
    """Whether a Host header names a trusted host, as Starlette's TrustedHostMiddleware decides:
    the name without its port equals a pattern, or ends in the `.domain` of a `*.domain` one."""
    if "*" in trusted:
        return True
    if host_header.startswith("["):  # an IPv6 literal keeps its brackets
        host = host_header[: host_header.find("]") + 1]
    else:
        host = host_header.rsplit(":", 1)[0]
    host = host.lower()
    if not host:
        return False
    return any(
        host == pattern or (pattern.startswith("*.") and host.endswith(pattern[1:]))
        for pattern in trusted
    )


def _plain(
    start_response: StartResponse,
    status: str,
    text: str,
    headers: list[tuple[str, str]] | None = None,
) -> list[bytes]:
    body = text.encode()
    start_response(
        status,
        [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(body))),
            *(headers or []),
        ],
    )
    return [body]


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False
