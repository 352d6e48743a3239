"""`create_app`: the control plane's FastAPI application, put together from its parts."""

from __future__ import annotations

import time

from fastapi import FastAPI
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kpo_core
from services.api import dashboard, routes_alerts, routes_runs, routes_system
from services.api.auth import BearerAuth
from services.api.errors import install_error_handlers
from services.api.prometheus import ApiMetrics, build_registry
from services.api.request_guard import RequestBodyGuard
from services.api.routes_alerts import ALERTS_PATH, UNAUTHORIZED_ALERT
from services.api.routes_system import ReadinessProbe
from services.api.settings import ApiSettings
from services.api.spec_paths import inputs_dir
from services.api.sse import EventStreams, StreamSlots
from services.jobs.interface import RunLauncher
from services.store import Store


def create_app(
    settings: ApiSettings, store: Store, launcher: RunLauncher, *, bind_host: str = "127.0.0.1"
) -> FastAPI:
    """The API over `store`, launching runs with `launcher` (`kpo serve` hands it a
    `RayJobLauncher`: services.jobs.launcher), served on `bind_host` (which a server without a
    token answers as a Host, besides its loopback names).

    Raises ValueError for settings that cannot go together (see `ApiSettings.trusted_hosts`).
    """
    docs = settings.openapi_docs
    app = FastAPI(
        title="KPO-RL control plane",
        version=kpo_core.__version__,
        description="Submit asynchronous RL runs (KPO, CTPO, GRPO, GSPO, GMPO) and watch them.",
        # Off by default: the schema maps every operation for whoever reaches the API.
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
        # A path with a slash too many is a 404: Starlette's redirect would name the request's
        # Host header (any value, with a token: `*`) as where to go.
        redirect_slashes=False,
    )
    token = settings.token()
    app.state.settings = settings
    app.state.store = store
    app.state.launcher = launcher
    app.state.auth = BearerAuth(token, settings.auth_reads)
    alert_token = settings.alert_token()
    app.state.alert_auth = BearerAuth(alert_token, guard_reads=True, refusal=UNAUTHORIZED_ALERT)
    app.state.trusted_hosts = settings.trusted_hosts(token is not None, bind_host)
    app.state.trusted_proxies = settings.proxy_networks()
    app.state.inputs_dir = inputs_dir(settings.data_dir)
    app.state.registry, api_metrics = build_registry(store)
    app.state.readiness = ReadinessProbe(store, launcher)
    app.state.streams = EventStreams(
        StreamSlots(settings.max_streams, settings.max_streams_per_client),
        settings.stream_lifetime_s,
    )
    install_error_handlers(app)
    app.include_router(routes_runs.router)
    app.include_router(routes_system.router)
    if settings.metrics_port is None:  # else `kpo serve` serves it on that port
        app.include_router(routes_system.metrics_router)
    app.include_router(dashboard.router)
    if alert_token is not None:  # Alertmanager's webhook, with a token of its own
        app.include_router(routes_alerts.router)
    # Outermost last. RequestMetrics sees every request, refused ones too; a Host the server
    # does not answer is refused before anything reads the body.
    app.add_middleware(
        RequestBodyGuard,
        max_bytes=settings.max_body_bytes,
        auth=app.state.auth,
        path_auth={ALERTS_PATH: app.state.alert_auth} if alert_token is not None else {},
    )
    app.add_middleware(
        TrustedHostMiddleware, allowed_hosts=app.state.trusted_hosts, www_redirect=False
    )
    app.add_middleware(RequestMetrics, api_metrics=api_metrics)
    return app


class RequestMetrics:
    """Counts and times every request by method, route template and status (plain ASGI: cheap).

    The label is the matched route's template (`/v1/runs/{run_id}`), never the raw path, so a
    client cannot create series at will; unmatched paths share one label.
    """

    def __init__(self, app: ASGIApp, api_metrics: ApiMetrics) -> None:
        self.app = app
        self.api_metrics = api_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.api_metrics.observe(scope["method"], route, status, time.perf_counter() - start)
