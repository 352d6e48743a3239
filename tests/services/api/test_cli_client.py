"""The `kpo` client commands against a real `kpo serve` (a subprocess on a free loopback port),
which reuses the module's local Ray head and keeps runs in the embedded store.

`kpo submit --follow` is followed to success and to a cancel; errors (a bad file, an unknown
run, a cancel of a finished run, a wrong token, no server) print one line and no traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner, Result

from services.api.listeners import ControlPlaneServer
from services.cli import app
from services.jobs import launcher, reconciler
from services.jobs.ray_head import LocalRayHead, free_port
from tests.services.api.launchers import RecordingLauncher
from tests.services.jobs.ray_support import local_head, wait_until
from tests.services.pipeline.conftest import TINY_RUN

pytestmark = pytest.mark.timeout(300)

TOKEN = "cli-token-0123456789abcdef"
REPO_ROOT = Path(__file__).resolve().parents[3]
runner = CliRunner()


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    with local_head(tmp_path_factory.mktemp("kpo-data")) as started:
        yield started


def client_env(**extra: str) -> dict[str, str]:
    """Environment of a `kpo` client process."""
    env = {**os.environ, "KPO_API_TOKEN": TOKEN, "PYTHONPATH": str(REPO_ROOT), **extra}
    env.pop("KPO_SERVER", None)
    return env


@pytest.fixture(scope="module")
def server(head: LocalRayHead) -> Iterator[str]:
    """`kpo serve` in a process of its own, on the module's head (found in its data dir)."""
    port = free_port()
    env = client_env(KPO_DATA_DIR=str(head.data_dir))
    for name in ("KPO_STORE_URL", "RAY_ADDRESS", "KPO_API_TOKEN_FILE"):
        env.pop(name, None)
    log_path = head.data_dir / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, log_path.read_text()
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, 60, "kpo serve to answer")
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0, log_path.read_text()


@pytest.fixture
def run_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(TINY_RUN))
    return path


def kpo(*args: str, token: str | None = TOKEN) -> Result:
    """`kpo ARGS` in this process, as a user with `token` in KPO_API_TOKEN."""
    env: dict[str, str | None] = {"KPO_API_TOKEN": token, "KPO_API_TOKEN_FILE": None}
    return runner.invoke(app, list(args), env=env)


def assert_clean_error(result: Result, code: int, *fragments: str) -> None:
    assert result.exit_code == code, result.output
    assert result.output.startswith("error: ")
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.output


