"""The control plane's HTTP listeners, and the limits every one of them holds.

`kpo serve` listens on up to three ports: the API's, the probes' (`KPO_PROBE_PORT`: `/healthz`
and `/readyz` for the orchestrator) and the metrics' (`KPO_METRICS_PORT`,
services.api.metrics_server). All are uvicorn servers configured here (`listener_config`):

- a connection must send a whole request head within `KPO_HEADER_TIMEOUT_S` of opening, and
  of its previous response (`HeadTimeoutProtocol`): uvicorn itself times out only a connection
  kept alive after a response, and counts a connection that never sends anything against its
  connection limit for ever, so idle sockets from one host would hold the API at 503;
- idle keep-alive connections close after `KEEP_ALIVE_S`, and a request head is at most
  `MAX_HEAD_BYTES`;
- `X-Forwarded-For` is not read by uvicorn (which trusts it from any loopback peer):
  services.api.client_identity reads it, from the operator's proxies only.

The API alone has a connection limit (`KPO_MAX_CONCURRENCY`, then 503). The probes' listener has
none and serves on the API's event loop (`ControlPlaneServer`): past the API's limit the probes
still answer, and a probe that answers says that loop is alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Iterator
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from starlette.middleware.trustedhost import TrustedHostMiddleware
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.api import routes_system
from services.api.settings import ApiSettings

log = logging.getLogger(__name__)

KEEP_ALIVE_S = 5
MAX_HEAD_BYTES = 16 * 1024
# How long open requests (event streams) may hold a shutdown, or a restart, up.
GRACEFUL_SHUTDOWN_S = 5


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol that closes a connection whose request head has not arrived
    `head_timeout_s` after the connection opened or its last response ended."""

    head_timeout_s: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        waiting_for_head = self.conn.their_state is h11.IDLE
        if waiting_for_head and (self.cycle is None or self.cycle.response_complete):
            self.timeout_keep_alive_handler()  # uvicorn's close of an idle connection


def head_timeout_protocol(head_timeout_s: float) -> type[HeadTimeoutProtocol]:
    return type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout_s": head_timeout_s})


def listener_config(
    app: Any,
    header_timeout_s: float,
    *,
    limit_concurrency: int | None = None,
    access_log: bool = True,
    log_config: dict[str, Any] | None = LOGGING_CONFIG,
    log_level: str | None = None,
) -> uvicorn.Config:
    """uvicorn's configuration of one listener (its socket is bound apart: `bind`)."""
    return uvicorn.Config(
        app,
        http=head_timeout_protocol(header_timeout_s),
        timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        limit_concurrency=limit_concurrency,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        proxy_headers=False,
        lifespan="off",
        access_log=access_log,
        log_config=log_config,
        log_level=log_level,
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` (0: a free port). Raises OSError if it cannot be."""
    family = socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


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


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False
