"""The launcher's interface is importable without Ray: the API depends on it, not on Ray."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from services.jobs.interface import RunLauncher
from services.jobs.launcher import RayJobLauncher
from tests.services.api.launchers import RecordingLauncher

METHODS = ("submit", "stop", "ready", "close")


def test_importing_the_interface_does_not_import_ray() -> None:
    code = "import sys, services.jobs.interface; print('ray' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.parametrize("launcher_type", [RayJobLauncher, RecordingLauncher])
def test_the_launchers_have_the_interfaces_methods(launcher_type: type) -> None:
    """The Ray launcher and the API tests' double take what the API passes (mypy checks the
    Ray launcher against the Protocol where `kpo serve` hands it to `create_app`)."""
    assert [name for name in vars(RunLauncher) if name in METHODS] == list(METHODS)
    for name in METHODS:
        expected = list(inspect.signature(getattr(RunLauncher, name)).parameters)
        assert list(inspect.signature(getattr(launcher_type, name)).parameters) == expected
