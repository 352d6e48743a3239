"""The sandbox server (`kpo sandbox serve`): `POST /v1/run` runs one call under the sandbox,
`GET /healthz` says it is up.

Concurrency is bounded: `max_concurrency` calls run at once (one worker thread, one sandbox
uid each) and `max_queue` more wait; past that the answer is 429 with Retry-After at once,
never an unbounded queue. A call's own failure (an exception, a limit, a timeout) is a 200
with its status: only the server's own refusals are HTTP errors.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.http_listener import bind, listener_config
from services.tools.sandbox import (
    MAX_CODE_BYTES,
    Backend,
    SandboxLimits,
    SandboxRunner,
    ToolStatus,
)

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
# Requests uvicorn serves at once beyond the sandbox's own bound: /healthz must still answer
# while every worker and queue place is taken.
EXTRA_CONNECTIONS = 32


class SandboxSettings(BaseSettings):
    """The server's settings: KPO_SANDBOX_* environment variables (or `kpo sandbox serve`
    flags, which win)."""

    model_config = SettingsConfigDict(
        env_prefix="KPO_SANDBOX_", extra="ignore", hide_input_in_errors=True
    )

    backend: Backend = "bwrap"
    allow_unsafe_process: bool = Field(
        False, description="allow the process backend (no namespaces) on machines without them"
    )
    max_concurrency: int = Field(4, ge=1, le=1024, description="calls run at once")
    max_queue: int = Field(32, ge=0, le=100_000, description="calls waiting; past it: 429")
    timeout_s: float = Field(5.0, gt=0, le=3600, description="default wall clock of a call")
    max_timeout_s: float = Field(60.0, gt=0, le=3600, description="most a request may ask for")
    cpu_s: int | None = Field(None, ge=1, description="CPU seconds (default: timeout + 1)")
    memory_mb: int = Field(1024, ge=64, description="address space of a call (RLIMIT_AS)")
    nproc: int = Field(64, ge=4, description="processes and threads of a call (RLIMIT_NPROC)")
    file_mb: int = Field(16, ge=1, description="largest file, and size of the working tmpfs")
    max_output_chars: int = Field(1000, ge=1, le=1_000_000)
    max_body_bytes: int = Field(256 * 1024, ge=1024, description="largest request body")
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="a connection that has not sent a whole request head this long after it "
        "opened (or after its last response) is closed",
    )
    token: SecretStr | None = Field(None, description="bearer token calls must carry")
    token_file: Path | None = Field(None, description="a file holding the token")

    def limits(self) -> SandboxLimits:
        return SandboxLimits(
            timeout_s=self.timeout_s,
            cpu_s=self.cpu_s,
            memory_mb=self.memory_mb,
            nproc=self.nproc,
            file_mb=self.file_mb,
            max_output_chars=self.max_output_chars,
        )

    def bearer_token(self) -> str | None:
        if self.token is not None:
            return self.token.get_secret_value()
        if self.token_file is not None:
            return self.token_file.read_text(encoding="utf-8").strip() or None
        return None


class RunRequest(BaseModel):
    model_config = {"extra": "forbid"}

    code: str = Field(max_length=MAX_CODE_BYTES)
    timeout_s: float | None = Field(None, gt=0)


class RunResponse(BaseModel):
    output: str
    status: ToolStatus
    seconds: float
    timeout_s: float | None = None


class BodyLimit:
    """413 for a body over `max_bytes`, by its Content-Length at once or as a chunked body
    arrives: no body is held whole before it is counted."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _too_large(self.max_bytes)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, f"request body over {self.max_bytes} bytes")
            return message

        await self.app(scope, counted, send)


def _too_large(max_bytes: int) -> JSONResponse:
    return JSONResponse({"detail": f"request body over {max_bytes} bytes"}, status_code=413)


class Admission:
    """Counts calls running and waiting; refuses past `max_concurrency + max_queue`."""

    def __init__(self, max_concurrency: int, max_queue: int) -> None:
        self.capacity = max_concurrency + max_queue
        self.admitted = 0
        self.statuses: Counter[str] = Counter()
        self._lock = threading.Lock()

    def enter(self) -> bool:
        with self._lock:
            if self.admitted >= self.capacity:
                self.statuses["rejected"] += 1
                return False
            self.admitted += 1
            return True

    def leave(self, status: str) -> None:
        with self._lock:
            self.admitted -= 1
            self.statuses[status] += 1


def create_app(settings: SandboxSettings, runner: SandboxRunner | None = None) -> FastAPI:
    """The app; `runner` defaults to one built from the settings (which checks that the
    backend runs code here, and raises SandboxUnavailable if not)."""
    if runner is None:
        runner = SandboxRunner(
            settings.backend,
            settings.limits(),
            allow_unsafe_process=settings.allow_unsafe_process,
            slots=settings.max_concurrency,
        )
    sandbox = runner
    token = settings.bearer_token()
    admission = Admission(settings.max_concurrency, settings.max_queue)
    # The queue is this executor's: workers == slots, so a running call never waits for a uid.
    executor = ThreadPoolExecutor(settings.max_concurrency, thread_name_prefix="sandbox")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kpo sandbox", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    def authorised(request: Request) -> None:
        if token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not reveal how much of the token matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            raise HTTPException(
                401,
                "missing or wrong sandbox token",
                headers={"WWW-Authenticate": 'Bearer realm="kpo-sandbox"'},
            )

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {
            "status": "ok",
            "backend": sandbox.backend,
            "admitted": admission.admitted,
            "capacity": admission.capacity,
            "calls": dict(admission.statuses),
        }

    # The dependency goes in the decorator: a closure's name in a string annotation
    # (from __future__ import annotations) cannot be resolved by FastAPI.
    @app.post("/v1/run", response_model=RunResponse, dependencies=[Depends(authorised)])
    async def run(body: RunRequest) -> RunResponse | JSONResponse:
        timeout_s = settings.timeout_s if body.timeout_s is None else body.timeout_s
        if timeout_s > settings.max_timeout_s:
            raise HTTPException(422, f"timeout_s over the server's {settings.max_timeout_s} s")
        if not admission.enter():
            return JSONResponse(
                {"detail": "sandbox busy: every worker and queue place is taken"},
                status_code=429,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        status = "internal"
        try:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(executor, sandbox.run, body.code, timeout_s)
            status = result.status
            return RunResponse(
                output=result.output,
                status=result.status,
                seconds=result.seconds,
                timeout_s=result.timeout_s,
            )
        finally:
            admission.leave(status)

    return app


def serve(settings: SandboxSettings, host: str, port: int) -> None:
    """Run the server with uvicorn until interrupted (raises SandboxUnavailable first when
    the backend cannot run code here)."""
    app = create_app(settings)
    log.info(
        "sandbox server on %s:%d: backend %s, %d workers, queue %d",
        host,
        port,
        settings.backend,
        settings.max_concurrency,
        settings.max_queue,
    )
    # Connections at once before uvicorn answers 503 itself: above the sandbox's own bound
    # (whose 429 comes first), with room for /healthz. Idle connections do not hold places for
    # ever (services.http_listener).
    limit = settings.max_concurrency + settings.max_queue + EXTRA_CONNECTIONS
    config = listener_config(
        app, settings.header_timeout_s, limit_concurrency=limit, log_level="info", lifespan=True
    )
    uvicorn.Server(config).run(sockets=[bind(host, port)])
