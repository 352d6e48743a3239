"""Schemathesis against the live server's own OpenAPI document: no input may produce a 5xx.

The real `schemathesis run` command drives a real uvicorn server. Every operation but the event
stream is fuzzed (a stream of a run that never finishes stays open by design); the stream's
error paths are covered in test_runs_api.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from services.api.app import create_app
from services.api.settings import ApiSettings
from services.store import LocalStore
from tests.services.api.launchers import RecordingLauncher
from tests.services.api.server import serve

CASES_PER_OPERATION = 40


def test_no_input_makes_the_server_fail(tmp_path: Path) -> None:
    settings = ApiSettings.model_validate({"KPO_DATA_DIR": str(tmp_path)})
    app = create_app(settings, LocalStore(tmp_path / "store"), RecordingLauncher())
    schemathesis = Path(sys.executable).parent / "schemathesis"
    with serve(app) as url:
        result = subprocess.run(
            [
                str(schemathesis),
                "run",
                f"{url}/openapi.json",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                str(CASES_PER_OPERATION),
                "--exclude-path-regex",
                "/events$",
                "--seed",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            cwd=tmp_path,  # where it keeps its example database
        )
    assert result.returncode == 0, result.stdout[-4000:]
    # The run really exercised the API, and every case it generated passed.
    counts = re.search(r"(\d+) generated, (\d+) passed", result.stdout)
    assert counts is not None, result.stdout[-2000:]
    generated, passed = map(int, counts.groups())
    assert generated >= 500 and passed == generated
