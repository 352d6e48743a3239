"""The run spec's service settings: strictness and messages that name the field."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from kpo_core.config import describe_validation_error
from services.generation.registry import backend_class, backend_names, backend_options
from services.pipeline.evaluation import eval_sampling
from services.pipeline.specs import load_run_spec
from services.spec import PipelineConfig, RunSpec

# A run spec, or part of one, as plain data.
Data = dict[str, Any]


def pipeline_error(pipeline: dict[str, object]) -> str:
    """The described error of a run spec with this pipeline section."""
    with pytest.raises(ValidationError) as info:
        RunSpec.model_validate({"pipeline": pipeline})
    return describe_validation_error(info.value, "run.yaml")


def test_lead_batches_needs_async_mode() -> None:
    message = pipeline_error({"mode": "sync", "lead_batches": 1})
    assert message.startswith("run.yaml: pipeline: ")
    assert "lead_batches needs mode 'async'" in message
    assert PipelineConfig(mode="sync").lead_batches == 0  # the default stays valid in sync


def test_lead_batches_may_not_exceed_max_staleness() -> None:
    message = pipeline_error({"max_staleness": 2, "lead_batches": 3})
    assert "lead_batches (3) must not exceed max_staleness (2)" in message
    # The default bound (2 in async) is the one compared against.
    assert "lead_batches (3) must not exceed max_staleness (2)" in pipeline_error(
        {"lead_batches": 3}
    )
    assert PipelineConfig(max_staleness=3, lead_batches=3).lead_batches == 3


def test_lead_batches_cannot_be_negative() -> None:
    message = pipeline_error({"lead_batches": -1})
    assert "run.yaml: pipeline.lead_batches: Input should be greater than or equal to 0" in (
        message
    )


def test_an_explicit_buffer_must_hold_lead_batches_plus_one_batches() -> None:
    base = {"max_staleness": 3, "lead_batches": 3, "batch_groups": 4}
    message = pipeline_error({**base, "buffer_groups": 15})
    assert message.startswith("run.yaml: pipeline: ")
    assert "buffer_groups (15) must hold lead_batches + 1 batches (16 groups)" in message
    assert PipelineConfig(**base, buffer_groups=16).buffer_groups == 16


@pytest.mark.parametrize(("lead", "batches"), [(0, 4), (1, 4), (3, 4), (4, 5), (6, 7)])
def test_the_default_buffer_holds_four_or_lead_batches_plus_one_batches(
    lead: int, batches: int
) -> None:
    config = PipelineConfig(max_staleness=6, lead_batches=lead, batch_groups=3)
    assert config.buffer_groups == batches * 3


def run_spec_error(data: Data) -> str:
    with pytest.raises(ValidationError) as caught:
        RunSpec.model_validate(data)
    return describe_validation_error(caught.value, "run.yaml")


def test_standby_workers_are_a_count_from_zero_naming_the_field() -> None:
    assert RunSpec.model_validate({}).generation.standby == 0
    assert RunSpec.model_validate({"generation": {"standby": 2}}).generation.standby == 2
    message = run_spec_error({"generation": {"standby": -1}})
    assert message == "run.yaml: generation.standby: Input should be greater than or equal to 0"
    message = run_spec_error({"generation": {"standby": "two"}})
    assert message.startswith("run.yaml: generation.standby: ")


def test_a_float16_learner_is_refused_with_the_reason() -> None:
    message = run_spec_error({"learner": {"compute_dtype": "float16"}})
    assert "learner.compute_dtype" in message and "AdamW" in message and "bfloat16" in message
    spec = RunSpec.model_validate({"learner": {"compute_dtype": "bfloat16"}})
    assert spec.learner.compute_dtype == "bfloat16"


def test_the_old_dtype_key_names_its_replacement() -> None:
    message = run_spec_error({"learner": {"dtype": "bfloat16"}})
    assert "learner.compute_dtype" in message and "compute_dtype: bfloat16" in message


def test_learner_group_settings_are_validated() -> None:
    assert "strategy 'fsdp2'" in run_spec_error({"learner": {"world_size": 2}})
    spec = RunSpec.model_validate({"learner": {"strategy": "fsdp2", "world_size": 2}})
    assert spec.learner.world_size == 2
    assert "num_gpus" in run_spec_error({"learner": {"resources": {"GPU": 1}}})
    assert "accelerator_type" in run_spec_error(
        {"generation": {"resources": {"accelerator_type:H100": 1}}}
    )
    assert "learner.resources" in run_spec_error({"learner": {"resources": {"x": -1}}})


def test_fault_settings_are_validated() -> None:
    assert "call_timeout_s" in run_spec_error({"reward": {"timeout_s": 5, "call_timeout_s": 5}})
    assert "learner_restarts" in run_spec_error({"pipeline": {"learner_restarts": -1}})
    spec = RunSpec.model_validate({})
    assert (spec.pipeline.learner_restarts, spec.pipeline.actor_replacements) == (2, 10)
    assert spec.reward.call_timeout_s == 300.0


# --- upper bounds -------------------------------------------------------------------------------


def nested(path: str, value: object) -> Data:
    """`{"a": {"b": value}}` for the path "a.b"."""
    data: Data = {}
    node = data
    *parents, leaf = path.split(".")
    for part in parents:
        child: Data = {}
        node[part] = child
        node = child
    node[leaf] = value
    return data


def merged(base: Data, extra: Data) -> Data:
    """`base` with `extra` merged in, nested mappings merged key by key."""
    result = dict(base)
    for key, value in extra.items():
        inner = result.get(key)
        if isinstance(inner, dict) and isinstance(value, dict):
            result[key] = merged(inner, value)
        else:
            result[key] = value
    return result


VLLM: Data = {"generation": {"backend": "vllm"}}
FSDP2: Data = {"learner": {"strategy": "fsdp2"}}
# Enough responses in a batch for the largest number of minibatches (16,384 x 8 rows).
BIG_BATCH: Data = {"pipeline": {"batch_groups": 16_384}}
STALE: Data = {"pipeline": {"max_staleness": 256}}
LORA: Data = {"learner": {"lora": {}}}
EVAL: Data = {"eval": {}}
TRUNCATED: Data = {"algorithm": {"off_policy": {"truncated_sampling": "allow"}}}

# (field, the largest value it takes, the rest of a spec in which that value is valid). The
# numbers are written out rather than read from services.spec, so a changed bound shows here.
NUMERIC_BOUNDS: list[tuple[str, int | float, Data]] = [
    ("seed", 2**32 - 1, {}),
    ("generation.num_workers", 1024, {}),
    ("generation.standby", 1024, {}),
    ("generation.num_cpus", 1024, {}),
    ("generation.num_gpus", 64, {}),
    ("generation.prompts_per_batch", 4096, {}),
    ("generation.group_size", 1024, {}),
    ("generation.top_k", 2**20, TRUNCATED),
    ("generation.replay_max_kept", 4096, {}),
    ("generation.max_new_tokens", 131_072, {}),
    ("generation.options.max_batch_rows", 4096 * 1024, {}),
    ("generation.options.tensor_parallel_size", 64, VLLM),
    ("generation.options.max_model_len", 2**20, VLLM),
    ("generation.options.kv_cache_memory_bytes", 2**40, VLLM),
    ("generation.options.seed", 2**32 - 1, VLLM),
    ("generation.options.gpu_memory_utilization", 1.0, VLLM),
    ("reward.num_workers", 1024, {}),
    ("reward.processes_per_worker", 256, {}),
    ("reward.num_cpus", 1024, {}),
    ("learner.warmup_steps", 10_000_000, {}),
    ("learner.ppo_epochs", 64, {}),
    ("learner.minibatches", 65_536, BIG_BATCH),
    ("learner.world_size", 1024, FSDP2),
    ("learner.micro_batch_tokens", 2**24, {}),
    ("learner.logprob_chunk_tokens", 2**24, {}),
    ("learner.num_cpus", 1024, {}),
    ("learner.num_gpus", 64, {}),
    ("learner.record_ratios_every", 10_000_000, {}),
    ("learner.lora.rank", 4096, LORA),
    ("pipeline.max_staleness", 256, {}),
    ("pipeline.batch_groups", 16_384, {}),
    ("pipeline.lead_batches", 256, STALE),
    ("pipeline.buffer_groups", 257 * 16_384, {}),
    ("pipeline.steps", 10_000_000, {}),
    ("pipeline.checkpoint_every", 10_000_000, {}),
    ("pipeline.keep_checkpoints", 100, {}),
    ("pipeline.learner_restarts", 100, {}),
    ("pipeline.actor_replacements", 10_240, {}),
    ("eval.every", 10_000_000, EVAL),
    ("eval.samples", 256, EVAL),
    ("eval.max_prompts", 16_384, EVAL),
    ("eval.max_new_tokens", 131_072, EVAL),
    ("eval.top_k", 2**20, EVAL),
]


def value_at(spec: RunSpec, path: str) -> Any:
    node: Any = spec
    for part in path.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


@pytest.mark.parametrize(
    ("path", "limit", "context"), NUMERIC_BOUNDS, ids=[b[0] for b in NUMERIC_BOUNDS]
)
def test_every_count_has_an_upper_bound_that_names_the_field(
    path: str, limit: int | float, context: Data
) -> None:
    at_limit = RunSpec.model_validate(merged(context, nested(path, limit)))
    assert value_at(at_limit, path) == limit
    over = limit + 1 if isinstance(limit, int) else limit + 0.01
    message = run_spec_error(merged(context, nested(path, over)))
    shown = int(limit) if float(limit).is_integer() else limit
    assert message == f"run.yaml: {path}: Input should be less than or equal to {shown}"


TASK_JSONL: Data = {"task": {"name": "jsonl", "path": "p.jsonl"}}
TASK_DATASET: Data = {"task": {"name": "dataset", "path": "d"}}
WANDB: Data = {"tracking": {"wandb": {"project": "p"}}}

# (field, the most characters it takes, the rest of a spec in which it is valid).
TEXT_BOUNDS: list[tuple[str, int, Data]] = [
    ("model", 4096, {}),
    ("model_revision", 256, {}),
    ("task.path", 4096, TASK_JSONL),
    ("task.path", 4096, TASK_DATASET),
    ("task.eval_path", 4096, TASK_DATASET),
    ("task.split", 256, TASK_DATASET),
    ("task.eval_split", 256, TASK_DATASET),
    ("task.system_prompt", 32_768, TASK_DATASET),
    ("generation.options.device", 4096, {}),
    ("generation.options.tokenizer", 4096, VLLM),
    ("learner.device", 256, {}),
    ("tracking.wandb.project", 256, {}),
    ("tracking.wandb.entity", 256, WANDB),
    ("tracking.wandb.name", 256, WANDB),
    ("tracking.wandb.dir", 4096, WANDB),
    ("tracking.mlflow.tracking_uri", 4096, {}),
    ("tracking.mlflow.experiment", 256, {}),
    ("tracking.mlflow.run_name", 256, {}),
    ("tracking.tensorboard.log_dir", 4096, {}),
]


def shown(path: str, context: Data) -> str:
    """Where pydantic locates an error at `path`: a task's fields under the task's name (the tag
    of the discriminated union it is one of)."""
    task = context.get("task")
    if isinstance(task, dict) and path.startswith("task."):
        return f"task.{task['name']}.{path.removeprefix('task.')}"
    return path


@pytest.mark.parametrize(
    ("path", "limit", "context"),
    TEXT_BOUNDS,
    ids=[f"{b[0]}-{i}" for i, b in enumerate(TEXT_BOUNDS)],
)
def test_every_string_has_a_length_bound_that_names_the_field(
    path: str, limit: int, context: Data
) -> None:
    at_limit = RunSpec.model_validate(merged(context, nested(path, "a" * limit)))
    assert value_at(at_limit, path) == "a" * limit
    message = run_spec_error(merged(context, nested(path, "a" * (limit + 1))))
    assert (
        message
        == f"run.yaml: {shown(path, context)}: String should have at most {limit} characters"
    )


@pytest.mark.parametrize(
    ("path", "kind", "context"),
    [("learner.lora.target_modules", "List", LORA), ("tracking.wandb.tags", "Tuple", WANDB)],
)
def test_lists_of_names_are_bounded_in_length_and_in_each_name(
    path: str, kind: str, context: Data
) -> None:
    assert (
        len(value_at(RunSpec.model_validate(merged(context, nested(path, ["m"] * 256))), path))
        == 256
    )
    message = run_spec_error(merged(context, nested(path, ["m"] * 257)))
    assert (
        message
        == f"run.yaml: {path}: {kind} should have at most 256 items after validation, not 257"
    )
    message = run_spec_error(merged(context, nested(path, ["m" * 257])))
    assert message == f"run.yaml: {path}.0: String should have at most 256 characters"


@pytest.mark.parametrize("section", ["generation", "learner"])
def test_custom_resources_are_bounded_in_number_amount_and_name(section: str) -> None:
    many = {f"r{i}": 1.0 for i in range(16)}
    assert RunSpec.model_validate({section: {"resources": many}})
    message = run_spec_error({section: {"resources": {**many, "r16": 1.0}}})
    assert f"{section}.resources" in message and "at most 16 custom resources" in message
    fine = RunSpec.model_validate({section: {"resources": {"learner_gpu": 1_000_000}}})
    assert value_at(fine, f"{section}.resources") == {"learner_gpu": 1_000_000.0}
    for amount in (1_000_001, float("inf"), float("nan")):
        message = run_spec_error({section: {"resources": {"learner_gpu": amount}}})
        assert f"run.yaml: {section}.resources: " in message
        assert "must be a number from 0 to 1000000" in message, amount
    assert "at most 256 characters" in run_spec_error({section: {"resources": {"r" * 257: 1}}})


def test_the_largest_default_buffer_is_within_the_buffer_bound() -> None:
    # buffer_groups' bound is the default buffer of the largest lead and batch: every default
    # resolves to a value that an explicit buffer_groups could also hold.
    config = PipelineConfig(max_staleness=256, lead_batches=256, batch_groups=16_384)
    assert config.buffer_groups == 257 * 16_384
    assert PipelineConfig(buffer_groups=config.buffer_groups).buffer_groups == 257 * 16_384


# --- generation backend options -----------------------------------------------------------------

HF_OPTIONS = "attn_implementation, device, dtype, max_batch_rows"
VLLM_OPTIONS = (
    "dtype, enable_prefix_caching, enforce_eager, gpu_memory_utilization, kv_cache_memory_bytes, "
    "max_model_len, seed, tensor_parallel_size, tokenizer"
)


@pytest.mark.parametrize(
    ("backend", "option", "valid"),
    [
        ("hf", "tokenizer", HF_OPTIONS),  # a vllm option
        ("hf", "max_batch_row", HF_OPTIONS),  # a typo
        ("vllm", "attn_implementation", VLLM_OPTIONS),  # an hf option
        ("vllm", "trust_remote_code", VLLM_OPTIONS),  # an engine argument, not a backend option
    ],
)
def test_an_unknown_backend_option_is_refused_listing_the_backends_options(
    backend: str, option: str, valid: str
) -> None:
    message = run_spec_error({"generation": {"backend": backend, "options": {option: "x"}}})
    assert message == (
        f"run.yaml: generation.options.{option}: not an option of the {backend} backend; "
        f"its options are: {valid}"
    )


def test_every_unknown_option_is_named_at_once() -> None:
    message = run_spec_error({"generation": {"options": {"a": 1, "device": "cpu", "b": 2}}})
    lines = message.splitlines()
    assert [line.split(": ")[1] for line in lines] == [
        "generation.options.a",
        "generation.options.b",
    ]


@pytest.mark.parametrize(
    ("option", "key"),
    [
        ("recompute_kv", "pipeline.recompute_kv"),
        ("in_flight_updates", "pipeline.in_flight_updates"),
        ("engine_kwargs", "generation.engine"),
    ],
)
def test_an_option_that_another_key_sets_names_that_key(option: str, key: str) -> None:
    message = run_spec_error({"generation": {"backend": "vllm", "options": {option: True}}})
    assert message == f"run.yaml: generation.options.{option}: not a backend option: set {key}"


# Engine arguments that load code by qualified name or path, send data elsewhere, or read
# secrets or other weights: none is on the allowlist (services/generation/engine_args.py).
CODE_LOADING_ENGINE_ARGUMENTS: dict[str, Any] = {
    "distributed_executor_backend": "evil.module:Executor",
    "scheduler_cls": "evil.module:Scheduler",
    "logits_processors": ["evil.module:Processor"],
    "kv_transfer_config": {"kv_connector": "X", "kv_connector_module_path": "evil.module"},
    "reasoning_parser_plugin": "plugins/parser.py",
    "otlp_traces_endpoint": "http://collector.example:4317",
    "hf_token": "hf_stolen",
    "load_format": "tensorizer",
    "worker_cls": "evil.module:Worker",
    "worker_extension_cls": "evil.module:Extension",
    "trust_remote_code": True,
    "logprobs_mode": "raw_logprobs",
    "model": "other/model",
}


@pytest.mark.parametrize(("argument", "value"), CODE_LOADING_ENGINE_ARGUMENTS.items())
def test_an_engine_argument_off_the_allowlist_is_refused_naming_it(
    argument: str, value: Any
) -> None:
    message = run_spec_error({"generation": {"backend": "vllm", "engine": {argument: value}}})
    assert message.startswith(
        f"run.yaml: generation.engine.{argument}: not an engine argument a run may set; "
        "those are: block_size, compilation_config, "
    ), message


def test_engine_argument_values_are_type_checked_nested_ones_included() -> None:
    engine = {
        "max_num_seqs": "64",
        "enable_chunked_prefill": 1,
        "kv_cache_dtype": "/etc/passwd",
        "compilation_config": {"mode": 0, "backend": "evil.module:compile"},
    }
    lines = run_spec_error({"generation": {"backend": "vllm", "engine": engine}}).splitlines()
    assert [line.split(": ")[1] for line in lines] == [
        "generation.engine.max_num_seqs",
        "generation.engine.enable_chunked_prefill",
        "generation.engine.kv_cache_dtype",
        "generation.engine.compilation_config.backend",
    ]


def test_an_engine_argument_that_is_a_backend_option_points_to_options() -> None:
    message = run_spec_error({"generation": {"backend": "vllm", "engine": {"max_model_len": 512}}})
    assert message == (
        "run.yaml: generation.engine.max_model_len: a backend option: "
        "set generation.options.max_model_len"
    )
    engine = {
        "compilation_config": {"mode": 0, "cudagraph_capture_sizes": [1, 2, 4]},
        "max_num_seqs": 64,
        "cpu_offload_gb": 4,
        "scheduling_policy": "priority",
    }
    spec = RunSpec.model_validate({"generation": {"backend": "vllm", "engine": engine}})
    assert spec.generation.engine == engine


@pytest.mark.parametrize("section", ["generation", "eval"])
def test_temperature_is_finite_and_bounded(section: str) -> None:
    assert RunSpec.model_validate({section: {"temperature": 100.0}})
    for value in (100.5, float("inf")):
        message = run_spec_error({section: {"temperature": value}})
        assert f"{section}.temperature" in message


def test_valid_backend_options_are_accepted_and_kept() -> None:
    hf = {
        "device": "cuda:0",
        "dtype": "bfloat16",
        "attn_implementation": "sdpa",
        "max_batch_rows": 64,
    }
    spec = RunSpec.model_validate({"generation": {"options": hf}})
    assert spec.generation.options == hf
    vllm = {
        "tokenizer": "models/tok",
        "dtype": "auto",
        "seed": 3,
        "max_model_len": 4096,
        "enforce_eager": True,
        "gpu_memory_utilization": 1,
        "kv_cache_memory_bytes": 2**32,
        "tensor_parallel_size": 4,
        "enable_prefix_caching": False,
    }
    spec = RunSpec.model_validate({"generation": {"backend": "vllm", "options": vllm}})
    # A fraction given as an integer is the float the engine takes.
    assert spec.generation.options == {**vllm, "gpu_memory_utilization": 1.0}
    assert isinstance(spec.generation.options["gpu_memory_utilization"], float)


@pytest.mark.parametrize("value", [True, "4", 4.0, 0])
def test_a_count_option_must_be_a_positive_integer(value: object) -> None:
    spec = {"generation": {"backend": "vllm", "options": {"tensor_parallel_size": value}}}
    assert run_spec_error(spec).startswith("run.yaml: generation.options.tensor_parallel_size: ")


def test_the_declared_option_names_are_exactly_what_each_backend_constructor_takes() -> None:
    # One declaration (services/generation/registry.py) feeds the run spec; this keeps it equal
    # to the constructors' keyword parameters, less those the pipeline passes from other keys.
    set_by_pipeline = {"recompute_kv", "engine_kwargs"}
    for name in backend_names():
        parameters = inspect.signature(backend_class(name).__init__).parameters.values()
        keywords = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert backend_options(name) == keywords - set_by_pipeline, name


# --- attention implementation -------------------------------------------------------------------

ATTENTION = ["eager", "sdpa", "flash_attention_2", "flash_attention_3"]
# Hub kernel repositories transformers would download and run, and kernels of its own that the
# learner was never offered for (flash_attention_4, flex_attention).
NOT_ATTENTION = [
    "kernels-community/flash-attn3",
    "org/kernel",
    "flash_attention_4",
    "flex_attention",
    "",
]


@pytest.mark.parametrize(
    "where", ["learner.attn_implementation", "generation.options.attn_implementation"]
)
def test_attn_implementation_is_an_allowlist(where: str) -> None:
    for name in ATTENTION:
        assert value_at(RunSpec.model_validate(nested(where, name)), where) == name
    for name in NOT_ATTENTION:
        message = run_spec_error(nested(where, name))
        assert message == (
            f"run.yaml: {where}: Input should be 'eager', 'sdpa', 'flash_attention_2' or "
            "'flash_attention_3'"
        ), name


# --- tools --------------------------------------------------------------------------------------


def test_tools_are_off_by_default_and_max_calls_defaults_to_one_per_turn_but_the_last() -> None:
    spec = RunSpec()
    assert not spec.tools.enabled and spec.tools.max_turns == 5 and spec.tools.max_calls == 4
    tools = RunSpec.model_validate({"tools": {"enabled": True, "max_turns": 3}}).tools
    assert tools.max_calls == 2 and tools.call_format == "auto" and tools.sandbox_url is None


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_turns", 0, "Input should be greater than or equal to 1"),
        ("max_turns", 257, "Input should be less than or equal to 256"),
        ("max_calls", -1, "Input should be greater than or equal to 0"),
        ("max_context_tokens", 0, "Input should be greater than or equal to 1"),
        ("max_output_chars", 0, "Input should be greater than or equal to 1"),
        ("timeout_s", 0, "Input should be greater than 0"),
        ("max_concurrent_calls", 0, "Input should be greater than or equal to 1"),
        ("call_format", "xml", "Input should be 'auto', 'fenced' or 'hermes'"),
        ("sandbox_url", "ftp://host", "must be an http:// or https:// URL with a host"),
        ("sandbox_url", "http://", "must be an http:// or https:// URL with a host"),
        ("sandbox_token_env", "secret token", "the token itself never goes in the spec"),
        ("sandbox_token", "abc", "Extra inputs are not permitted"),
    ],
)
def test_bad_tools_settings_name_the_field(key: str, value: object, message: str) -> None:
    error = run_spec_error({"tools": {key: value}})
    assert error.startswith(f"run.yaml: tools.{key}: ") and message in error


def test_tools_run_on_both_backends() -> None:
    for backend in ({}, VLLM):
        spec = RunSpec.model_validate({"tools": {"enabled": True}, **backend})
        assert spec.tools.enabled
    spec = RunSpec.model_validate(
        {"tools": {"enabled": True, "sandbox_url": "http://sandbox:8000", "call_format": "fenced"}}
    )
    assert spec.tools.sandbox_url == "http://sandbox:8000"
    assert "tools" in RunSpec.model_json_schema()["properties"]


REFUSED: Data = {"algorithm": {"off_policy": {"truncated_sampling": "refuse"}}}
TRUNCATIONS = [("top_p", 0.95), ("top_k", 40), ("min_p", 0.05)]


@pytest.mark.parametrize(("field", "value"), TRUNCATIONS)
def test_truncated_training_sampling_is_replayed_unless_declared_otherwise(
    field: str, value: float
) -> None:
    spec = RunSpec.model_validate({"generation": {field: value}})
    # Resolved where the spec is validated, so the stored spec says it.
    assert spec.algorithm.off_policy.truncated_sampling == "replay"
    assert spec.replay_max_kept == 256
    stored = spec.model_dump(mode="json")
    assert stored["algorithm"]["off_policy"]["truncated_sampling"] == "replay"
    assert RunSpec.model_validate(stored) == spec
    # Untruncated, nothing is replayed, nor recorded as replayed.
    plain = RunSpec.model_validate({"generation": {"replay_max_kept": 16}})
    assert plain.algorithm.off_policy.truncated_sampling is None
    assert plain.replay_max_kept is None


@pytest.mark.parametrize(("field", "value"), TRUNCATIONS)
def test_truncated_training_sampling_under_refuse_is_refused_naming_the_field_and_the_option(
    field: str, value: float
) -> None:
    with pytest.raises(ValidationError) as error:
        RunSpec.model_validate({"generation": {field: value}, **REFUSED})
    (problem,) = error.value.errors()
    assert problem["loc"] == ("generation", field)
    assert "full softmax" in problem["msg"] and "biased" in problem["msg"]
    assert "algorithm.off_policy.truncated_sampling: allow" in problem["msg"]
    declared = RunSpec.model_validate({"generation": {field: value}, **TRUNCATED})
    assert getattr(declared.generation, field) == value
    assert declared.model_dump()["algorithm"]["off_policy"]["truncated_sampling"] == "allow"
    assert declared.replay_max_kept is None
    # refuse refuses truncated sampling only.
    assert RunSpec.model_validate(REFUSED).replay_max_kept is None


def test_a_vllm_run_replays_truncated_sampling_as_an_hf_run_does() -> None:
    replayed = RunSpec.model_validate(merged(VLLM, {"generation": {"top_k": 40}}))
    assert replayed.algorithm.off_policy.truncated_sampling == "replay"
    assert replayed.replay_max_kept == replayed.generation.replay_max_kept
    allowed = RunSpec.model_validate(merged(VLLM, {"generation": {"top_k": 40}, **TRUNCATED}))
    assert allowed.replay_max_kept is None
    # Untruncated, a vLLM run has nothing to replay.
    assert RunSpec.model_validate(VLLM).algorithm.off_policy.truncated_sampling is None


def test_evaluation_may_truncate_its_sampling_while_training_does_not() -> None:
    spec = RunSpec.model_validate({"eval": {"top_p": 0.9, "top_k": 20}})
    assert spec.generation.top_p == 1.0 and spec.generation.top_k == 0
    assert spec.eval is not None
    sampling = eval_sampling(spec.eval, spec.generation, seed=0, step=1)
    assert (sampling.top_p, sampling.top_k, sampling.min_p) == (0.9, 20, 0.0)
    # Unset, evaluation samples as training does, and records no kept set.
    plain = RunSpec.model_validate({"eval": {"min_p": 0.1}, "generation": {"top_k": 5}})
    assert plain.eval is not None
    sampling = eval_sampling(plain.eval, plain.generation, seed=0, step=1)
    assert (sampling.top_p, sampling.top_k, sampling.min_p) == (1.0, 5, 0.1)
    assert sampling.replay_max_kept is None


DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"


def spec_models() -> list[type[BaseModel]]:
    """Every pydantic model a run spec is made of (sections, estimators, nested settings)."""
    found: list[type[BaseModel]] = []

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation not in found:
                found.append(annotation)
                for field in annotation.model_fields.values():
                    visit(field.annotation)
            return
        for argument in typing.get_args(annotation):
            visit(argument)

    visit(RunSpec)
    return found


def literal_choices(annotation: Any) -> list[str]:
    if typing.get_origin(annotation) is typing.Literal:
        return [value for value in typing.get_args(annotation) if isinstance(value, str)]
    return [choice for arg in typing.get_args(annotation) for choice in literal_choices(arg)]


def test_every_setting_whose_values_yaml_reads_as_booleans_takes_them_unquoted() -> None:
    """YAML 1.1 reads an unquoted `off`, `on`, `yes`, `no` as booleans: a user who writes
    `--set algorithm.estimator.version_switch=off` means the value 'off'. Every enum setting of
    the spec that has such a value takes the boolean YAML makes of it."""
    checked = []
    for model in spec_models():
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if field.metadata:
                annotation = typing.Annotated[annotation, *field.metadata]
            adapter = TypeAdapter(annotation)
            for choice in literal_choices(field.annotation):
                read = yaml.safe_load(choice)
                if isinstance(read, bool):
                    assert adapter.validate_python(read) == choice, (model.__name__, name)
                    checked.append(f"{model.__name__}.{name}={choice}")
    assert "KalmanEstimator.version_switch=off" in checked


def test_version_switch_off_from_the_command_line_is_off() -> None:
    """What a user types, on the demo's run file (KPO): `off` unquoted."""
    spec = load_run_spec(DEMO, ["algorithm.estimator.version_switch=off"])
    assert spec.algorithm.estimator.version_switch == "off"  # type: ignore[union-attr]


@pytest.mark.parametrize("switch", ["reset", "inflate"])
def test_a_version_switch_without_in_flight_updates_is_refused_naming_both_keys(
    switch: str,
) -> None:
    """Without in-flight updates every token of a response has one version: the switch would
    never fire."""
    estimator = {"name": "kalman", "version_switch": switch, "p0": "diffuse"}
    with pytest.raises(ValidationError) as raised:
        RunSpec.model_validate({"algorithm": {"estimator": estimator}})
    described = describe_validation_error(raised.value, "run.yaml")
    assert "algorithm.estimator.version_switch" in described
    assert "pipeline.in_flight_updates" in described
    in_flight = {"in_flight_updates": True, "weight_transport": "collective"}
    spec = RunSpec.model_validate({"algorithm": {"estimator": estimator}, "pipeline": in_flight})
    assert spec.algorithm.estimator.version_switch == switch  # type: ignore[union-attr]
