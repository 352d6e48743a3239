"""Fixtures of the generation tests: the tiny model on disk, HF backends, a Ray instance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.generation.hf_backend import HFBackend


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run these tests with one torch thread, restoring the setting afterwards.

    The tiny model gains nothing from more threads, and on a shared CPU box they spin against
    other processes (measured ten times slower with two threads on two busy cores).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def hf_backend(tiny_model_dir: Path) -> HFBackend:
    """An HF backend shared by a module's read-only tests (never load weights into it)."""
    return HFBackend(tiny_model_dir)


@pytest.fixture
def fresh_hf_backend(tiny_model_dir: Path) -> HFBackend:
    """An HF backend of its own, for tests that load weights."""
    return HFBackend(tiny_model_dir)


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level model fitted to call the Python tool (`tool_model.py`), once per
    session (a few seconds of CPU)."""
    from tests.services.generation.tool_model import save_tool_model

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return save_tool_model(tmp_path_factory.mktemp("tool-model"))
    finally:
        torch.set_num_threads(previous)
