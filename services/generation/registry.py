"""Generation backends by name.

Backends are registered by import path and imported only when asked for, so importing this module
never imports transformers or vllm. A backend class is constructed as `cls(model_path, **options)`.
The keyword options each built-in backend takes from a run spec are declared here too, so that the
run spec can refuse an unknown one before any actor starts.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the run spec reads the names: importing them must not import torch
    from services.generation.base import GenerationBackend

_BACKENDS: dict[str, str] = {
    "hf": "services.generation.hf_backend:HFBackend",
    "vllm": "services.generation.vllm_backend:VLLMBackend",
}

# The constructor keywords of each backend that a run spec's `generation.options` may set: the
# run spec checks option names against these (services/spec/generation.py), and a test binds them
# to each constructor's signature so the two cannot drift apart. Keywords the pipeline sets from
# other keys (the hf backend's `recompute_kv`, the vllm backend's `engine_kwargs`) are not listed.
_OPTIONS: dict[str, frozenset[str]] = {
    "hf": frozenset({"device", "dtype", "attn_implementation", "max_batch_rows"}),
    "vllm": frozenset(
        {
            "tokenizer",
            "dtype",
            "seed",
            "max_model_len",
            "enforce_eager",
            "gpu_memory_utilization",
            "kv_cache_memory_bytes",
            "tensor_parallel_size",
            "enable_prefix_caching",
        }
    ),
}


def backend_names() -> list[str]:
    """Names that `create_backend` accepts, sorted."""
    return sorted(_BACKENDS)


def backend_options(name: str) -> frozenset[str]:
    """The option names a run spec may give backend `name` (none for an undeclared one)."""
    return _OPTIONS.get(name, frozenset())


def register_backend(name: str, target: str, options: Iterable[str] = ()) -> None:
    """Register (or replace) backend `name` as "package.module:ClassName", taking `options`."""
    if ":" not in target:
        raise ValueError(
            f"backend target must look like 'package.module:ClassName', got {target!r}"
        )
    _BACKENDS[name] = target
    _OPTIONS[name] = frozenset(options)


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
