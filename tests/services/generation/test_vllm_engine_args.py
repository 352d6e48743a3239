"""The allowlist of vLLM engine arguments (services/generation/engine_args.py) against the
installed vLLM: every name is one of `EngineArgs`' fields, every nested compilation key one of
`CompilationConfig`'s, and every value the allowlist takes one vLLM takes too. A release that
renames or drops one fails here rather than when a run's engine starts.

Runs only where vLLM is installed (`make test-vllm`); elsewhere the module is skipped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, get_args

import pytest

pytest.importorskip("vllm")

from vllm.config import CompilationConfig
from vllm.config.cache import CacheDType, PrefixCachingHashAlgo
from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.config.scheduler import SchedulerPolicy
from vllm.config.vllm import OptimizationLevel
from vllm.engine.arg_utils import EngineArgs

from services.generation.engine_args import ENGINE_ARGS, CompilationSettings, CudagraphMode
from services.generation.registry import backend_options


def literal_values(adapter: Any) -> set[Any]:
    annotation = adapter.core_schema
    assert annotation["type"] == "literal", annotation
    return set(annotation["expected"])


def test_every_allowed_engine_argument_is_a_field_of_the_installed_engine_args() -> None:
    fields = {field.name for field in dataclasses.fields(EngineArgs)}
    assert sorted(set(ENGINE_ARGS) - fields) == []
    # The backend's own options are EngineArgs fields too (it passes them on by name).
    assert sorted(backend_options("vllm") - fields) == []


def test_every_allowed_compilation_key_is_a_field_of_compilation_config() -> None:
    fields = {field.name for field in dataclasses.fields(CompilationConfig)}
    assert sorted(set(CompilationSettings.__annotations__) - fields) == []


def test_the_allowed_values_are_values_vllm_takes() -> None:
    assert literal_values(ENGINE_ARGS["kv_cache_dtype"]) <= set(get_args(CacheDType))
    assert literal_values(ENGINE_ARGS["prefix_caching_hash_algo"]) <= set(
        get_args(PrefixCachingHashAlgo)
    )
    assert literal_values(ENGINE_ARGS["scheduling_policy"]) <= set(get_args(SchedulerPolicy))
    assert set(get_args(CudagraphMode)) <= set(CUDAGraphMode.__members__)
    assert {mode.value for mode in CompilationMode} == {0, 1, 2, 3}
    assert {level.value for level in OptimizationLevel} >= {0, 1, 2, 3}


def test_engine_args_take_the_allowed_arguments() -> None:
    """EngineArgs built with one value of each argument: a type vLLM no longer takes fails."""
    sample: dict[str, Any] = {
        "kv_cache_dtype": "auto",
        "block_size": 16,
        "num_gpu_blocks_override": 64,
        "cpu_offload_gb": 0.0,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "enable_expert_parallel": False,
        "disable_custom_all_reduce": True,
        "max_parallel_loading_workers": 2,
        "prefix_caching_hash_algo": "sha256",
        "compilation_config": {
            "mode": 0,
            "cudagraph_mode": "NONE",
            "cudagraph_capture_sizes": [1, 2],
            "max_cudagraph_capture_size": 2,
        },
        "optimization_level": 0,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "long_prefill_token_threshold": 0,
        "enable_chunked_prefill": True,
        "scheduling_policy": "fcfs",
    }
    assert set(sample) == set(ENGINE_ARGS)
    for name, value in sample.items():
        ENGINE_ARGS[name].validate_python(value)
    args = EngineArgs(model="unused", **sample)
    assert args.max_num_seqs == 8
    assert CompilationConfig(**sample["compilation_config"]).cudagraph_mode == CUDAGraphMode.NONE
