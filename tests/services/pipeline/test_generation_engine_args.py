"""What a generation actor is constructed with: `generation.engine` reaches the vLLM backend.

vLLM is not installed in this environment (it has its own, `make test-vllm`), so the engine is not
started here. What is checked instead is every step before it, with the real classes: the
arguments `start_generation_worker` gives the actor bind to `GenerationWorkerImpl.__init__`, and
the options the worker hands to the backend (`create_backend(name, model_path, **options)`) bind
to `VLLMBackend.__init__` with the nested engine arguments whole in `engine_kwargs`, which the
backend passes on to the engine unchanged (tests/services/generation/test_vllm_backend.py runs
that part against the CPU build of vLLM).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kpo_core.config import describe_validation_error
from services.generation.hf_backend import HFBackend
from services.generation.registry import backend_class
from services.generation.vllm_backend import VLLMBackend
from services.generation.worker import GenerationWorkerImpl
from services.pipeline.actors import generation_worker_args
from services.pipeline.specs import apply_overrides
from services.spec import RunSpec
from tests.services.pipeline.conftest import TINY_RUN

MODEL_DIR = Path("/models/qwen")
ENGINE = {
    "compilation_config": {
        "max_cudagraph_capture_size": 64,
        "cudagraph_capture_sizes": [1, 2, 4, 8],
    },
    "kv_cache_dtype": "fp8",
    "max_num_seqs": 128,
    "cpu_offload_gb": 2.5,
}


def vllm_spec(*overrides: str, engine: dict[str, Any] | None = None) -> RunSpec:
    data = apply_overrides(
        TINY_RUN,
        ["generation.backend=vllm", "generation.options.dtype=bfloat16", *overrides],
    )
    if engine is not None:
        data["generation"]["engine"] = engine
    return RunSpec.model_validate(data)


def backend_options(spec: RunSpec) -> dict[str, Any]:
    """The options the worker's constructor passes on to the backend: its `**options`, after
    binding the actor's arguments to the real constructor."""
    args = generation_worker_args(spec, MODEL_DIR)
    bound = inspect.signature(GenerationWorkerImpl.__init__).bind(
        None, args.backend, args.model_path, **args.worker_options
    )
    (var_keyword,) = [
        p
        for p in inspect.signature(GenerationWorkerImpl.__init__).parameters.values()
        if p.kind is inspect.Parameter.VAR_KEYWORD
    ]
    options: dict[str, Any] = bound.arguments.get(var_keyword.name, {})
    return options


def binds(constructor: Callable[..., Any], options: dict[str, Any]) -> inspect.BoundArguments:
    """The backend's constructor bound as `create_backend` calls it (a TypeError if not)."""
    return inspect.signature(constructor).bind(None, MODEL_DIR, **options)


def test_nested_engine_arguments_reach_the_vllm_backend_whole() -> None:
    spec = vllm_spec(engine=ENGINE)
    assert backend_class("vllm") is VLLMBackend
    options = backend_options(spec)
    bound = binds(VLLMBackend.__init__, options)
    assert bound.arguments["engine_kwargs"] == ENGINE
    assert bound.arguments["dtype"] == "bfloat16"
    # A copy: the spec keeps its own, whatever the engine does with the mapping it gets.
    options["engine_kwargs"]["compilation_config"]["max_cudagraph_capture_size"] = 1
    assert spec.generation.engine == ENGINE


def test_engine_arguments_from_the_command_line_nest_too() -> None:
    """`kpo run ... --set generation.engine.compilation_config.max_cudagraph_capture_size=64`."""
    spec = vllm_spec(
        "generation.engine.compilation_config.max_cudagraph_capture_size=64",
        "generation.engine.enable_chunked_prefill=false",
    )
    bound = binds(VLLMBackend.__init__, backend_options(spec))
    assert bound.arguments["engine_kwargs"] == {
        "compilation_config": {"max_cudagraph_capture_size": 64},
        "enable_chunked_prefill": False,
    }


def test_without_engine_arguments_the_backends_get_only_their_options() -> None:
    """No `engine_kwargs` at all: the hf backend has no such argument, and vLLM's default
    engine arguments stay the backend's own."""
    hf = RunSpec.model_validate(apply_overrides(TINY_RUN, ["generation.options.device=cpu"]))
    assert backend_options(hf) == {"device": "cpu"}
    binds(HFBackend.__init__, backend_options(hf))
    assert backend_options(vllm_spec()) == {"dtype": "bfloat16"}
    with pytest.raises(TypeError):  # the binding can fail: the check above means something
        binds(HFBackend.__init__, {"engine_kwargs": ENGINE})


def test_the_worker_gets_the_pipelines_swap_settings_and_the_actor_its_resources() -> None:
    spec = vllm_spec(
        "pipeline.in_flight_updates=true",
        "pipeline.recompute_kv=true",
        "generation.num_gpus=0.5",
        "generation.resources.generation_gpu=1",
    )
    args = generation_worker_args(spec, MODEL_DIR)
    assert args.actor_options == {
        "num_cpus": 1.0,
        "num_gpus": 0.5,
        "resources": {"generation_gpu": 1.0},
    }
    assert (args.backend, args.model_path) == ("vllm", str(MODEL_DIR))
    bound = inspect.signature(GenerationWorkerImpl.__init__).bind(
        None, args.backend, args.model_path, **args.worker_options
    )
    assert bound.arguments["in_flight_updates"] is True
    assert bound.arguments["recompute_kv"] is True


@pytest.mark.parametrize(
    ("key", "names"),
    [
        ("engine_kwargs", "generation.engine"),
        ("in_flight_updates", "pipeline.in_flight_updates"),
        ("recompute_kv", "pipeline.recompute_kv"),
    ],
)
def test_options_may_not_set_what_other_keys_own(key: str, names: str) -> None:
    with pytest.raises(ValidationError) as caught:
        vllm_spec(f"generation.options.{key}=true")
    assert describe_validation_error(caught.value, "run") == (
        f"run: generation.options.{key}: not a backend option: set {names}"
    )
