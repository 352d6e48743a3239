"""What every HTTP listener the project runs holds, whoever serves on it (the control plane's
API, probes and metrics: services.api.listeners; the tool sandbox: services.tools.server).

- A connection must send a whole request head within its header timeout of opening, and of its
  previous response (`DeadlineProtocol`): uvicorn itself times out only a connection kept
  alive after a response, and counts a connection that never sends anything against its
  connection limit for ever, so idle sockets from one host would hold a listener at 503.
- A request's body must arrive whole within its body deadline of its head (by default the
  header timeout), or it is answered 408 and its connection closed: uvicorn waits for a body
  as long as its sender keeps the connection open, so requests that withhold their bodies
  would hold a listener at 503 as idle sockets did. The deadline is for the whole body, not for
  a pause between its bytes, and it holds after a response sent before the body arrived (a
  401 on the head alone): a client sending a byte now and then keeps nothing. The apps served
  read a body as it comes (each counts it against its size limit), so a body late at the
  deadline is its sender's, not a server busy elsewhere.
- Idle keep-alive connections close after `KEEP_ALIVE_S`, and a request head is at most
  `MAX_HEAD_BYTES`.
- `X-Forwarded-For` is not read by uvicorn (which trusts it from any loopback peer):
  services.api.client_identity reads it, from the operator's proxies only.

And the Host names a listener answers without being told more (`own_host_names`: its loopback
names and its bind address), from which each server builds its allowlist against DNS rebinding.
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
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

log = logging.getLogger(__name__)

KEEP_ALIVE_S = 5
MAX_HEAD_BYTES = 16 * 1024
# How long open requests (event streams) may hold a shutdown, or a restart, up.
GRACEFUL_SHUTDOWN_S = 5
# The names a loopback server is reached by. A rebinding page cannot send one of them (its
# requests name its own site), so they are always answered.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with the request deadlines of the module: a connection whose
    request head has not arrived `head_timeout_s` after it opened or its last response ended is
    closed; a request whose body has not all arrived `body_timeout_s` after its head is answered
    408 (or, answered already, has its connection closed)."""

    head_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    # The request whose body the body timer waits for: a timer per request, armed once.
    _body_cycle: RequestResponseCycle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def handle_events(self) -> None:
        # Every request head is read here, from new data or from data pipelined behind the last
        # response: the one place to see a head in and its body still to come.
        super().handle_events()
        self._arm_body_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        waiting_for_head = self.conn.their_state is h11.IDLE
        if waiting_for_head and (self.cycle is None or self.cycle.response_complete):
            self.timeout_keep_alive_handler()  # uvicorn's close of an idle connection

    def _arm_body_timer(self) -> None:
        cycle = self.cycle
        if cycle is None or cycle is self._body_cycle or self.conn.their_state is not h11.SEND_BODY:
            return
        if self._body_timer is not None:
            self._body_timer.cancel()
        self._body_cycle = cycle
        self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timed_out, cycle)

    def _body_timed_out(self, cycle: RequestResponseCycle) -> None:
        if cycle is not self.cycle or self.conn.their_state is not h11.SEND_BODY:
            return  # the body arrived
        if self.transport.is_closing():
            return
        if cycle.response_started:
            # Answered without the body (or answering): nothing more to say on this connection.
            self.transport.close()
            return
        # The app waiting for the body hears that the client has gone, and what it sends from
        # now on is dropped (uvicorn's handling of a lost connection): the 408 is the answer.
        cycle.disconnected = True
        cycle.message_event.set()
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        message = "%s - request body not received within %g s: 408"
        self.logger.warning(message, client, self.body_timeout_s)
        self._send_408()

    def _send_408(self) -> None:
        """A 408 and the connection's close, written as uvicorn writes its own 400."""
        body = f"request body not received within {self.body_timeout_s:g} s".encode()
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        response = h11.Response(status_code=408, headers=headers, reason=b"Request Timeout")
        for event in (response, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def deadline_protocol(head_timeout_s: float, body_timeout_s: float) -> type[DeadlineProtocol]:
    deadlines = {"head_timeout_s": head_timeout_s, "body_timeout_s": body_timeout_s}
    return type("DeadlineProtocol", (DeadlineProtocol,), deadlines)


def listener_config(
    app: Any,
    header_timeout_s: float,
    *,
    body_timeout_s: float | None = None,
    limit_concurrency: int | None = None,
    access_log: bool = True,
    log_config: dict[str, Any] | None = LOGGING_CONFIG,
    log_level: str | None = None,
    lifespan: bool = False,
) -> uvicorn.Config:
    """uvicorn's configuration of one listener (its socket is bound apart: `bind`);
    `body_timeout_s`: the body deadline (None: `header_timeout_s`); `lifespan`: run the app's
    lifespan events (off where the app's owner starts and stops what it needs itself)."""
    body_s = header_timeout_s if body_timeout_s is None else body_timeout_s
    return uvicorn.Config(
        app,
        http=deadline_protocol(header_timeout_s, body_s),
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


class CompanionServer(uvicorn.Server):
    """A server run beside another on its event loop (a listener of probes beside the one it
    probes): it leaves the process's signals to that server, which stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ServerWithProbes:
    """A listener on `host`:`port` and, with a `probes` config, a listener of probes on
    `probe_port`, on one event loop until the main server stops (SIGINT, SIGTERM, or `stop`):
    the probes' listener holds no connection limit, so past the main one's the probes still
    answer, and a probe that answers says that loop is alive (the control plane's API and the
    tool sandbox both serve so). The ports are bound when it is made: a port in use is an
    OSError here, before anything runs."""

    def __init__(
        self,
        name: str,
        main: uvicorn.Config,
        host: str,
        port: int,
        probes: uvicorn.Config | None = None,
        probe_port: int | None = None,
    ) -> None:
        self.name = name
        self.main = uvicorn.Server(main)
        self.probes: uvicorn.Server | None = None
        self._sockets = {self.main: bind(host, port)}
        if probes is not None and probe_port is not None:
            self.probes = CompanionServer(probes)
            try:
                self._sockets[self.probes] = bind(host, probe_port)
            except OSError:
                self._sockets[self.main].close()
                raise

    @property
    def port(self) -> int:
        return int(self._sockets[self.main].getsockname()[1])

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
            asyncio.Runner(loop_factory=self.main.config.get_loop_factory()) as runner,
        ):
            runner.run(self.serve())

    async def serve(self) -> None:
        host, port = self._sockets[self.main].getsockname()[:2]
        probes = f", probes on port {self.probe_port}" if self.probes is not None else ""
        log.info("serving %s on %s port %d%s (CTRL+C to quit)", self.name, host, port, probes)
        companion = None
        if self.probes is not None:
            companion = asyncio.create_task(self.probes.serve([self._sockets[self.probes]]))
        try:
            await self.main.serve([self._sockets[self.main]])
        finally:
            if self.probes is not None and companion is not None:
                self.probes.should_exit = True
                await companion

    def stop(self) -> None:
        self.main.should_exit = True


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` (0: a free port). Raises OSError if it cannot be."""
    family = socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=2048)
    # The same socket, its protocol named TCP: create_server leaves it 0, and asyncio turns
    # Nagle's algorithm off (TCP_NODELAY) only on accepted sockets whose protocol says TCP.
    # With Nagle on, a response's body (written after its head) waits for the client's delayed
    # ACK: some 40 ms added to every request on a kept-alive connection.
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, fileno=listener.detach())


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def comma_entries(setting: str | None) -> list[str]:
    """The entries of a comma-separated setting, stripped, empty ones left out."""
    return [entry.strip() for entry in (setting or "").split(",") if entry.strip()]


def host_header_form(host: str) -> str | None:
    """`host` as a Host header names it (without a port): lowercase, an IPv6 address in
    brackets; None for an any-address (0.0.0.0, ::), which no client sends."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host.lower()
    if address.is_unspecified:
        return None
    return f"[{address}]" if address.version == 6 else str(address)


def own_host_names(bind_host: str | None) -> list[str]:
    """The Host names (`host_header_form`) a listener on `bind_host` answers whatever its
    settings: its loopback names, and `bind_host` unless it is an any-address (or None)."""
    names = [name for name in map(host_header_form, LOOPBACK_HOSTS) if name is not None]
    bound = None if bind_host is None else host_header_form(bind_host)
    if bound is not None and bound not in names:
        names.append(bound)
    return names
