"""Health, readiness and the Prometheus export: what probes and scrapers call (never guarded)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from services.api.deps import LauncherDep, StoreDep
from services.api.prometheus import render

router = APIRouter(tags=["system"])


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    store: bool
    ray: bool


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """The process is alive (no dependency is checked: that is /readyz)."""
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
def readyz(store: StoreDep, launcher: LauncherDep) -> JSONResponse:
    """200 when the store and Ray both answer, else 503 saying which does not."""
    checks = Readiness(store=_safe(store.ping), ray=_safe(launcher.ready))
    code = 200 if checks.store and checks.ray else 503
    return JSONResponse(checks.model_dump(), status_code=code)


def _safe(check: object) -> bool:
    try:
        return bool(check())  # type: ignore[operator]
    except Exception:  # a probe answers "not ready"; it never fails itself
        return False


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    """Prometheus text format: run gauges and counters, API request counts and latencies."""
    body, content_type = render(request.app.state.registry)
    return Response(body, media_type=content_type)
