"""`/metrics` on a port of its own (`KPO_METRICS_PORT`): a small server on a thread of its own.

With the export apart from the API, Prometheus scrapes it without the API token while the API
port stays guarded (and behind the Ingress); who may reach the metrics port is the network's
say (the Helm chart's NetworkPolicy admits Prometheus only). The server renders the API's own
registry (`services.api.prometheus`: run metrics read from the store, the API's request
metrics) on an event loop and threads of its own, so that a scrape neither waits for the API's
loop or worker threads nor holds them.

Its threads are bounded whatever its clients do: the loop's thread holds every connection (an
idle one costs a socket, not a thread, and is closed after `KPO_HEADER_TIMEOUT_S`: the
listener's limits are services.http_listener's), and at most `MAX_SCRAPES` scrapes render at
once, each on a worker thread (a 503 beyond). Like the API, it answers only the Host names the
API answers (DNS rebinding).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import uvicorn
from anyio import CapacityLimiter, to_thread
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from services.api.prometheus import render
from services.http_listener import bind, listener_config

PATH = "/metrics"
MAX_SCRAPES = 4
# How long `start` waits for the server's loop to listen.
START_TIMEOUT_S = 30.0


class MetricsServer:
    """Serves `GET /metrics` of `registry` on `host`:`port` until `close`.

    The port is bound when it is made: a port in use is an OSError here.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        trusted_hosts: Sequence[str],
        header_timeout_s: float = 10.0,
    ) -> None:
        self._registry = registry
        self._scrapes = CapacityLimiter(MAX_SCRAPES)
        app = Starlette(
            routes=[Route(PATH, self._metrics, methods=["GET"])],
            middleware=[
                Middleware(TrustedHostMiddleware, allowed_hosts=list(trusted_hosts)),
            ],
        )
        app.router.redirect_slashes = False  # a redirect would name the Host header
        # Every scrape would be an access line on stderr (every 15 s, for ever): none.
        config = listener_config(app, header_timeout_s, access_log=False, log_config=None)
        self._server = uvicorn.Server(config)
        self._socket = bind(host, port)
        self._thread = threading.Thread(
            target=self._server.run, args=([self._socket],), name="kpo-metrics-server", daemon=True
        )

    @property
    def port(self) -> int:
        """The port it listens on (the one given, or the one the system chose for 0)."""
        return int(self._socket.getsockname()[1])

    def start(self) -> MetricsServer:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the metrics server did not start on port {self.port}")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.should_exit = True
            self._thread.join()
        self._socket.close()

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def _metrics(self, request: Request) -> Response:
        if self._scrapes.borrowed_tokens >= self._scrapes.total_tokens:
            return PlainTextResponse("too many scrapes at once", status_code=503)
        body, content_type = await to_thread.run_sync(render, self._registry, limiter=self._scrapes)
        return Response(body, media_type=content_type)
