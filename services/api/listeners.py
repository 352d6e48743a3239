"""The control plane's HTTP listeners.

`kpo serve` listens on up to three ports: the API's, the probes' (`KPO_PROBE_PORT`: `/healthz`
and `/readyz` for the orchestrator) and the metrics' (`KPO_METRICS_PORT`,
services.api.metrics_server). All are uvicorn servers holding the limits of
services.http_listener, with `KPO_HEADER_TIMEOUT_S` as their header timeout.

The API alone has a connection limit (`KPO_MAX_CONCURRENCY`, then 503). The probes' listener has
none and serves on the API's event loop (`ControlPlaneServer`): past the API's limit the probes
still answer, and a probe that answers says that loop is alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.middleware.trustedhost import TrustedHostMiddleware
from uvicorn.config import LOGGING_CONFIG

from services.api import routes_system
from services.api.settings import ApiSettings
from services.http_listener import bind, listener_config

log = logging.getLogger(__name__)


def probe_app(api: FastAPI) -> FastAPI:
    """`/healthz` and `/readyz` of `api` (its readiness cache, its Host names), and nothing
    else."""
    probes = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    probes.state.readiness = api.state.readiness
    probes.include_router(routes_system.router)
    probes.add_middleware(
        TrustedHostMiddleware, allowed_hosts=api.state.trusted_hosts, www_redirect=False
    )
    return probes


class _Companion(uvicorn.Server):
    """A server that leaves the process's signals to the server it runs beside."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ControlPlaneServer:
    """The API on `host`:`port` and, with `KPO_PROBE_PORT`, its probes on that port, on one
    event loop until the API's server stops (SIGINT, SIGTERM, or `stop`).

    The ports are bound when it is made: a port in use is an OSError here, before anything runs.
    """

    def __init__(
        self,
        api: FastAPI,
        settings: ApiSettings,
        host: str,
        port: int,
        *,
        log_config: dict[str, Any] | None = LOGGING_CONFIG,
        log_level: str | None = None,
    ) -> None:
        logs: dict[str, Any] = {"log_config": log_config, "log_level": log_level}
        config = listener_config(
            api, settings.header_timeout_s, limit_concurrency=settings.max_concurrency, **logs
        )
        self.api = uvicorn.Server(config)
        self.probes: uvicorn.Server | None = None
        self._sockets = {self.api: bind(host, port)}
        if settings.probe_port is not None:
            probes = probe_app(api)
            self.probes = _Companion(
                listener_config(probes, settings.header_timeout_s, access_log=False, **logs)
            )
            try:
                self._sockets[self.probes] = bind(host, settings.probe_port)
            except OSError:
                self._sockets[self.api].close()
                raise

    @property
    def port(self) -> int:
        return int(self._sockets[self.api].getsockname()[1])

    @property
    def probe_port(self) -> int | None:
        return None if self.probes is None else int(self._sockets[self.probes].getsockname()[1])

    @property
    def started(self) -> bool:
        return all(server.started for server in self._sockets)

    def run(self) -> None:
        """Serve until stopped (blocks), on a loop of uvicorn's choice.

        A SIGINT ends it as one ends `uvicorn.run`: uvicorn raises the signal again once it has
        shut down, and that KeyboardInterrupt is the end asked for, not an error."""
        with (
            contextlib.suppress(KeyboardInterrupt),
            asyncio.Runner(loop_factory=self.api.config.get_loop_factory()) as runner,
        ):
            runner.run(self.serve())

    async def serve(self) -> None:
        host, port = self._sockets[self.api].getsockname()[:2]
        probes = f", probes on port {self.probe_port}" if self.probes is not None else ""
        log.info("serving the API on %s port %d%s (CTRL+C to quit)", host, port, probes)
        companion = None
        if self.probes is not None:
            companion = asyncio.create_task(self.probes.serve([self._sockets[self.probes]]))
        try:
            await self.api.serve([self._sockets[self.api]])
        finally:
            if self.probes is not None and companion is not None:
                self.probes.should_exit = True
                await companion

    def stop(self) -> None:
        self.api.should_exit = True
