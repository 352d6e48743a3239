"""The sandbox server (`kpo sandbox serve`): `POST /v1/run` runs one call under the sandbox,
`GET /healthz` says it is up.

Concurrency is bounded: `max_concurrency` calls run at once (one worker thread, one sandbox
uid each) and `max_queue` more wait; past that the answer is 429 with Retry-After at once,
never an unbounded queue. A call's own failure (an exception, a limit, a timeout) is a 200
with its status: only the server's own refusals are HTTP errors.

What a request must be before any of it is read (the listener itself holds the limits of every
listener of the project, services.http_listener, the body deadline among them):

- its Host one of the server's names (`SandboxSettings.host_names`: loopback names, the bind
  address, `KPO_SANDBOX_TRUSTED_HOSTS`): a web page that points a name of its own at the server's
  address (DNS rebinding) sends that name, and is refused (400);
- the token, on anything but the probes (`PROBE_PATHS`): a request without it is a 401 on its
  head alone, so that a client without the token holds no place of the connection limit while
  it sends (or withholds) a body, and learns nothing of what the server would accept;
- no trailing-slash redirect: one is built from the Host header.

The probes also answer on a listener of their own (`KPO_SANDBOX_PROBE_PORT`), without the call
port's connection limit and on the same event loop (`SandboxServer`): while the call port is
full, the probes still say whether the server is alive.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import re
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.config import LOGGING_CONFIG

from services.http_listener import (
    ServerWithProbes,
    comma_entries,
    listener_config,
    own_host_names,
)
from services.tools.reaper import become_subreaper, is_reaper
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
# What the orchestrator's probes call: never guarded by the token, and served on the probes'
# listener too.
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
# A Host header (RFC 9110 7.2): a name or IPv4 address, or an IPv6 address in brackets, and a
# port. Anything else (user info, a path) is no host of this server's.
HOST_HEADER = re.compile(
    r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]+))(?::[0-9]{1,5})?"
)


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
    nproc: int = Field(16, ge=4, description="processes and threads of a call (RLIMIT_NPROC)")
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
    body_timeout_s: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="a request whose body has not all arrived this long after its head is "
        "answered 408 and its connection closed",
    )
    probe_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="serve /healthz and /readyz on this port of their own too, without the "
        "call port's connection limit (for the orchestrator's probes)",
    )
    trusted_hosts: str | None = Field(
        None,
        description="comma-separated Host names the server answers besides its loopback "
        "names and its bind address (any port): the names its clients reach it by",
    )
    token: SecretStr | None = Field(None, description="bearer token calls must carry")
    token_file: Path | None = Field(None, description="a file holding the token")

    @field_validator("trusted_hosts")
    @classmethod
    def _hosts_are_host_names(cls, value: str | None) -> str | None:
        for entry in comma_entries(value):
            if host_name(entry) is None:
                raise ValueError(f"{entry!r} is not a host name (e.g. kpo-sandbox.ns.svc)")
        return value

    def host_names(self, bind_host: str | None) -> frozenset[str]:
        """The Host names the server answers (as `host_name` gives them): its loopback names,
        `bind_host` (not an any-address one: no client names it), and KPO_SANDBOX_TRUSTED_HOSTS."""
        entries = [*own_host_names(bind_host), *comma_entries(self.trusted_hosts)]
        return frozenset(name for name in map(host_name, entries) if name is not None)

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


def host_name(value: str) -> str | None:
    """The host a Host header (or a setting's entry) names, without its port: lowercase, an IP
    address as `ipaddress` writes it (an IPv6 one unbracketed, so a setting may give it either
    way); None for what is not a host."""
    try:
        return str(ipaddress.ip_address(value))  # an unbracketed address (a setting's `::1`)
    except ValueError:
        pass
    match = HOST_HEADER.fullmatch(value)
    if match is None:
        return None
    if match["ipv6"] is None:
        return match["name"].lower()
    try:
        return str(ipaddress.IPv6Address(match["ipv6"]))
    except ValueError:
        return None


def _refusal(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """A refusal of a request on its head: the connection is closed after it, so whatever body
    the client still sends holds nothing."""
    return JSONResponse(
        {"detail": detail}, status_code=status, headers={**(headers or {}), "Connection": "close"}
    )


class HostAllowlist:
    """400 for a request whose Host is not one of `names` (`host_name`'s form), before the app
    sees any of it."""

    def __init__(self, app: ASGIApp, names: frozenset[str]) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            given = Headers(scope=scope).get("host", "")
            if host_name(given) not in self.names:
                detail = (
                    f"Host {given!r} is not a name of this sandbox server: it answers its "
                    "loopback names, its bind address and KPO_SANDBOX_TRUSTED_HOSTS"
                )
                await _refusal(400, detail)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _token_matches(authorization: str, token: str) -> bool:
    scheme, _, given = authorization.partition(" ")
    # compare_digest: the time taken must not reveal how much of the token matched.
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode(), token.encode()
    )


class TokenGate:
    """401 for a request without the bearer `token` (None: no token, everything passes), the
    probes' GET and HEAD apart, on the request's head alone: no body is read before it."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._refused(scope):
            challenge = {"WWW-Authenticate": 'Bearer realm="kpo-sandbox"'}
            refusal = _refusal(401, "missing or wrong sandbox token", challenge)
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refused(self, scope: Scope) -> bool:
        if self.token is None or scope["type"] != "http" or _is_probe(scope):
            return False
        return not _token_matches(Headers(scope=scope).get("authorization", ""), self.token)


def _is_probe(scope: Scope) -> bool:
    return scope["method"] in ("GET", "HEAD") and scope["path"] in PROBE_PATHS


class ProbesOnly:
    """The probes of `app` (`PROBE_PATHS`, through all of its middleware: the Host check
    too), and a 404 for anything else: the app of the probes' listener."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # uvicorn refuses what the app does not accept
        if scope["path"] not in PROBE_PATHS:
            await JSONResponse({"detail": "Not Found"}, status_code=404)(scope, receive, send)
            return
        await self.app(scope, receive, send)


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


def add_guards(
    app: FastAPI, settings: SandboxSettings, token: str | None, bind_host: str | None
) -> None:
    """What a request must pass before the routes see any of it (see the module): the last
    added runs first, so the Host, then the token, then the body's size."""
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(TokenGate, token=token)
    app.add_middleware(HostAllowlist, names=settings.host_names(bind_host))


def token_dependency(token: str | None) -> Callable[[Request], None]:
    """The routes' own check of the token: TokenGate has refused a request without it already,
    and a route says so too."""

    def authorised(request: Request) -> None:
        if token is not None and not _token_matches(
            request.headers.get("authorization", ""), token
        ):
            raise HTTPException(
                401,
                "missing or wrong sandbox token",
                headers={"WWW-Authenticate": 'Bearer realm="kpo-sandbox"'},
            )

    return authorised


def add_readiness(app: FastAPI, sandbox: SandboxRunner) -> None:
    """`GET /readyz`: ready while calls start. A server whose calls cannot start (no process
    left to fork) is alive (/healthz) but useless: it leaves the Service until a call starts
    again, which `unready_reason` probes for itself (a plain def: in the thread pool)."""

    @app.get("/readyz", response_model=None)
    def readyz() -> dict[str, Any] | JSONResponse:
        reason = sandbox.unready_reason()
        if reason is not None:
            return JSONResponse({"status": "unready", "detail": reason}, status_code=503)
        return {"status": "ready", "backend": sandbox.backend}


def create_app(
    settings: SandboxSettings,
    runner: SandboxRunner | None = None,
    *,
    bind_host: str | None = None,
) -> FastAPI:
    """The app; `runner` defaults to one built from the settings (which checks that the
    backend runs code here, and raises SandboxUnavailable if not); `bind_host`: the address
    the server listens on (a Host name it answers)."""
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

    app = FastAPI(
        title="kpo sandbox",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        redirect_slashes=False,  # a redirect would be built from the Host header
    )
    add_guards(app, settings, token, bind_host)
    add_readiness(app, sandbox)
    authorised = token_dependency(token)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {
            "status": "ok",
            "backend": sandbox.backend,
            "admitted": admission.admitted,
            "capacity": admission.capacity,
            "calls": dict(admission.statuses),
            # Whether what calls leave behind comes to this process to be reaped (SandboxServer
            # makes it so): false, their zombies count against the slots' process budgets.
            "reaps_orphans": is_reaper(),
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


class SandboxServer(ServerWithProbes):
    """The app on `host`:`port` (the calls, and the probes) and, with `probe_port`, its probes on
    that port too, on one event loop until the call port's server stops (SIGINT, SIGTERM, or
    `stop`). The ports are bound when it is made: a port in use is an OSError here.

    `app`: the app to serve (default: `create_app(settings, bind_host=host)`, which raises
    SandboxUnavailable when the backend cannot run code here).

    Making one makes this process a child subreaper, before any call runs (the runner's own
    check is one): what calls leave behind (bwrap's namespace init, a `process` call's setsid
    grandchild) comes to this process, which reaps it after each call (services/tools/reaper.py),
    not to an init that may reap it late or never while it counts against the slot's process
    budget."""

    def __init__(
        self,
        settings: SandboxSettings,
        host: str,
        port: int,
        *,
        app: FastAPI | None = None,
        log_config: dict[str, Any] | None = LOGGING_CONFIG,
        log_level: str | None = "info",
    ) -> None:
        become_subreaper()
        self.app = create_app(settings, bind_host=host) if app is None else app
        log.info(
            "sandbox: backend %s, %d workers, queue %d",
            settings.backend,
            settings.max_concurrency,
            settings.max_queue,
        )
        listener: dict[str, Any] = {
            "body_timeout_s": settings.body_timeout_s,
            "log_config": log_config,
            "log_level": log_level,
        }
        # Connections at once before uvicorn answers 503 itself: above the sandbox's own bound
        # (whose 429 comes first), with room for /healthz. Idle connections and withheld bodies
        # do not hold places for ever (services.http_listener).
        limit = settings.max_concurrency + settings.max_queue + EXTRA_CONNECTIONS
        calls = listener_config(
            self.app, settings.header_timeout_s, limit_concurrency=limit, lifespan=True, **listener
        )
        probes = None
        if settings.probe_port is not None:
            probes = listener_config(
                ProbesOnly(self.app), settings.header_timeout_s, access_log=False, **listener
            )
        super().__init__("the sandbox", calls, host, port, probes, settings.probe_port)

    @property
    def calls(self) -> uvicorn.Server:
        """The call port's server."""
        return self.main
