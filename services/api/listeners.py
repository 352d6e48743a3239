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

import logging
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.middleware.trustedhost import TrustedHostMiddleware
from uvicorn.config import LOGGING_CONFIG

from services.api import routes_system
from services.api.settings import ApiSettings
from services.http_listener import ServerWithProbes, listener_config

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


class ControlPlaneServer(ServerWithProbes):
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
        probes = None
        if settings.probe_port is not None:
            probes = listener_config(
                probe_app(api), settings.header_timeout_s, access_log=False, **logs
            )
        super().__init__("the API", config, host, port, probes, settings.probe_port)

    @property
    def api(self) -> uvicorn.Server:
        """The API's server (its config holds the app)."""
        return self.main
