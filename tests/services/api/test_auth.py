"""Bearer-token auth on real HTTP: writes always, reads when configured; no placeholder tokens;
no token in any log."""

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
from services.api.settings import ApiSettings
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
    assert secured.client.get("/v1/runs").status_code == 200  # reads are open by default


def test_reads_need_the_token_when_configured(api_factory: ApiFactory) -> None:
    with api_factory(KPO_API_TOKEN=TOKEN, KPO_AUTH_READS="true") as api:
        assert api.client.get("/v1/runs").status_code == 401
        assert api.admin.get("/v1/runs").status_code == 200
        assert api.client.get("/healthz").status_code == 200  # probes stay open


def test_token_from_a_file_and_placeholders_refused(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert ApiSettings.model_validate({"KPO_API_TOKEN_FILE": str(path)}).token() == TOKEN
    for bad in ("changeme", "short"):
        with pytest.raises(ValueError, match="real secret"):
            ApiSettings.model_validate({"KPO_API_TOKEN": bad}).token()
    with pytest.raises(ValueError, match="not both"):
        ApiSettings.model_validate({"KPO_API_TOKEN": TOKEN, "KPO_API_TOKEN_FILE": str(path)})


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
