"""The vLLM engine arguments a run spec may pass through `generation.engine`, with their values.

An allowlist, not a denylist: vLLM's `EngineArgs` grows with every release, and several of its
arguments load code by name or path (`distributed_executor_backend`, `scheduler_cls`,
`logits_processors`, `worker_cls`, `kv_transfer_config`'s connector module,
`reasoning_parser_plugin`, `compilation_config.backend`), send data elsewhere
(`otlp_traces_endpoint`, `kv_events_config`) or read secrets and files (`hf_token`,
`load_format`, `download_dir`). A run sent over the API must not reach any of them, nor one a
later release adds. What is listed is what a run needs to fit the engine to its GPUs: memory,
parallelism, prefix caching, compilation and scheduling limits, each with the type (and range)
vLLM takes. The vLLM test stage (tests/services/generation/test_vllm_engine_args.py) checks each
name against the installed `EngineArgs`, so a release that renames one fails there, loudly.

The backend's own options (`dtype`, `tensor_parallel_size`, `max_model_len`, ...) are set in
`generation.options` (registry.backend_options), not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, with_config
from pydantic_core import InitErrorDetails, PydanticCustomError
from typing_extensions import TypedDict

# GPUs one engine spans along each axis: it runs inside one actor, on one node (8 or 16 GPUs).
_MAX_PARALLEL = 64
# Tokens or sequences the scheduler holds at once: 2^24 tokens is past any GPU's KV cache.
_MAX_TOKENS = 2**24
_MAX_SEQS = 2**20

_Count = Annotated[int, Field(strict=True, ge=1, le=_MAX_TOKENS)]
_Bool = Annotated[bool, Field(strict=True)]


# vLLM's CUDAGraphMode, by member name.
CudagraphMode = Literal["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


@with_config(ConfigDict(extra="forbid"))
class CompilationSettings(TypedDict, total=False):
    """The part of vLLM's `CompilationConfig` a run may set. Its `backend`, `inductor_passes`,
    `custom_ops` and cache folders name code or files, so a mapping holds only these."""

    # CompilationMode: 0 none, 1 stock torch.compile, 2 dynamo trace once, 3 vLLM's compile.
    mode: Annotated[int, Field(strict=True, ge=0, le=3)]
    cudagraph_mode: CudagraphMode
    cudagraph_capture_sizes: Annotated[list[_Count], Field(max_length=1024)]
    max_cudagraph_capture_size: _Count


# Name -> the values vLLM takes for it. Strict: a count is an integer, never a boolean or string.
ENGINE_ARGS: dict[str, TypeAdapter[Any]] = {
    # memory
    "kv_cache_dtype": TypeAdapter(
        Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
    ),
    "block_size": TypeAdapter(Annotated[int, Field(strict=True, ge=1, le=4096)]),
    "num_gpu_blocks_override": TypeAdapter(_Count),
    # GiB of weights kept in host memory per GPU.
    "cpu_offload_gb": TypeAdapter(Annotated[float, Field(strict=True, ge=0.0, le=2**20)]),
    # parallelism (tensor_parallel_size is a backend option)
    "pipeline_parallel_size": TypeAdapter(
        Annotated[int, Field(strict=True, ge=1, le=_MAX_PARALLEL)]
    ),
    "data_parallel_size": TypeAdapter(Annotated[int, Field(strict=True, ge=1, le=_MAX_PARALLEL)]),
    "enable_expert_parallel": TypeAdapter(_Bool),
    "disable_custom_all_reduce": TypeAdapter(_Bool),
    "max_parallel_loading_workers": TypeAdapter(
        Annotated[int, Field(strict=True, ge=1, le=_MAX_PARALLEL)]
    ),
    # caching (enable_prefix_caching is a backend option)
    "prefix_caching_hash_algo": TypeAdapter(
        Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
    ),
    # compilation (enforce_eager is a backend option)
    "compilation_config": TypeAdapter(CompilationSettings),
    "optimization_level": TypeAdapter(Annotated[int, Field(strict=True, ge=0, le=3)]),
    # scheduling limits
    "max_num_seqs": TypeAdapter(Annotated[int, Field(strict=True, ge=1, le=_MAX_SEQS)]),
    "max_num_batched_tokens": TypeAdapter(_Count),
    "long_prefill_token_threshold": TypeAdapter(
        Annotated[int, Field(strict=True, ge=0, le=_MAX_TOKENS)]
    ),
    "enable_chunked_prefill": TypeAdapter(_Bool),
    "scheduling_policy": TypeAdapter(Literal["fcfs", "priority"]),
}


def engine_arg_errors(engine: Mapping[str, Any], options: frozenset[str]) -> list[InitErrorDetails]:
    """Each problem of `engine` (vLLM engine arguments), located at its key: a name that is not
    listed (or is one of the backend's `options`), or a value of the wrong type or range."""
    errors: list[InitErrorDetails] = []
    for name, value in engine.items():
        adapter = ENGINE_ARGS.get(name)
        if adapter is None:
            if name in options:
                message = f"a backend option: set generation.options.{name}"
            else:
                allowed = ", ".join(sorted(ENGINE_ARGS))
                message = f"not an engine argument a run may set; those are: {allowed}"
            errors.append(_error((name,), value, message))
            continue
        try:
            adapter.validate_python(value)
        except ValidationError as error:
            # Each problem keeps pydantic's own message, located at the argument (nested keys
            # of compilation_config included).
            errors.extend(_error((name, *e["loc"]), value, e["msg"]) for e in error.errors())
    return errors


def _error(loc: tuple[str | int, ...], value: object, message: str) -> InitErrorDetails:
    return InitErrorDetails(
        type=PydanticCustomError("engine_argument", "{message}", {"message": message}),
        loc=loc,
        input=value,
    )
