"""Health, readiness and the Prometheus export: what probes and scrapers call.

`/healthz` and `/readyz` are never guarded, and never wait for the worker threads that serve
the routes: a liveness probe must answer while those are busy (or the orchestrator restarts a
server that is only loaded), and a readiness probe answers from a cache, refreshed on a thread
of its own. With `KPO_PROBE_PORT` they are served on that port too, where the API's connection
limit does not apply (services.api.listeners). `/metrics` is here only when it has no port of
its own (`KPO_METRICS_PORT`, see services.api.metrics_server); then it needs the token as reads
do.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from anyio import CapacityLimiter, Lock, to_thread
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from services.api.deps import ReadAccess
from services.api.prometheus import render
from services.jobs.interface import RunLauncher
from services.store import Store

# How long /readyz answers from its last check: a probe of every replica and load balancer every
# second costs one store ping and one call of the Ray job server per period, not one each.
READY_CACHE_S = 2.0

router = APIRouter(tags=["system"])
metrics_router = APIRouter(tags=["system"])


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    store: bool
    ray: bool


class ReadinessProbe:
    """The store's and Ray's readiness, checked at most once per `ttl_s` on a thread of its own
    (one check at a time; callers meanwhile wait for its result)."""

    def __init__(
        self,
        store: Store,
        launcher: RunLauncher,
        ttl_s: float = READY_CACHE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._launcher = launcher
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = Lock()
        self._thread = CapacityLimiter(1)
        self._last: tuple[float, Readiness] | None = None

    async def check(self) -> Readiness:
        async with self._lock:
            if self._last is not None and self._clock() - self._last[0] < self._ttl_s:
                return self._last[1]
            checks = await to_thread.run_sync(self._check_now, limiter=self._thread)
            self._last = (self._clock(), checks)
            return checks

    def _check_now(self) -> Readiness:
        return Readiness(store=_safe(self._store.ping), ray=_safe(self._launcher.ready))


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is alive: answered on the event loop, touching nothing (no dependency is
    checked, and no worker thread is needed: that is /readyz)."""
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(request: Request) -> JSONResponse:
    """200 when the store and Ray both answer, else 503 saying which does not (as checked in the
    last 2 seconds)."""
    probe: ReadinessProbe = request.app.state.readiness
    checks = await probe.check()
    code = 200 if checks.store and checks.ray else 503
    return JSONResponse(checks.model_dump(), status_code=code)


def _safe(check: Callable[[], object]) -> bool:
    try:
        return bool(check())
    except Exception:  # a probe answers "not ready"; it never fails itself
        return False


@metrics_router.get("/metrics", response_class=Response, dependencies=[ReadAccess])
def metrics(request: Request) -> Response:
    """Prometheus text format: run gauges and counters, API request counts and latencies."""
    body, content_type = render(request.app.state.registry)
    return Response(body, media_type=content_type)
