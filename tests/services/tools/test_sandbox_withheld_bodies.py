"""`kpo sandbox serve` against clients that send a request head and withhold the body.

Without the token, the head alone is answered (401) and the connection closed: such clients
hold nothing, and /healthz and the calls of the token's holders answer at once, on the call port
itself (the security review's figures: 67 such requests held every place of the default
connection limit for as long as their senders kept them open).

With the token (a leaked one, or a broken client), each is answered 408 and closed at the body
deadline (`KPO_SANDBOX_BODY_TIMEOUT_S`); until then the call port may be full, and the probes'
listener (`KPO_SANDBOX_PROBE_PORT`) answers all the same.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
import pytest

from services.tools.server import EXTRA_CONNECTIONS
from tests.services.half_sent import Answer, answer, half_sent
from tests.services.tools.sandbox_server import free_port, subprocess_server, wait_healthy

pytestmark = pytest.mark.timeout(180)

TOKEN = "withheld-bodies-token-0123456789"
AUTHORISED = {"Authorization": f"Bearer {TOKEN}"}
WORKERS, QUEUE = 4, 32  # the server's defaults
# One short of the connections uvicorn serves at once by default (4 workers, 32 queue places, 32
# more): the next connection, /healthz included, was a 503.
FLOOD = WORKERS + QUEUE + EXTRA_CONNECTIONS - 1
# The header and body timeouts of the token-less test: far past every bound of it, so that what
# answers there is the server's reading of the head, never a timeout.
SLOW_S = 60.0
# An answer the test waits for; what is "prompt" on a loaded test machine.
PROMPT_S = 10.0
BODY_DEADLINE_S = 2.0
ENV = {
    # The process backend: what is under test is the listener, not the sandbox.
    "KPO_SANDBOX_BACKEND": "process",
    "KPO_SANDBOX_ALLOW_UNSAFE_PROCESS": "true",
    "KPO_SANDBOX_TOKEN": TOKEN,
    "KPO_SANDBOX_MAX_CONCURRENCY": str(WORKERS),
    "KPO_SANDBOX_MAX_QUEUE": str(QUEUE),
}


def assert_a_call_answers(url: str) -> None:
    response = httpx.post(
        f"{url}/v1/run", json={"code": "print(12345*6789)"}, headers=AUTHORISED, timeout=PROMPT_S
    )
    assert response.status_code == 200, response.text
    assert (response.json()["status"], response.json()["output"]) == ("ok", "83810205")


def test_token_less_withheld_bodies_leave_healthz_and_calls_answering() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**ENV, "KPO_SANDBOX_HEADER_TIMEOUT_S": str(SLOW_S)}
    env["KPO_SANDBOX_BODY_TIMEOUT_S"] = str(SLOW_S)
    with subprocess_server(port, env), ExitStack() as stack:
        wait_healthy(url)
        started = time.monotonic()
        flood = [half_sent(port, stack) for _ in range(FLOOD)]
        # The server takes connections in the order they came: these come after the flood's.
        health = httpx.get(f"{url}/healthz", timeout=PROMPT_S)
        assert health.status_code == 200, health.text
        assert_a_call_answers(url)
        answers = [answer(client, PROMPT_S) for client in flood]
        assert answers == [Answer(401, closed=True)] * FLOOD
        assert time.monotonic() - started < SLOW_S  # no timeout of the server's freed a place


def test_authorised_withheld_bodies_are_408_and_leave_the_probes_answering() -> None:
    port, probe_port = free_port(), free_port()
    url, probes = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{probe_port}"
    env = {**ENV, "KPO_SANDBOX_BODY_TIMEOUT_S": str(BODY_DEADLINE_S)}
    env["KPO_SANDBOX_PROBE_PORT"] = str(probe_port)
    with subprocess_server(port, env), ExitStack() as stack:
        wait_healthy(url)
        started = time.monotonic()
        flood = [half_sent(port, stack, headers=list(AUTHORISED.items())) for _ in range(FLOOD)]
        # The call port is full (its own /healthz would be a 503); the probes' port is not.
        health = httpx.get(f"{probes}/healthz", timeout=PROMPT_S)
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        assert httpx.get(f"{probes}/readyz", timeout=PROMPT_S).status_code == 200
        assert httpx.get(f"{probes}/v1/run", timeout=PROMPT_S).status_code == 404
        answers = [answer(client, BODY_DEADLINE_S + PROMPT_S) for client in flood]
        assert answers == [Answer(408, closed=True)] * FLOOD
        assert time.monotonic() - started < BODY_DEADLINE_S + PROMPT_S
        assert_a_call_answers(url)
