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

# Per operation and phase; with 9 operations this makes well over MIN_CASES in all (about 3,400
# in under a minute on two cores).
CASES_PER_OPERATION = 250
MIN_CASES = 2000


def test_no_input_makes_the_server_fail(tmp_path: Path) -> None:
    # The schema is off by default (KPO_OPENAPI_DOCS); the fuzzer reads it from the server.
    settings = ApiSettings.model_validate({"KPO_DATA_DIR": str(tmp_path), "KPO_OPENAPI_DOCS": True})
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
                "--generation-database",
                "none",  # every run generates afresh: no cases replayed from an earlier one
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            cwd=tmp_path,
        )
    assert result.returncode == 0, result.stdout[-4000:]
    generated, passed = cases_run(result.stdout)
    # The run really exercised the API that much, and every case it generated passed.
    assert generated >= MIN_CASES, result.stdout[-2000:]
    assert passed == generated, result.stdout[-4000:]


def cases_run(summary: str) -> tuple[int, int]:
    """(generated, passed) from the "Test cases:" section of schemathesis' summary."""
    section = re.search(r"^Test cases:\n\s+(.+)$", summary, re.MULTILINE)
    assert section is not None, summary[-2000:]
    pairs = re.findall(r"(\d+) (\w+)", section.group(1))
    counts = {kind: int(number) for number, kind in pairs}
    assert "generated" in counts, section.group(0)
    return counts["generated"], counts.get("passed", 0)
