"""`kpo sandbox serve` answers only the Host names it is reached by, and never redirects.

A web page can point a name of its own at 127.0.0.1 (DNS rebinding) and have the user's browser
call a sandbox server on the user's machine: its requests carry the page's name as their Host.
So the server answers its loopback names (any port), its bind address and
`KPO_SANDBOX_TRUSTED_HOSTS`, and refuses every other Host with a 400 that names the variable; and
a trailing slash is a 404, never a redirect built from the Host header.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from services.tools.server import SandboxSettings
from tests.services.tools.sandbox_server import (
    REPO_ROOT,
    free_port,
    subprocess_server,
    wait_healthy,
)

pytestmark = pytest.mark.timeout(120)

TOKEN = "sandbox-hosts-token-0123456789"
AUTHORISED = {"Authorization": f"Bearer {TOKEN}"}
CALL = {"code": "print(12345*6789)"}


@dataclass
class Urls:
    calls: str
    probes: str


@pytest.fixture(scope="module")
def urls() -> Iterator[Urls]:
    port, probe_port = free_port(), free_port()
    env = {
        "KPO_SANDBOX_BACKEND": "process",
        "KPO_SANDBOX_ALLOW_UNSAFE_PROCESS": "true",
        "KPO_SANDBOX_TOKEN": TOKEN,
        "KPO_SANDBOX_TRUSTED_HOSTS": "sandbox.internal, Sandbox.Example:8090",
        "KPO_SANDBOX_PROBE_PORT": str(probe_port),
    }
    with subprocess_server(port, env):
        urls = Urls(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{probe_port}")
        wait_healthy(urls.calls)  # the probes' port is up with it (one event loop)
        yield urls


@pytest.fixture
def url(urls: Urls) -> str:
    return urls.calls


FORGED = ["evil.example", "evil.example:8090", "127.0.0.1.evil.example", "evil@localhost"]
FORGED += ["localhost/evil", "localhost:8090:1", "", "[::1"]


@pytest.mark.parametrize("host", FORGED)
def test_a_forged_host_is_refused_with_the_variable_named(url: str, host: str) -> None:
    for response in (
        httpx.get(f"{url}/healthz", headers={"Host": host}),
        httpx.post(f"{url}/v1/run", json=CALL, headers={**AUTHORISED, "Host": host}),
    ):
        assert response.status_code == 400, (host, response.status_code)
        assert "KPO_SANDBOX_TRUSTED_HOSTS" in response.json()["detail"]


ANSWERED = ["localhost", "localhost:1234", "127.0.0.1:9", "[::1]:8090", "[::1]"]
ANSWERED += ["[0:0:0:0:0:0:0:1]:80", "sandbox.internal", "SANDBOX.INTERNAL:80", "sandbox.example"]


@pytest.mark.parametrize("host", ANSWERED)
def test_loopback_names_and_trusted_hosts_are_answered(url: str, host: str) -> None:
    assert httpx.get(f"{url}/healthz", headers={"Host": host}).status_code == 200
    response = httpx.post(f"{url}/v1/run", json=CALL, headers={**AUTHORISED, "Host": host})
    assert response.status_code == 200 and response.json()["output"] == "83810205"


def test_the_probes_listener_answers_the_same_names_and_no_other(urls: Urls) -> None:
    for host in ("localhost:1", "sandbox.internal"):
        response = httpx.get(f"{urls.probes}/healthz", headers={"Host": host})
        assert response.status_code == 200, (host, response.status_code)
    for host in FORGED:
        response = httpx.get(f"{urls.probes}/healthz", headers={"Host": host})
        assert response.status_code == 400, (host, response.status_code)
    response = httpx.get(f"{urls.probes}/healthz/", headers={"Host": "localhost"})
    assert response.status_code == 404 and "location" not in response.headers


def test_the_bind_address_is_a_name_and_an_any_address_is_not() -> None:
    settings = SandboxSettings(trusted_hosts="[fd00::1], Kpo-Sandbox.ns.svc")
    names = {"localhost", "127.0.0.1", "::1", "fd00::1", "kpo-sandbox.ns.svc"}
    assert settings.host_names("10.1.2.3") == frozenset(names | {"10.1.2.3"})
    assert settings.host_names("0.0.0.0") == frozenset(names)
    assert settings.host_names("::") == frozenset(names)
    assert settings.host_names(None) == frozenset(names)
    # An IPv6 bind address as a Host header names it (brackets) reads as the address itself.
    assert settings.host_names("FD00::7") == frozenset(names | {"fd00::7"})
    assert settings.host_names("Sandbox.Local") == frozenset(names | {"sandbox.local"})


def test_a_trusted_host_that_is_no_host_name_is_a_clear_error() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KPO_SANDBOX_")}
    env["KPO_SANDBOX_TRUSTED_HOSTS"] = "sandbox.internal, https://evil.example/"
    command = [sys.executable, "-m", "services.cli", "sandbox", "serve", "--port"]
    result = subprocess.run(
        [*command, str(free_port())],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2, result.stderr
    assert "trusted_hosts" in result.stderr and "'https://evil.example/' is not a host name" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("path", ["/healthz/", "/v1/run/"])
def test_a_trailing_slash_is_no_redirect(url: str, path: str) -> None:
    response = httpx.request(
        "GET" if path == "/healthz/" else "POST",
        f"{url}{path}",
        json=None if path == "/healthz/" else CALL,
        headers={**AUTHORISED, "Host": "localhost:1234"},
    )
    assert response.status_code == 404, (path, response.status_code, response.headers)
    assert "location" not in response.headers
