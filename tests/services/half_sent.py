"""Clients that send a whole request head and only part of the body it declares, for the tests
of every listener's body deadline (services.http_listener) and of the servers that must answer
such a request on its head alone (the sandbox's token). h11 writes the requests and reads the
answers, so that what is under test is the server's HTTP, not a hand-written client's."""

from __future__ import annotations

import socket
import time
from contextlib import ExitStack
from dataclasses import dataclass

import h11


@dataclass
class HalfSent:
    """One connection and the client side of its HTTP state."""

    sock: socket.socket
    conn: h11.Connection

    def send_more(self, data: bytes) -> None:
        self.sock.sendall(self.conn.send(h11.Data(data=data)))

    def finish(self, data: bytes) -> None:
        """Send `data`, the rest of the body, and end the request."""
        self.sock.sendall(self.conn.send(h11.Data(data=data)) + self.conn.send(h11.EndOfMessage()))

    def next_request(self, port: int, path: str, declared: int, sent: int) -> None:
        """Begin another request on this kept-alive connection, as `half_sent` begins one."""
        self.conn.start_next_cycle()
        self.sock.sendall(_request(self.conn, port, path, [], declared, sent))


@dataclass
class Answer:
    """What the server did with a connection: the status it answered (None: none), and whether
    it closed the connection."""

    status: int | None
    closed: bool


def half_sent(
    port: int,
    stack: ExitStack,
    *,
    path: str = "/v1/run",
    headers: list[tuple[str, str]] | None = None,
    declared: int = 1024,
    sent: int = 512,
) -> HalfSent:
    """A `POST path` to `port` on loopback that declares `declared` body bytes and sends `sent`
    of them (spaces: JSON whitespace, were the body ever parsed)."""
    conn = h11.Connection(h11.CLIENT)
    data = _request(conn, port, path, headers or [], declared, sent)
    sock = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
    sock.sendall(data)
    return HalfSent(sock, conn)


def _request(
    conn: h11.Connection,
    port: int,
    path: str,
    headers: list[tuple[str, str]],
    declared: int,
    sent: int,
) -> bytes:
    head = [("Host", f"127.0.0.1:{port}"), ("Content-Type", "application/json")]
    head += [*headers, ("Content-Length", str(declared))]
    data = conn.send(h11.Request(method="POST", target=path, headers=head))
    return data + conn.send(h11.Data(data=b" " * sent))


def answer(client: HalfSent, within_s: float) -> Answer:
    """The status the server answers on `client` and whether it closes the connection, both
    within `within_s` (a monotonic deadline over every read)."""
    deadline = time.monotonic() + within_s
    status: int | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return Answer(status, closed=False)
        client.sock.settimeout(remaining)
        try:
            data = client.sock.recv(65536)
        except TimeoutError:
            return Answer(status, closed=False)
        except ConnectionResetError:
            return Answer(status, closed=True)
        if not data:
            return Answer(status, closed=True)
        status = _status_in(client.conn, data) or status


def _status_in(conn: h11.Connection, data: bytes) -> int | None:
    """The final response status among the events `data` completes (None if none yet)."""
    conn.receive_data(data)
    status = None
    while True:
        event = conn.next_event()
        # PAUSED: the response is whole (h11 waits for a next cycle this client never begins).
        if event in (h11.NEED_DATA, h11.PAUSED) or isinstance(event, h11.ConnectionClosed):
            return status
        if isinstance(event, h11.Response):
            status = event.status_code
