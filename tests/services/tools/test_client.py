"""The clients: retries and their bound, refusals, never raising; local calls under the one
call pool."""

from __future__ import annotations

import time

import httpx

from services.tools.calls import ToolCall
from services.tools.client import HttpSandbox, LocalSandbox
from services.tools.rollout import ToolCalls
from services.tools.sandbox import SandboxLimits, ToolResult, observation_text
from tests.services.tools.conftest import TOKEN
from tests.services.tools.sandbox_server import ThreadServer, free_port, needs_bwrap


def scripted(*answers: httpx.Response | Exception) -> tuple[httpx.MockTransport, list[int]]:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        answer = answers[min(len(calls), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    return httpx.MockTransport(handler), calls


OK = httpx.Response(200, json={"output": "7", "status": "ok", "seconds": 0.01})


def test_busy_and_dropped_connections_are_retried_into_one_result() -> None:
    transport, calls = scripted(
        httpx.Response(429, headers={"Retry-After": "0"}),
        httpx.ConnectError("refused"),
        httpx.RemoteProtocolError("server died mid-call"),
        OK,
    )
    with HttpSandbox("http://sandbox:8090", transport=transport) as sandbox:
        result = sandbox.run("print(7)")
    assert (result.status, result.output) == ("ok", "7")
    assert len(calls) == 4 and sandbox.retries == 3
    assert sandbox.counts == {"ok": 1}


def test_unreachable_server_is_one_unavailable_result_within_the_budget() -> None:
    with HttpSandbox(f"http://127.0.0.1:{free_port()}", retry_budget_s=0.5) as sandbox:
        started = time.monotonic()
        result = sandbox.run("print(1)")
    assert result.status == "unavailable"
    assert time.monotonic() - started < 2.0
    assert observation_text(result) == "error: sandbox unavailable"
    assert sandbox.counts == {"unavailable": 1}


def test_refusals_and_server_errors_are_not_retried() -> None:
    for answer, status in (
        (httpx.Response(422, json={"detail": "bad"}), "refused"),
        (httpx.Response(413, json={"detail": "too big"}), "refused"),
        (httpx.Response(500), "unavailable"),
    ):
        transport, calls = scripted(answer)
        with HttpSandbox("http://sandbox:8090", transport=transport) as sandbox:
            assert sandbox.run("x").status == status
        assert len(calls) == 1


def test_a_garbled_answer_never_raises() -> None:
    transport, _ = scripted(httpx.Response(200, text="not json"))
    with HttpSandbox("http://sandbox:8090", transport=transport) as sandbox:
        assert sandbox.run("x").status == "unavailable"


def test_timeout_observation() -> None:
    result = ToolResult("", "timeout", 5.02, timeout_s=5.0)
    assert observation_text(result) == "error: timeout after 5 s"


@needs_bwrap
def test_http_sandbox_against_the_real_server(server: ThreadServer) -> None:
    with HttpSandbox(server.url, TOKEN, timeout_s=1.0) as sandbox:
        assert sandbox.run("print(12345*6789)").output == "83810205"
        assert sandbox.run("while True: pass").status == "timeout"
    assert sandbox.counts == {"ok": 1, "timeout": 1}


@needs_bwrap
def test_local_calls_run_concurrently_bounded_by_the_one_call_pool() -> None:
    limits = SandboxLimits(timeout_s=5.0)
    with LocalSandbox(limits=limits, max_concurrency=2) as sandbox:
        calls = ToolCalls(sandbox, max_concurrent=2, max_output_chars=100)
        # Four 0.5 s calls on 2 threads: two rounds, so ~1 s rather than ~2 s or ~0.5 s.
        started = time.monotonic()
        futures = [
            calls.submit(ToolCall(code=f"import time; time.sleep(0.5); print({i})", text=""))
            for i in range(4)
        ]
        outputs = [future.result().output for future in futures]
        elapsed = time.monotonic() - started
        calls.close()
        assert outputs == ["0", "1", "2", "3"]
        assert 1.0 <= elapsed < 1.9
        assert sandbox.run("1/0").output == "ZeroDivisionError: division by zero"
    assert sandbox.counts == {"ok": 4, "error": 1}
