"""Requests written byte for byte on a socket: what httpx would normalise or refuse to send
(`..` segments, encoded slashes, NUL, a Content-Length that lies, an overlong request line)."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def raw_request(
    base_url: str, head: bytes, body: bytes = b"", timeout_s: float = 10
) -> RawResponse:
    """Send `head` (request line and headers, without the blank line) and `body`; the response.

    `Connection: close` is added, so the response ends where the server closes the connection.
    """
    parts = urlsplit(base_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as sock:
        sock.sendall(head + b"\r\nConnection: close\r\n\r\n" + body)
        received = b""
        while chunk := _recv(sock):
            received += chunk
    return _parse(received)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except ConnectionResetError:  # the server answered before reading all we sent, then closed
        return b""


def _parse(data: bytes) -> RawResponse:
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return RawResponse(int(status_line.split()[1]), headers, body)
