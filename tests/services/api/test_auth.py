"""Bearer-token auth on real HTTP: writes always, reads unless opened; no placeholder tokens; no
token in any log; the Host names a server answers (DNS rebinding); no OpenAPI pages unless asked."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from services.api.app import create_app
from services.api.client import ApiClient, ApiError
from services.api.settings import ApiSettings, ClientSettings
from services.store import LocalStore
from tests.services.api.conftest import TOKEN, Api, ApiFactory
from tests.services.api.launchers import RecordingLauncher
from tests.services.api.server import serve


def test_writes_need_the_token_and_say_how(secured: Api) -> None:
    response = secured.client.post("/v1/runs", json={})
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert "Authorization: Bearer" in response.json()["error"]["message"]
    wrong = secured.client.post("/v1/runs", json={}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    basic = secured.client.post("/v1/runs", json={}, headers={"Authorization": f"Basic {TOKEN}"})
    assert basic.status_code == 401
    run = secured.admin.post("/v1/runs", json={})
    assert run.status_code == 201
    cancel = secured.client.post(f"/v1/runs/{run.json()['id']}/cancel")
    assert cancel.status_code == 401
    assert secured.launcher.submitted == [run.json()["id"]]  # nothing else got through


# Bodies that, with the token, are a 400, 422, 415 or 413: each says what the API would accept.
UNREAD_BODIES = [
    (b"{not json", "application/json"),  # 422: where it stops being JSON
    ("[" * 5000 + "]" * 5000, "application/json"),  # 400: nested too deeply
    (b"\xff\xfe", "application/json"),  # 400: not UTF-8
    (b'{"model": 5}', "application/json"),  # 422: names the field
    (b"model: tiny", "text/yaml"),  # 415
    (b"x" * 300_000, "application/json"),  # 413
]


@pytest.mark.parametrize(("body", "content_type"), UNREAD_BODIES)
def test_the_token_is_checked_before_the_body_is_read(
    secured: Api, body: bytes | str, content_type: str
) -> None:
    response = secured.client.post("/v1/runs", content=body, headers={"Content-Type": content_type})
    assert response.status_code == 401, response.text
    assert response.json()["error"]["type"] == "unauthorized"
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert secured.store.list_runs(None, 10, None)[0] == []


# Every read of run data: specs, metrics, logs, events, and the Prometheus export.
READS = [
    "/v1/runs",
    "/v1/runs/{run}",
    "/v1/runs/{run}/metrics",
    "/v1/runs/{run}/logs",
    "/v1/runs/{run}/events",
    "/metrics",
]


def test_reads_need_the_token_by_default(secured: Api) -> None:
    run = secured.admin.post("/v1/runs", json={}).json()["id"]
    secured.store.transition(run, "cancelled")  # a finished run's event stream ends
    for path in READS:
        url = path.format(run=run)
        refused = secured.client.get(url)
        assert refused.status_code == 401, url
        assert refused.headers["www-authenticate"].startswith("Bearer")
        assert secured.admin.get(url).status_code == 200, url
    # The dashboard's page and files load (the page asks for the token); probes stay open.
    for path in ("/", "/static/dashboard.js", "/healthz", "/readyz"):
        assert secured.client.get(path).status_code == 200, path


def test_reads_are_open_with_auth_reads_off(api_factory: ApiFactory) -> None:
    with api_factory(KPO_API_TOKEN=TOKEN, KPO_AUTH_READS="false") as api:
        assert api.client.get("/v1/runs").status_code == 200
        assert api.client.get("/metrics").status_code == 200
        assert api.client.post("/v1/runs", json={}).status_code == 401


# --- Host names (DNS rebinding) -------------------------------------------------------------


def test_a_server_without_a_token_answers_only_its_loopback_names(api: Api) -> None:
    # A page of evil.example that re-points its name at 127.0.0.1 sends that name as Host.
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.x"):
        response = api.client.get("/v1/runs", headers={"Host": host})
        assert response.status_code == 400, host
    for path in ("/", "/healthz", "/v1/runs", "/metrics"):
        assert api.client.get(path, headers={"Host": "evil.example"}).status_code == 400
    for host in ("localhost", "LOCALHOST:8000", "127.0.0.1", "127.0.0.1:8000", "[::1]:8000"):
        assert api.client.get("/v1/runs", headers={"Host": host}).status_code == 200, host


def test_a_server_with_a_token_answers_any_host_or_the_ones_listed(
    secured: Api, api_factory: ApiFactory
) -> None:
    # The token is what guards it: a rebinding page has none.
    response = secured.admin.get("/v1/runs", headers={"Host": "kpo.example.com"})
    assert response.status_code == 200
    listed = {"KPO_API_TOKEN": TOKEN, "KPO_ALLOWED_HOSTS": "kpo.example.com, *.kpo.internal"}
    with api_factory(**listed) as api:
        for host, code in [
            ("kpo.example.com", 200),
            ("api.kpo.internal:8000", 200),
            ("localhost", 400),
            ("evil.example", 400),
        ]:
            assert api.admin.get("/v1/runs", headers={"Host": host}).status_code == code, host


def test_any_host_needs_a_token_and_the_bind_address_is_answered(tmp_path: Path) -> None:
    settings = ApiSettings.model_validate({"KPO_ALLOWED_HOSTS": "*"})
    with pytest.raises(ValueError, match=r"KPO_ALLOWED_HOSTS=\* needs an API token"):
        create_app(settings, LocalStore(tmp_path / "store"), RecordingLauncher())
    defaults = ApiSettings.model_validate({})
    assert defaults.trusted_hosts(False, "127.0.0.1") == ["localhost", "127.0.0.1", "[::1]"]
    assert defaults.trusted_hosts(False, "10.1.2.3")[-1] == "10.1.2.3"  # --insecure
    assert defaults.trusted_hosts(False, "fd00::7")[-1] == "[fd00::7]"
    assert "0.0.0.0" not in defaults.trusted_hosts(False, "0.0.0.0")  # no client sends it
    assert defaults.trusted_hosts(True, "0.0.0.0") == ["*"]


def test_openapi_pages_are_served_only_when_asked_for(api_factory: ApiFactory) -> None:
    pages = ("/docs", "/redoc", "/openapi.json")
    with api_factory() as api:
        for path in pages:
            assert api.client.get(path).status_code == 404, path
    with api_factory(KPO_OPENAPI_DOCS="true") as api:
        for path in pages:
            assert api.client.get(path).status_code == 200, path


def test_token_from_a_file_and_placeholders_refused(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert ApiSettings.model_validate({"KPO_API_TOKEN_FILE": str(path)}).token() == TOKEN
    for bad in ("changeme", "short"):
        with pytest.raises(ValueError, match="real secret"):
            ApiSettings.model_validate({"KPO_API_TOKEN": bad}).token()
    with pytest.raises(ValueError, match="not both"):
        ApiSettings.model_validate({"KPO_API_TOKEN": TOKEN, "KPO_API_TOKEN_FILE": str(path)})


def test_a_client_sends_the_variables_token_else_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    monkeypatch.delenv("KPO_API_TOKEN", raising=False)
    monkeypatch.delenv("KPO_API_TOKEN_FILE", raising=False)
    assert ClientSettings().token() is None
    monkeypatch.setenv("KPO_API_TOKEN_FILE", str(path))
    assert ClientSettings().token() == TOKEN
    monkeypatch.setenv("KPO_API_TOKEN", "")  # empty: unset, the file's token goes
    assert ClientSettings().token() == TOKEN
    monkeypatch.setenv("KPO_API_TOKEN", "other")  # the variable wins; the server judges it
    assert ClientSettings().token() == "other"
    monkeypatch.delenv("KPO_API_TOKEN")
    monkeypatch.setenv("KPO_API_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(OSError):
        ClientSettings().token()


class Recorder(logging.Handler):
    """Keeps every record it is handed, formatted with its traceback if it has one."""

    def __init__(self) -> None:
        super().__init__(level=1)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@contextmanager
def everything_logged() -> Iterator[Recorder]:
    """Every logger at its lowest level (below DEBUG, so uvicorn's TRACE too), all recorded."""
    recorder = Recorder()
    loggers = [logging.getLogger(), *map(logging.getLogger, list(logging.root.manager.loggerDict))]
    levels = [(logger, logger.level) for logger in loggers]
    # The root sees what propagates; loggers that do not propagate (uvicorn's) get the recorder.
    handled = [
        logger for logger in loggers if logger is logging.getLogger() or not logger.propagate
    ]
    for logger in loggers:
        logger.setLevel(1)
    for logger in handled:
        logger.addHandler(recorder)
    try:
        yield recorder
    finally:
        for logger in handled:
            logger.removeHandler(recorder)
        for logger, level in levels:
            logger.setLevel(level)


def test_tokens_are_never_logged(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    env = {"KPO_DATA_DIR": str(tmp_path), "KPO_API_TOKEN": TOKEN, "KPO_AUTH_READS": "true"}
    app = create_app(
        ApiSettings.model_validate(env), LocalStore(tmp_path / "store"), RecordingLauncher()
    )
    wrong = "wrong-token-" + "9" * 24
    body = {"name": "t", "pipeline": {"steps": 3}, "generation": {"group_size": 4}}
    # uvicorn at "trace": its access log and its log of every ASGI message are on.
    with serve(app, log_level="trace") as url, everything_logged() as recorder:
        with ApiClient(url, TOKEN) as good, ApiClient(url, wrong) as bad:
            run = good.create_run(body)["id"]
            good.get_run(run)
            good.list_runs()
            good.cancel_run(run)
            with pytest.raises(ApiError, match="HTTP 401"):
                bad.create_run(body)
            with pytest.raises(ApiError, match="HTTP 401"):
                bad.get_run(run)
        with httpx.Client(base_url=url) as client:
            for scheme, token in (("Basic", TOKEN), ("Bearer", wrong), ("Bearer", TOKEN + "x")):
                response = client.get("/v1/runs", headers={"Authorization": f"{scheme} {token}"})
                assert response.status_code == 401
            broken = client.post(
                "/v1/runs",
                content=b"{broken",
                headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            )
            assert broken.status_code == 422
    captured = capfd.readouterr()
    logged = "\n".join([*recorder.lines, captured.out, captured.err])
    # The capture really saw the server's and the client's logs, at every level...
    assert f'"POST /v1/runs/{run}/cancel HTTP/1.1" 202' in logged  # uvicorn's access log
    assert "ASGI [" in logged  # uvicorn's trace of each request
    assert "HTTP Request: GET" in logged  # httpx, on the client side
    assert any(" DEBUG " in line for line in recorder.lines)
    # ...and neither token is anywhere in it.
    assert TOKEN not in logged and wrong not in logged


def test_settings_errors_do_not_echo_the_token(tmp_path: Path) -> None:
    # `kpo serve` prints a settings error as it is: its input values must not be in it.
    path = tmp_path / "token"
    path.write_text(TOKEN)
    for env in (
        {"KPO_API_TOKEN": TOKEN, "KPO_API_TOKEN_FILE": str(path)},
        {"KPO_API_TOKEN": TOKEN, "KPO_MAX_BODY_BYTES": "-1"},
    ):
        with pytest.raises(ValidationError) as raised:
            ApiSettings.model_validate(env)
        message = str(raised.value)
        # pydantic would show a shortened input, so even the token's start must be absent.
        assert "input_value" not in message and TOKEN[:5] not in message, message
