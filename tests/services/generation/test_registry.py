"""The backend registry: names, lazy imports, errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.generation import registry
from services.generation.hf_backend import HFBackend
from services.generation.registry import backend_names, create_backend, register_backend

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_known_names() -> None:
    assert {"hf", "vllm"} <= set(backend_names())


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown generation backend 'nope'; known: .*hf.*vllm"):
        create_backend("nope", "unused")


def test_registration_needs_an_import_path() -> None:
    with pytest.raises(ValueError, match=r"package\.module:ClassName"):
        register_backend("broken", "services.generation.hf_backend.HFBackend")


def test_a_target_that_is_not_a_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Registered through monkeypatch so that the name is gone again after this test.
    monkeypatch.setitem(registry._BACKENDS, "not-a-backend", "services.messages:Prompt")
    with pytest.raises(TypeError, match="not a GenerationBackend"):
        create_backend("not-a-backend", "unused")


def test_create_hf_backend(tiny_model_dir: Path) -> None:
    backend = create_backend("hf", tiny_model_dir, dtype="float32")
    assert isinstance(backend, HFBackend)
    assert backend.policy_version == 0


def test_importing_the_registry_imports_no_backend() -> None:
    code = (
        "import sys, services.generation.registry; "
        "print(sorted(m for m in ('vllm', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