def test_submit_follow_prints_progress_until_success(server: str, run_file: Path) -> None:
    result = kpo(
        "submit", str(run_file), "--set", "pipeline.steps=2", "--server", server, "--follow"
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    run_id = lines[0]
    assert run_id.startswith("run-")
    assert lines[1:3] == ["[kpo] run queued", "[kpo] run running"]
    assert lines[3].startswith("step 1/2  reward ") and lines[4].startswith("step 2/2  reward ")
    assert lines[5:] == ["[kpo] run succeeded"]

    listed = kpo("runs", "--server", server, "--status", "succeeded")
    assert listed.exit_code == 0 and run_id in listed.output and "tiny" in listed.output
    shown = kpo("status", run_id, "--server", server)
    assert shown.exit_code == 0
    assert [line.split()[0] for line in shown.output.splitlines()[1:]] == [
        "queued",
        "running",
        "succeeded",
    ]

    # A finished run cannot be cancelled: the API's 409, said in one line.
    assert_clean_error(
        kpo("cancel", run_id, "--server", server), 2, f"run '{run_id}' is succeeded", "HTTP 409"
    )


def test_follow_exits_130_when_the_run_is_cancelled(server: str, run_file: Path) -> None:
    command = [sys.executable, "-m", "services.cli", "submit", str(run_file), "--server", server]
    command += ["--set", "pipeline.steps=300", "--set", "pipeline.checkpoint_every=0", "--follow"]
    follower = subprocess.Popen(
        command,
        env=client_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert follower.stdout is not None
        run_id = follower.stdout.readline().strip()
        assert run_id.startswith("run-"), run_id
        for line in follower.stdout:
            if line.startswith("step "):
                break
        cancelled = kpo("cancel", run_id, "--server", server)
        assert cancelled.exit_code == 0, cancelled.output
        assert "cancel requested" in cancelled.output
        rest = follower.stdout.read()
        assert follower.wait(timeout=120) == 130, rest
        assert rest.rstrip().endswith("[kpo] run cancelled")
    finally:
        if follower.poll() is None:
            follower.kill()


def test_errors_are_one_line_without_a_traceback(server: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("generation:\n  group_size: 1\n")
    assert_clean_error(
        kpo("submit", str(bad), "--server", server), 2, f"{bad}: generation.group_size"
    )
    assert_clean_error(
        kpo("submit", str(tmp_path / "none.yaml"), "--server", server), 2, "no such file"
    )
    assert_clean_error(
        kpo("status", "run-000000000000", "--server", server),
        2,
        "no run with id 'run-000000000000'",
        "HTTP 404",
    )
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(TINY_RUN))
    assert_clean_error(
        kpo("submit", str(good), "--server", server, token="wrong-token-0123456789"),
        2,
        "missing or wrong API token",
        "HTTP 401",
    )
    nowhere = f"http://127.0.0.1:{free_port()}"
    assert_clean_error(
        kpo("runs", "--server", nowhere), 1, f"cannot reach the KPO server at {nowhere}"
    )


def test_serve_refuses_a_public_address_without_a_token() -> None:
    result = kpo("serve", "--host", "0.0.0.0", token=None)
    assert_clean_error(result, 2, "refusing to serve on 0.0.0.0 without an API token", "--insecure")


def test_serve_refuses_any_host_without_a_token_and_one_port_for_both() -> None:
    result = runner.invoke(app, ["serve"], env={"KPO_API_TOKEN": None, "KPO_ALLOWED_HOSTS": "*"})
    assert_clean_error(result, 2, "KPO_ALLOWED_HOSTS=* needs an API token")
    same = kpo("serve", "--port", "8123", "--metrics-port", "8123")
    assert_clean_error(same, 2, "the metrics port must differ from the API's (8123)")
    probes = runner.invoke(app, ["serve", "--port", "8123"], env={"KPO_PROBE_PORT": "8123"})
    assert_clean_error(probes, 2, "the probe port (8123) must differ from the API's")
    proxies = runner.invoke(app, ["serve"], env={"KPO_TRUSTED_PROXIES": "10.0.0.0/8,ingress"})
    assert_clean_error(proxies, 2, "KPO_TRUSTED_PROXIES: 'ingress' is not an IP address")


class IdleReconciler:
    def __init__(self, *args: object) -> None:
        pass

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_serve_bounds_uvicorn_and_serves_metrics_on_their_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kpo serve` as far as its servers (Ray's side replaced): the limits of the API's
    listener, the probe port, the metrics server it runs meanwhile on KPO_METRICS_PORT, and the
    API without /metrics."""
    seen: dict[str, Any] = {}
    metrics_port, probe_port = free_port(), free_port()

    def run(server: ControlPlaneServer) -> None:
        config = server.api.config
        seen.update(limit=config.limit_concurrency, port=server.port, probes=server.probe_port)
        seen["proxy_headers"] = config.proxy_headers
        with TestClient(
            server.api.config.app, headers={"Authorization": f"Bearer {TOKEN}"}
        ) as client:
            seen["api"] = {path: client.get(path).status_code for path in ("/metrics", "/v1/runs")}
        seen["scrape"] = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").status_code

    monkeypatch.setattr(ControlPlaneServer, "run", run)
    monkeypatch.setattr(launcher, "launcher_from_env", lambda *a, **k: RecordingLauncher())
    monkeypatch.setattr(reconciler, "Reconciler", IdleReconciler)
    api_port = free_port()
    env = {
        "KPO_API_TOKEN": TOKEN,
        "KPO_API_TOKEN_FILE": None,
        "KPO_DATA_DIR": str(tmp_path),
        "KPO_STORE_URL": None,
        "KPO_METRICS_PORT": str(metrics_port),
        "KPO_PROBE_PORT": str(probe_port),
        "KPO_MAX_CONCURRENCY": "300",
    }
    result = runner.invoke(app, ["serve", "--port", str(api_port)], env=env)
    assert result.exit_code == 0, result.output
    assert seen["limit"] == 300 and seen["port"] == api_port and seen["probes"] == probe_port
    assert seen["proxy_headers"] is False  # X-Forwarded-For is read from trusted proxies only
    assert seen["api"] == {"/metrics": 404, "/v1/runs": 200}
    assert seen["scrape"] == 200
    with pytest.raises(httpx.ConnectError):  # closed with the server
        httpx.get(f"http://127.0.0.1:{metrics_port}/metrics")
