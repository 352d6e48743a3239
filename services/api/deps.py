"""Request dependencies, in one place: the settings, the store, the launcher, the inputs folder
and the auth checks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from services.api.auth import BearerAuth
from services.api.settings import ApiSettings
from services.jobs.interface import RunLauncher
from services.store import Store


def get_settings(request: Request) -> ApiSettings:
    settings: ApiSettings = request.app.state.settings
    return settings


def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def get_launcher(request: Request) -> RunLauncher:
    launcher: RunLauncher = request.app.state.launcher
    return launcher


def get_inputs_dir(request: Request) -> Path:
    inputs: Path = request.app.state.inputs_dir
    return inputs


def require_read(request: Request) -> None:
    auth: BearerAuth = request.app.state.auth
    auth.check(request, write=False)


def require_write(request: Request) -> None:
    auth: BearerAuth = request.app.state.auth
    auth.check(request, write=True)


SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
LauncherDep = Annotated[RunLauncher, Depends(get_launcher)]
InputsDirDep = Annotated[Path, Depends(get_inputs_dir)]
ReadAccess = Depends(require_read)
WriteAccess = Depends(require_write)
