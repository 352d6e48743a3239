"""`create_app`: the control plane's FastAPI application, put together from its parts."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kpo_core
from services.api import dashboard, routes_runs, routes_system
from services.api.auth import BearerAuth
from services.api.errors import install_error_handlers
from services.api.prometheus import ApiMetrics, build_registry
from services.api.request_guard import RequestBodyGuard
from services.api.settings import ApiSettings
from services.api.spec_paths import inputs_dir
from services.store import Store


def create_app(settings: ApiSettings, store: Store, launcher: Any) -> FastAPI:
    """The API over `store`, launching runs with `launcher` (see services.api.launcher)."""
    app = FastAPI(
        title="KPO-RL control plane",
        version=kpo_core.__version__,
        description="Submit asynchronous RL runs (KPO, CTPO, GRPO, GSPO, GMPO) and watch them.",
    )
    app.state.store = store
    app.state.launcher = launcher
    app.state.auth = BearerAuth(settings.token(), settings.auth_reads)
    app.state.inputs_dir = inputs_dir(settings.data_dir)
    app.state.registry, api_metrics = build_registry(store)
    install_error_handlers(app)
    app.include_router(routes_runs.router)
    app.include_router(routes_system.router)
    app.include_router(dashboard.router)
    # Inside RequestMetrics, so that refused bodies are counted too.
    app.add_middleware(RequestBodyGuard, max_bytes=settings.max_body_bytes)
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
