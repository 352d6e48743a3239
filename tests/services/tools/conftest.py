from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.tools.server import SandboxSettings
from tests.services.tools.sandbox_server import _PROBLEM, ThreadServer

TOKEN = "sandbox-test-token-0123456789"


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadServer]:
    """A bwrap sandbox server over HTTP: 4 workers, 8 queue places, 1 s calls."""
    if _PROBLEM is not None:
        pytest.skip(_PROBLEM)
    settings = SandboxSettings(
        backend="bwrap",
        max_concurrency=4,
        max_queue=8,
        timeout_s=1.0,
        memory_mb=512,
        nproc=32,
        file_mb=8,
        max_output_chars=200,
        max_body_bytes=64 * 1024,
        token=TOKEN,
    )
    with ThreadServer(settings) as running:
        yield running
