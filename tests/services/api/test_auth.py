"""Bearer-token auth on real HTTP: writes always, reads when configured; no placeholder tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.api.settings import ApiSettings
from tests.services.api.conftest import TOKEN, Api, ApiFactory


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
