"""Fixtures of the generation tests: the tiny model on disk, HF backends, a Ray instance."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch

from services.generation.hf_backend import HFBackend
from tests.services.generation.tiny_model import save_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[3]


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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding the tiny model, written once per session with `save_pretrained`."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def hf_backend(tiny_model_dir: Path) -> HFBackend:
    """An HF backend shared by a module's read-only tests (never load weights into it)."""
    return HFBackend(tiny_model_dir)


@pytest.fixture
def fresh_hf_backend(tiny_model_dir: Path) -> HFBackend:
    """An HF backend of its own, for tests that load weights."""
    return HFBackend(tiny_model_dir)


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    """A local Ray instance for one module; reuses one that is already running."""
    if ray.is_initialized():
        yield
        return
    # The repository is not installed into the environment, so worker processes are told where
    # the `services` package lives.
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": python_path}},
    )
    try:
        yield
    finally:
        ray.shutdown()
