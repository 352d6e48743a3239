"""A pool worker process on its own: it must leave quietly whichever way its pool goes away."""

from __future__ import annotations

import socket
import subprocess
import sys
from multiprocessing.connection import Connection

from services.reward import pool


def start_worker() -> tuple[Connection, subprocess.Popen[bytes]]:
    ours, theirs = socket.socketpair()
    with theirs:
        process = subprocess.Popen(
            [sys.executable, "-c", pool._BOOTSTRAP, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
    conn = Connection(ours.detach())
    conn.send(list(sys.path))
    conn.send(len)
    return conn, process


def test_worker_exits_quietly_when_the_pool_closes_its_end() -> None:
    conn, process = start_worker()
    assert conn.recv() == pool._READY
    conn.close()
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0 and stderr == b""


def test_worker_exits_quietly_when_its_connection_is_reset() -> None:
    # Closing a Unix socket with unread data in it resets the peer rather than ending it
    # cleanly: this is what a worker sees when the Ray actor holding its pool is killed.
    conn, process = start_worker()
    assert conn.poll(30)  # the READY message has arrived, and stays unread
    conn.close()
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr.decode()
    assert stderr == b""
