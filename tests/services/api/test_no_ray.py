"""The API is HTTP only: none of its modules imports Ray (launching runs is services.jobs's)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import services.api


def test_importing_the_api_does_not_import_ray() -> None:
    modules = sorted(
        f"services.api.{info.name}" for info in pkgutil.iter_modules(services.api.__path__)
    )
    assert "services.api.app" in modules
    code = f"import sys; import {', '.join(modules)}; print('ray' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "False", result.stderr
