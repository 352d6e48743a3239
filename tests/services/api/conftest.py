"""Fixtures of the API tests: the real app under a real uvicorn server, over a real store."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.api.app import create_app
from services.api.settings import ApiSettings
from services.store import LocalStore, Store
from tests.services.api.launchers import RecordingLauncher
from tests.services.api.server import serve

TOKEN = "test-token-0123456789abcdef"


@dataclass
class Api:
    url: str
    store: Store
    launcher: RecordingLauncher
    client: httpx.Client  # no credentials
    admin: httpx.Client  # sends the token (when one is configured)


ApiFactory = Callable[..., AbstractContextManager[Api]]


@pytest.fixture
def api_factory(tmp_path: Path) -> ApiFactory:
    """Start an API with the given settings (`KPO_*` names), over a local store in tmp_path."""

    @contextmanager
    def start(store: Store | None = None, **env: Any) -> Iterator[Api]:
        settings = ApiSettings.model_validate({"KPO_DATA_DIR": str(tmp_path), **env})
        store = store or LocalStore(tmp_path / "store")
        launcher = RecordingLauncher()
        app = create_app(settings, store, launcher)
        with serve(app) as url:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            with (
                httpx.Client(base_url=url, timeout=30) as client,
                httpx.Client(base_url=url, timeout=30, headers=headers) as admin,
            ):
                yield Api(url, store, launcher, client, admin)

    return start


@pytest.fixture
def api(api_factory: ApiFactory) -> Iterator[Api]:
    """An API without auth (a loopback development server)."""
    with api_factory() as running:
        yield running


@pytest.fixture
def secured(api_factory: ApiFactory) -> Iterator[Api]:
    """An API that needs the token for writes."""
    with api_factory(KPO_API_TOKEN=TOKEN) as running:
        yield running
