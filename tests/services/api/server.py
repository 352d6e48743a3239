"""A real uvicorn server on a free loopback port, in a thread of the test process, configured
as `kpo serve` configures its listeners (services.api.listeners)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from services.http_listener import bind, listener_config


@contextmanager
def serve(app: FastAPI, port: int | None = None, log_level: str = "warning") -> Iterator[str]:
    """Serve `app` until the block ends; yields its base URL. uvicorn logs at `log_level`.

    Its records go to the root logger (pytest's capture) rather than to handlers of uvicorn's
    own: those would hold the streams of the test that started the server, closed after it,
    while a server of a module-scoped fixture goes on logging."""
    sock = bind("127.0.0.1", port or 0)
    config = listener_config(app, header_timeout_s=10.0, log_config=None, log_level=log_level)
    with running(uvicorn.Server(config), sock):
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextmanager
def running(server: uvicorn.Server, sock: socket.socket) -> Iterator[uvicorn.Server]:
    """`server` listening on `sock` in a thread until the block ends (then `sock` is closed)."""
    thread = threading.Thread(target=server.run, args=([sock],), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"uvicorn did not start on port {sock.getsockname()[1]}")
        time.sleep(0.02)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        sock.close()
