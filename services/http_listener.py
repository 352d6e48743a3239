"""What every HTTP listener the project runs holds, whoever serves on it (the control plane's
API, probes and metrics: services.api.listeners; the tool sandbox: services.tools.server).

- A connection must send a whole request head within its header timeout of opening, and of its
  previous response (`HeadTimeoutProtocol`): uvicorn itself times out only a connection kept
  alive after a response, and counts a connection that never sends anything against its
  connection limit for ever, so idle sockets from one host would hold a listener at 503.
- Idle keep-alive connections close after `KEEP_ALIVE_S`, and a request head is at most
  `MAX_HEAD_BYTES`.
- `X-Forwarded-For` is not read by uvicorn (which trusts it from any loopback peer):
  services.api.client_identity reads it, from the operator's proxies only.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

import h11
import uvicorn
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol

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
    lifespan: bool = False,
) -> uvicorn.Config:
    """uvicorn's configuration of one listener (its socket is bound apart: `bind`);
    `lifespan`: run the app's lifespan events (off where the app's owner starts and stops
    what it needs itself)."""
    return uvicorn.Config(
        app,
        http=head_timeout_protocol(header_timeout_s),
        timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        limit_concurrency=limit_concurrency,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        proxy_headers=False,
        lifespan="on" if lifespan else "off",
        access_log=access_log,
        log_config=log_config,
        log_level=log_level,
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` (0: a free port). Raises OSError if it cannot be."""
    family = socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False
