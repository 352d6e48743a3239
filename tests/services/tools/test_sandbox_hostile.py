"""Hostile code against the real bwrap sandbox server over HTTP: each attempt is blocked with
a clear observation, and the server stays healthy and keeps answering other calls."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from services.tools.client import HttpSandbox
from services.tools.sandbox import (
    SandboxLimits,
    SandboxRunner,
    SandboxUnavailable,
    ToolResult,
    observation_text,
)
from tests.services.tools.conftest import TOKEN
from tests.services.tools.sandbox_server import ThreadServer, needs_bwrap

pytestmark = needs_bwrap


def call(server: ThreadServer, code: str) -> ToolResult:
    with HttpSandbox(server.url, TOKEN, timeout_s=1.0, retry_budget_s=5.0) as sandbox:
        return sandbox.run(code)


def assert_still_serving(server: ThreadServer) -> None:
    health = httpx.get(f"{server.url}/healthz", timeout=5.0)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    result = call(server, "print(12345*6789)")
    assert (result.status, result.output) == ("ok", "83810205")


def test_normal_code_and_the_last_line_of_an_error(server: ThreadServer) -> None:
    assert_still_serving(server)
    result = call(server, "print('before')\n1/0")
    assert result.status == "error"
    assert result.output == "before\nZeroDivisionError: division by zero"
    assert observation_text(result) == result.output


def test_no_network_not_even_the_hosts_loopback(server: ThreadServer) -> None:
    # The server itself listens on the host's loopback: from inside, it does not exist.
    code = f"""
