"""The API app for bench_api's server process: the store from KPO_STORE_URL, no launching.

Served by `uvicorn --factory _api_server:app` in its own process, so that the load generator
and the server do not share one interpreter.
"""

from __future__ import annotations

from fastapi import FastAPI

from services.api.app import create_app
from services.api.settings import ApiSettings
from services.store import open_store
from tests.services.api.launchers import RecordingLauncher


def app() -> FastAPI:
    settings = ApiSettings()
    return create_app(
        settings, open_store(settings.store_url, settings.data_dir), RecordingLauncher()
    )
