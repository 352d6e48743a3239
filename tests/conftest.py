"""Fixtures every test tree may use: the random tiny model on disk.

Here rather than in tests/services/conftest.py because tests/gpu needs it too, on a bare CUDA
machine where the service fixtures' imports (Ray, Redis) are not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen2 (`tests/services/generation/tiny_model.py`), saved once per session."""
    # Imported here: every test run loads this file, and most never need transformers.
    from tests.services.generation.tiny_model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))
