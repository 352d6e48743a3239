"""Every listener's connections have Nagle's algorithm off (services.http_listener.bind).

A response is written as its head and then its body. With Nagle on, the body waits until the
client acknowledges the head, and a client delays that ACK (some 40 ms on Linux) waiting for
data of its own: every request on a kept-alive connection took that long. asyncio turns Nagle
off only on accepted sockets whose protocol is TCP, which `bind` names.

A real uvicorn server under the listener config, reached by a raw socket client."""

from __future__ import annotations

import socket

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from services.http_listener import bind, listener_config
from tests.services.api.server import running

pytestmark = pytest.mark.timeout(60)

REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
BODY = b"answered"


async def answers(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "http":
        headers = [(b"content-length", str(len(BODY)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": BODY})


def read_response(client: socket.socket) -> bytes:
    data = b""
    while not data.endswith(BODY):
        chunk = client.recv(4096)
        assert chunk, data  # the server closed before its answer
        data += chunk
    return data


def nodelay(sock: socket.socket) -> bool:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_bind_names_tcp_so_that_asyncio_turns_nagle_off() -> None:
    with bind("127.0.0.1", 0) as sock:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)  # listening
        with socket.create_connection(sock.getsockname(), timeout=5):
            accepted, _ = sock.accept()
        with accepted:
            assert accepted.proto == socket.IPPROTO_TCP  # what asyncio reads


def test_the_servers_side_of_a_kept_alive_connection_sends_without_nagle() -> None:
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(listener_config(answers, 10.0, log_config=None))
    with running(server, sock), socket.create_connection(sock.getsockname(), timeout=10) as client:
        for _ in range(2):  # the second request is the kept-alive one Nagle delayed
            client.sendall(REQUEST)
            assert read_response(client).startswith(b"HTTP/1.1 200")
        (connection,) = server.server_state.connections
        served = connection.transport.get_extra_info("socket")  # type: ignore[attr-defined]
        assert served.getpeername() == client.getsockname()
        assert nodelay(served)
