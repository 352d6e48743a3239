"""Clients that open connections and send nothing (or half a request head), for the tests of
every listener's header timeout (services.http_listener)."""

from __future__ import annotations

import socket
from contextlib import ExitStack

import httpx


def idle_sockets(port: int, count: int, stack: ExitStack) -> list[socket.socket]:
    """`count` connections to `port`: half send nothing, half an unfinished request head."""
    sockets = []
    for i in range(count):
        sock = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
        if i % 2:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n")
        sockets.append(sock)
    return sockets


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes `sock` within `within_s` (what it sends before is read)."""
    sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def status(url: str) -> int:
    return httpx.get(url, timeout=5).status_code
