"""Every listener's body deadline (services.http_listener): a request whose body has not all
arrived within the deadline after its head is answered 408 and its connection closed, however
it trickles in; one whose body arrives in time is served; a connection whose response was sent
before its body arrived is closed at the deadline too, so a client cannot keep it (and its place
under a connection limit) by sending a byte now and then.

Real uvicorn servers on loopback sockets, configured as every listener of the project is
(`listener_config`, with the header timeout as the body deadline, as the API and metrics
listeners have it), and h11 clients (tests/services/half_sent.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from services.http_listener import bind, listener_config
from tests.services.api.server import running
from tests.services.half_sent import Answer, HalfSent, answer, half_sent

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 2.0
# How late past the deadline an answer may come on a loaded test machine: the server's timer
# and the client's reads run on different clocks and schedulers.
SLACK_S = 5.0
DRIP_EVERY_S = 0.2


async def reads_its_body(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads the whole body, then answers 200 with its length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    await _answer(send, 200, str(size).encode())


async def answers_at_once(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers 401 without reading the body (as a server does to a request without its token)."""
    if scope["type"] == "http":
        await _answer(send, 401, b"no token")


async def _answer(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def serving(app: object) -> Iterator[int]:
    """`app` on a loopback port (yielded) under the listener config, with `DEADLINE_S` as the
    header timeout (and so the body deadline)."""
    sock = bind("127.0.0.1", 0)
    with running(uvicorn.Server(listener_config(app, DEADLINE_S, log_config=None)), sock):
        yield int(sock.getsockname()[1])


def drip_until_answered(client: HalfSent, within_s: float) -> Answer:
    """Send one body byte every `DRIP_EVERY_S` until the server answers or closes; what it did.
    The wait between bytes is the client under test (a slow one), not a synchronisation."""
    deadline = time.monotonic() + within_s
    got = Answer(None, closed=False)
    while time.monotonic() < deadline and not got.closed:
        try:
            client.send_more(b" ")
        except (BrokenPipeError, ConnectionResetError):
            return Answer(got.status, closed=True)
        seen = answer(client, DRIP_EVERY_S)
        got = Answer(seen.status or got.status, seen.closed)
    return got


def test_a_withheld_body_is_answered_408_and_closed() -> None:
    with serving(reads_its_body) as port, ExitStack() as stack:
        client = half_sent(port, stack, path="/upload")
        assert answer(client, DEADLINE_S + SLACK_S) == Answer(408, closed=True)


def test_a_body_trickling_in_past_the_deadline_is_answered_408() -> None:
    """The deadline is for the whole body, not a pause between reads: bytes that keep coming
    do not extend it."""
    with serving(reads_its_body) as port, ExitStack() as stack:
        client = half_sent(port, stack, path="/upload", declared=4096, sent=1)
        started = time.monotonic()
        assert drip_until_answered(client, DEADLINE_S + SLACK_S) == Answer(408, closed=True)
        assert time.monotonic() - started < DEADLINE_S + SLACK_S


def test_a_body_that_arrives_is_served_and_the_next_request_has_a_deadline_of_its_own() -> None:
    with serving(reads_its_body) as port, ExitStack() as stack:
        client = half_sent(port, stack, path="/upload", declared=1024, sent=512)
        client.finish(b" " * 512)
        assert answer(client, DEADLINE_S / 2) == Answer(200, closed=False)  # kept alive
        client.next_request(port, "/upload", declared=1024, sent=512)
        assert answer(client, DEADLINE_S + SLACK_S) == Answer(408, closed=True)


def test_a_connection_answered_before_its_body_is_closed_at_the_deadline() -> None:
    """An answer that did not need the body (a 401) leaves the connection waiting for the rest
    of it; a client sending a byte now and then would hold it for ever."""
    with serving(answers_at_once) as port, ExitStack() as stack:
        client = half_sent(port, stack, path="/upload", declared=4096, sent=1)
        assert drip_until_answered(client, DEADLINE_S + SLACK_S) == Answer(401, closed=True)