import socket
socket.create_connection(("127.0.0.1", {server.port}), timeout=1)
print("connected")
"""
    result = call(server, code)
    assert result.status == "error", result
    assert "connected" not in result.output
    assert "Network is unreachable" in result.output or "refused" in result.output
    result = call(server, "import socket; socket.getaddrinfo('example.com', 80)")
    assert result.status == "error" and "gaierror" in result.output
    assert_still_serving(server)


def test_token_file_run_directory_and_environment_are_invisible(
    server: ThreadServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "runs" / "run-1"
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoint.txt").write_text("weights")
    token_file = tmp_path / "api-token"
    token_file.write_text("s3cr3t-token-value")
    monkeypatch.setenv("KPO_API_TOKEN", "s3cr3t-token-value")
    for code in (
        f"print(open({str(token_file)!r}).read())",
        f"import os; print(os.listdir({str(run_dir)!r}))",
        f"print(open({str(Path.cwd() / 'pyproject.toml')!r}).read())",
        "print(open('/etc/passwd').read())",
    ):
        result = call(server, code)
        assert result.status == "error", (code, result)
        assert result.output.startswith("FileNotFoundError"), (code, result)
        assert "s3cr3t" not in result.output and "weights" not in result.output
    # The environment is empty but for a few essentials: no token travels in it.
    result = call(server, "import os; print(sorted(os.environ))")
    assert result.status == "ok"
    assert "KPO" not in result.output and "TOKEN" not in result.output
    # Nor in another process's environment: the pid namespace holds only the sandbox.
    result = call(server, "import os; print(sorted(p for p in os.listdir('/proc') if p.isdigit()))")
    assert result.status == "ok" and result.output in ("['1', '2']", "['1', '2', '3']")
    assert_still_serving(server)


def test_writes_outside_the_working_directory_fail(server: ThreadServer) -> None:
    for path in ("/usr/evil", "/etc/evil", "/evil", "/dev/evil", "/proc/sys/kernel/evil"):
        result = call(server, f"open({path!r}, 'w').write('x')")
        assert result.status == "error", (path, result)
        assert any(why in result.output for why in ("Read-only", "Permission", "No such")), result
    # The working directory is writable, and fresh for every call.
    assert call(server, "open('mine.txt', 'w').write('x'); print('wrote')").output == "wrote"
    result = call(server, "import os; print(os.path.exists('mine.txt'))")
    assert result.output == "False"
    # A file past the size limit (8 MiB) fails, as does filling the tmpfs with small ones.
    result = call(server, "open('big', 'wb').write(b'x' * (9 * 2**20))")
    assert result.status == "error" and "File too large" in result.output, result
    assert_still_serving(server)


def test_fork_bomb(server: ThreadServer) -> None:
    started = time.monotonic()
    result = call(server, "import os\nwhile True:\n    os.fork()")
    assert result.status in ("error", "timeout"), result
    assert time.monotonic() - started < 5
    # The bombs' tracebacks interleave on stderr, so the last line is some fragment of
    # "BlockingIOError: [Errno 11] Resource temporarily unavailable"; the status is the check.
    assert result.output, result
    assert_still_serving(server)


def test_memory_bomb(server: ThreadServer) -> None:
    result = call(server, "chunks = []\nwhile True:\n    chunks.append(bytearray(2**26))")
    assert (result.status, result.output) == ("error", "MemoryError")
    assert_still_serving(server)


def test_infinite_loop_times_out(server: ThreadServer) -> None:
    result = call(server, "print('start')\nwhile True:\n    pass")
    assert result.status == "timeout"
    assert 1.0 <= result.seconds < 3.0
    assert observation_text(result) == "start\nerror: timeout after 1 s"
    assert_still_serving(server)


def test_100_mb_of_output_is_capped_fast(server: ThreadServer) -> None:
    result = call(server, "import sys\nsys.stdout.write('x' * 100_000_000)")
    assert result.status == "error"
    assert len(result.output) <= 200
    assert result.output.endswith("OutputLimitExceeded: more than 200 characters of output")
    assert result.seconds < 1.0  # stopped at the cap, not after 100 MB
    assert_still_serving(server)


@pytest.mark.parametrize(
    "code",
    [
        "import os; os.kill(os.getppid(), 9); print('alive')",
        "import os; os.kill(1, 9); print('alive')",
        "import os; os.killpg(0, 9)",
        "import os, signal; os.kill(-1, signal.SIGKILL)",
    ],
)
def test_killing_its_parent_or_everything(server: ThreadServer, code: str) -> None:
    result = call(server, code)
    # Only the sandbox's own processes can be reached: it kills itself at most.
    assert result.status in ("ok", "error"), result
    if result.status == "ok":
        assert result.output == "alive"
    else:
        assert "Killed" in result.output or "No such process" in result.output
    assert_still_serving(server)


HOSTILE = [
    "while True: pass",
    "import os\nwhile True:\n    os.fork()",
    "x = []\nwhile True: x.append(bytearray(2**26))",
    "import sys\nsys.stdout.write('y' * 100_000_000)",
    "import os; os.killpg(0, 9)",
]


def test_50_concurrent_hostile_calls(server: ThreadServer) -> None:
    """Capacity is 4 running + 8 queued: the rest are answered 429 with Retry-After at once,
    /healthz answers throughout, and a benign call is right afterwards."""
    answers: list[httpx.Response] = []
    health_during: list[int] = []
    done = threading.Event()

    def hostile(index: int) -> None:
        body = {"code": HOSTILE[index % len(HOSTILE)], "timeout_s": 1.0}
        headers = {"Authorization": f"Bearer {TOKEN}"}
        answers.append(httpx.post(f"{server.url}/v1/run", json=body, headers=headers, timeout=30.0))

    def watch_health() -> None:
        while not done.is_set():
            health_during.append(httpx.get(f"{server.url}/healthz", timeout=5.0).status_code)

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    with ThreadPoolExecutor(50) as pool:
        list(pool.map(hostile, range(50)))
    done.set()
    watcher.join()
    codes = [answer.status_code for answer in answers]
    assert len(codes) == 50 and set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 12  # at least the running and queued ones ran
    assert codes.count(429) >= 1
    assert all(a.headers["retry-after"] == "1" for a in answers if a.status_code == 429)
    statuses = {a.json()["status"] for a in answers if a.status_code == 200}
    assert statuses <= {"error", "timeout"}, statuses
    assert health_during and set(health_during) == {200}
    assert_still_serving(server)
    health = httpx.get(f"{server.url}/healthz", timeout=5.0).json()
    assert health["admitted"] == 0 and health["calls"]["rejected"] >= 1


def test_server_refusals(server: ThreadServer) -> None:
    url = f"{server.url}/v1/run"
    assert httpx.post(url, json={"code": "print(1)"}).status_code == 401
    headers = {"Authorization": f"Bearer {TOKEN}"}
    big = httpx.post(url, json={"code": "#" * 100_000}, headers=headers)
    assert big.status_code == 413
    too_long = httpx.post(url, json={"code": "1", "timeout_s": 1e6}, headers=headers)
    assert too_long.status_code == 422
    with HttpSandbox(server.url, "wrong-token", retry_budget_s=1.0) as sandbox:
        result = sandbox.run("print(1)")
    assert result.status == "refused" and observation_text(result).startswith("error: refused")
    assert httpx.get(f"{server.url}/healthz").status_code == 200  # no token needed for probes


def test_process_backend_refuses_unless_allowed(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(SandboxUnavailable, match="allow_unsafe_process"):
        SandboxRunner("process", SandboxLimits())
    with caplog.at_level(logging.WARNING):
        runner = SandboxRunner(
            "process", SandboxLimits(timeout_s=1.0), allow_unsafe_process=True, slots=1
        )
    assert "NO namespaces" in caplog.text
    assert runner.run("print(12345*6789)").output == "83810205"
    assert runner.run("while True: pass").status == "timeout"
    assert runner.run("x = bytearray(2**31)").output == "MemoryError"
