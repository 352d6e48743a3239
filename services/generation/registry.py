"""Generation backends by name.

Backends are registered by import path and imported only when asked for, so importing this module
never imports transformers or vllm. A backend class is constructed as `cls(model_path, **options)`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the run spec reads the names: importing them must not import torch
    from services.generation.base import GenerationBackend

_BACKENDS: dict[str, str] = {
    "hf": "services.generation.hf_backend:HFBackend",
    "vllm": "services.generation.vllm_backend:VLLMBackend",
}


def backend_names() -> list[str]:
    """Names that `create_backend` accepts, sorted."""
    return sorted(_BACKENDS)


def register_backend(name: str, target: str) -> None:
    """Register (or replace) backend `name` as "package.module:ClassName"."""
    if ":" not in target:
        raise ValueError(
            f"backend target must look like 'package.module:ClassName', got {target!r}"
        )
    _BACKENDS[name] = target


def backend_class(name: str) -> type[GenerationBackend]:
    """Import and return the class registered as `name`; ValueError lists the known names."""
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown generation backend {name!r}; known: {', '.join(backend_names())}"
        )
    from services.generation.base import GenerationBackend

    module_name, _, class_name = _BACKENDS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, GenerationBackend)):
        raise TypeError(f"{_BACKENDS[name]} is not a GenerationBackend subclass")
    return cls


def create_backend(name: str, model_path: str | Path, **options: Any) -> GenerationBackend:
    """Construct backend `name` for the model at `model_path` with backend-specific options."""
    factory: Any = backend_class(name)  # the ABC declares no constructor; the convention does
    backend: GenerationBackend = factory(model_path, **options)
    return backend
