"""What processes listen on, read from /proc (psutil maps /proc/net/tcp and tcp6 socket inodes to
the pids whose /proc/<pid>/fd hold them), and what those listeners answer without a token."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx
import psutil

LOOPBACK = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})


def listening(pids: Iterable[int]) -> list[Any]:
    """The listening TCP sockets (IPv4 and IPv6) of `pids` (psutil's `sconn`: laddr, pid)."""
    wanted = set(pids)
    return [
        c
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in wanted
    ]


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it."""
    process = psutil.Process(pid)
    return {pid, *(child.pid for child in process.children(recursive=True))}


def http_answers_without_token(sockets: Iterable[Any]) -> dict[int, int]:
    """Port -> HTTP status of `GET /metrics` without a token, for each socket that answers
    HTTP/1.1 (Ray's gRPC ports do not), reached on loopback when it listens on every address."""
    answered = {}
    for connection in sockets:
        ip = connection.laddr.ip.removeprefix("::ffff:")
        host = "127.0.0.1" if ip in ("0.0.0.0", "::") else f"[{ip}]" if ":" in ip else ip
        try:
            response = httpx.get(f"http://{host}:{connection.laddr.port}/metrics", timeout=5)
        except httpx.HTTPError:
            continue
        answered[connection.laddr.port] = response.status_code
    return answered
