"""The run spec: what one run is made of, shared by YAML run files and the REST API.

A `RunSpec` is the algorithm (`kpo_core.config.AlgorithmConfig`, the pure library's) plus what
only the service knows: the model, the task, generation, reward, the learner, the pipeline,
evaluation and tracking. Every model is strict (`extra="forbid"`): a typo in a key is an error
naming the key, and a bad value is an error naming the field and the valid values. The names a
field accepts (generation backends, verifiers, dataset formats) are read from the services'
registries, so a bad name in a run file is a validation error listing the valid ones rather
than a failure inside an actor, and no second list has to be kept in step.

Every count, list and free-text string has an upper bound (the MAX_* constants below): a run
spec may come from any client of the API, and none may ask the cluster for an unbounded amount
of work, memory, disk or scheduling. The bounds are far above what a run of a 4B-8B model on a
large GPU cluster asks for; past one, the error names the field and the bound.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    JsonValue,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from kpo_core.config import AlgorithmConfig, StrictModel
from services.generation.engine_args import engine_arg_errors
from services.generation.registry import backend_names, backend_options
from services.reward.registry import builtin_verifier_names
from services.tasks.dataset_files import DatasetFormat

if TYPE_CHECKING:
    BackendName = str
    VerifierName = str
else:
    # Literals built from the registries: the JSON schema lists the names, and pydantic's error
    # for a bad one names the valid ones.
    BackendName = Literal[tuple(backend_names())]
    VerifierName = Literal[tuple(builtin_verifier_names())]

# --- upper bounds shared by several fields ------------------------------------------------------

# Actors of one kind (generation workers, verifier actors, learner ranks): a 1,024-GPU cluster.
MAX_ACTORS = 1024
# CPUs one actor reserves: Ray places an actor on one node, and no node has this many cores.
MAX_CPUS_PER_ACTOR = 1024
# GPUs one actor reserves, and the GPUs one vLLM engine spans (tensor_parallel_size): an actor
# lives on one node, and nodes hold 8 or 16; anything above is unschedulable, never useful.
MAX_GPUS_PER_ACTOR = 64
# Custom Ray resources of one actor: how many names, and how much of each. Ray stores amounts as
# fixed-point integers, so an unbounded (or infinite) amount is not even representable.
MAX_CUSTOM_RESOURCES = 16
MAX_CUSTOM_RESOURCE_AMOUNT = 1_000_000
# Tokens of one response (generation and eval max_new_tokens): 128K, the longest context of
# 4B-8B models (Llama 3.1, Qwen3 with YaRN); a response cannot outgrow its model's context.
MAX_RESPONSE_TOKENS = 131_072
# Learner steps, and every setting counted in steps (warm-up, checkpoint and eval periods): soak
# and load benchmarks ask for 10M steps to mean "more than it will ever make"; a run is cancelled.
MAX_STEPS = 10_000_000
# Rows generated at once: G responses per prompt (GRPO uses 4-64, pass@k studies a few hundred)
# and prompts in flight per worker (a vLLM engine schedules a few thousand sequences).
MAX_GROUP_SIZE = 1024
MAX_PROMPTS_PER_BATCH = 4096
# Groups per learner step (DAPO-scale runs use 512 prompts per step).
MAX_BATCH_GROUPS = 16_384
# Learner versions a group may lag behind (asynchronous RL uses 1-8); lead_batches is at most it.
MAX_STALENESS = 256
# Rollout buffer capacity: as large as the default buffer of the largest lead and batch, so that
# every default `buffer_groups` resolves within it.
MAX_BUFFER_GROUPS = (MAX_STALENESS + 1) * MAX_BATCH_GROUPS
# Padded tokens of one learner forward (micro_batch_tokens) and response positions projected to
# the vocabulary at once (logprob_chunk_tokens): 16M tokens, beyond any GPU's memory already, so
# the bound costs nothing and only keeps absurd numbers out of the packing arithmetic.
MAX_TOKEN_BUDGET = 16_777_216
# Seeds: 32 bits, which every generator the run seeds accepts (torch, Python's random, vLLM's
# engine); the per-group sampling seeds the run derives are 32 bits as well.
MAX_SEED = 2**32 - 1
# Items of a list of names (LoRA target modules, tracker tags).
MAX_LIST_ITEMS = 256
# Characters of a path or URI (Linux's PATH_MAX), of a name (a device, a split, a git revision, a
# tracker project or run, a module: 255 is the longest file name), and of free text (a system
# prompt: about 8K tokens, and it is repeated in every prompt of the run).
MAX_PATH_CHARS = 4096
MAX_NAME_CHARS = 256
MAX_TEXT_CHARS = 32_768
# Sampling temperature: far past any useful value (sampling is uniform long before), but finite.
MAX_TEMPERATURE = 100.0

PathText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATH_CHARS)]
NameText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS)]
# An item of a list of names: only bounded, as list items were before the bounds.
NameItem = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)]

# The attention kernels a spec may ask transformers for. transformers takes any other string as
# the name of a hub kernel repository (e.g. `kernels-community/...`) that it downloads and runs,
# so a free string would let a client run code of its choosing. All four are transformers'
# own: AttentionInterface maps flash_attention_2 and flash_attention_3 to its built-in
# flash_attention_forward, over the installed flash-attn (2) or flash_attn_interface (3,
# FlashAttention-3 for Hopper) package; only if that package is missing does transformers fall
# back to its fixed kernels-community build of the same kernel (FLASH_ATTN_KERNEL_FALLBACK),
# never to a repository named by the spec.
AttnImplementation = Literal["eager", "sdpa", "flash_attention_2", "flash_attention_3"]


class ArithTask(StrictModel):
    """A built-in arithmetic task (seeded, endless; held-out prompts never overlap): `arith`,
    multi-step sums worked line by line; `arith-tool`, multi-digit products and quotients that
    pay for a Python tool call (docs/tools.md)."""

    name: Literal["arith", "arith-tool"] = "arith"
    difficulty: int = Field(
        3,
        ge=1,
        le=5,
        description="arith: 1 (4 terms, +) to 5 (8 terms, + - *); arith-tool: the operands' "
        "digits, 1 to 5",
    )
    difficulty_max: int | None = Field(
        None,
        ge=1,
        le=5,
        description="draw each prompt's difficulty uniformly from difficulty..difficulty_max "
        "(seeded): a mix of short and long responses, as real tasks have",
    )

    @model_validator(mode="after")
    def _range(self) -> ArithTask:
        if self.difficulty_max is not None and self.difficulty_max < self.difficulty:
            raise ValueError(
                f"difficulty_max ({self.difficulty_max}) must be >= difficulty ({self.difficulty})"
            )
        return self


class JsonlTask(StrictModel):
    """Prompts from a local JSONL file of {"prompt": ..., "answer": ...} lines, cycled in epochs."""

    name: Literal["jsonl"] = "jsonl"
    path: PathText = Field(description="path of the JSONL file on the driver's machine")
    shuffle: bool = Field(True, description="reshuffle every epoch (seeded by the run seed)")


class DatasetTask(StrictModel):
    """Prompts from a dataset file or `save_to_disk` directory in one of the formats RL datasets
    come in (services/tasks/dataset_files.py), cycled in epochs."""

    name: Literal["dataset"] = "dataset"
    path: PathText = Field(
        description="a .jsonl, .json or .parquet file, or a directory written by datasets' "
        "save_to_disk, on the driver's machine",
    )
    format: DatasetFormat | None = Field(
        None, description="the file's format; detected from its columns when left out"
    )
    split: NameText = Field("train", description="the split taken from a directory holding several")
    shuffle: bool = Field(True, description="reshuffle every epoch (seeded by the run seed)")
    chat_template: Literal["auto", "always", "never"] = Field(
        "auto",
        description="string prompts through the tokenizer's chat template: auto (when it has "
        "one), always (an error when it has none) or never; chat-message prompts always are",
    )
    system_prompt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_TEXT_CHARS,
        description="a system message put before each string prompt rendered as a chat",
    )
    eval_path: PathText | None = Field(
        None,
        description="held-out prompts for eval: a file or directory as `path` takes, in the "
        "same format",
    )
    eval_split: NameText = Field(
        "test",
        description="the held-out split of a directory (eval_path's, or path's without one)",
    )


TaskConfig = Annotated[ArithTask | JsonlTask | DatasetTask, Field(discriminator="name")]
# A backend option's value: a scalar (nested engine arguments go in `generation.engine`). A string
# is at most a path long (the vLLM `tokenizer` option is one), checked with the option's name.
BackendOption = str | int | float | bool

# Options of `generation.options` that other keys of the spec own (the pipeline passes them to
# the generation worker itself): the error points to the key to set instead.
_OPTIONS_SET_ELSEWHERE: dict[str, str] = {
    "in_flight_updates": "pipeline.in_flight_updates",
    "recompute_kv": "pipeline.recompute_kv",
    "engine_kwargs": "generation.engine",
}

# Values of the backend options that are counts, fractions or a kernel name. Which names each
# backend takes is declared once, in services/generation/registry.py; this only bounds values,
# by name (the same name means the same thing in every backend). Options not listed here (dtype,
# device, tokenizer, the booleans) are scalars checked by their backend when it starts.
# Strict: a count is an integer, never a boolean or a string.
_OPTION_VALUES: dict[str, TypeAdapter[Any]] = {
    "attn_implementation": TypeAdapter(AttnImplementation),
    "max_batch_rows": TypeAdapter(
        Annotated[int, Field(strict=True, ge=1, le=MAX_PROMPTS_PER_BATCH * MAX_GROUP_SIZE)]
    ),
    "seed": TypeAdapter(Annotated[int, Field(strict=True, ge=0, le=MAX_SEED)]),
    # Prompt + response: up to 1M tokens (the 1M-context 7B models).
    "max_model_len": TypeAdapter(Annotated[int, Field(strict=True, ge=1, le=2**20)]),
    "gpu_memory_utilization": TypeAdapter(Annotated[float, Field(strict=True, gt=0.0, le=1.0)]),
    # Per device: 1 TiB, above the memory of any accelerator.
    "kv_cache_memory_bytes": TypeAdapter(Annotated[int, Field(strict=True, ge=1, le=2**40)]),
    "tensor_parallel_size": TypeAdapter(
        Annotated[int, Field(strict=True, ge=1, le=MAX_GPUS_PER_ACTOR)]
    ),
}


RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


def _custom_resources(value: dict[str, float]) -> dict[str, float]:
    if len(value) > MAX_CUSTOM_RESOURCES:
        raise ValueError(
            f"at most {MAX_CUSTOM_RESOURCES} custom resources per actor, got {len(value)}"
        )
    for name, amount in value.items():
        if len(name) > MAX_NAME_CHARS:
            raise ValueError(f"a resource name has at most {MAX_NAME_CHARS} characters")
        if name in RAY_BUILTIN_RESOURCES or name.startswith("accelerator_type:"):
            raise ValueError(
                f"{name!r} is a resource Ray manages itself: use num_cpus / num_gpus, and "
                "resources only for custom names such as learner_gpu"
            )
        # `not 0 <= amount`: NaN fails it too.
        if not 0 <= amount <= MAX_CUSTOM_RESOURCE_AMOUNT:
            raise ValueError(
                f"resource {name!r} must be a number from 0 to {MAX_CUSTOM_RESOURCE_AMOUNT}, "
                f"got {amount}"
            )
    return value


# Custom Ray resources per actor, matched against what the cluster's node groups advertise.
CustomResources = Annotated[dict[str, float], AfterValidator(_custom_resources)]


class GenerationConfig(StrictModel):
    """Generation actors: how many, where, and how they sample."""

    backend: BackendName = "hf"
    num_workers: int = Field(1, ge=1, le=MAX_ACTORS, description="generation actors")
    num_cpus: float = Field(
        1.0, ge=0.0, le=MAX_CPUS_PER_ACTOR, description="CPUs reserved per generation actor"
    )
    num_gpus: float = Field(
        0.0, ge=0.0, le=MAX_GPUS_PER_ACTOR, description="GPUs reserved per generation actor"
    )
    resources: CustomResources = Field(
        default_factory=dict,
        description="custom Ray resources per generation actor, e.g. {generation_gpu: 1}",
    )
    prompts_per_batch: int = Field(
        8,
        ge=1,
        le=MAX_PROMPTS_PER_BATCH,
        description="prompts in flight per generation worker (each of group_size rows)",
    )
    group_size: int = Field(
        8, ge=2, le=MAX_GROUP_SIZE, description="G: responses per prompt (GRPO needs >= 2)"
    )
    temperature: float = Field(1.0, gt=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # 2^20: above any vocabulary (Gemma 3's is 262,144); a larger k keeps every token anyway.
    top_k: int = Field(0, ge=0, le=2**20, description="0 = no top-k truncation")
    max_new_tokens: int = Field(128, ge=1, le=MAX_RESPONSE_TOKENS)
    options: dict[str, BackendOption] = Field(
        default_factory=dict,
        description="backend constructor options (hf: device, dtype, attn_implementation, "
        "max_batch_rows; vllm: dtype, tensor_parallel_size, gpu_memory_utilization, "
        "max_model_len, ...); another name is refused, listing the backend's",
    )
    streaming: bool = Field(
        True,
        description="a worker gets new prompts as soon as its groups end (continuous "
        "batching); false: only once all of its prompts ended, as one batch, so the engine "
        "drains during each batch's longest response (the baseline streaming is measured "
        "against)",
    )
    first_group_timeout_s: float = Field(
        1800.0,
        gt=0.0,
        description="longest a worker holding prompts may take to return its first group "
        "(engine start-up included) before it is taken for hung; later, the deadline is derived "
        "from max_new_tokens and the worker's measured speed",
    )
    engine: dict[str, JsonValue] = Field(
        default_factory=dict,
        description="vllm only: further vLLM engine arguments (EngineArgs), passed through "
        "unchanged, nested mappings included, e.g. {compilation_config: {mode: 0}}; only the "
        "memory, parallelism, caching, compilation and scheduling arguments listed in "
        "docs/deploy.md are taken, each of vLLM's type",
    )

    @field_validator("options")
    @classmethod
    def _backend_options(
        cls, options: dict[str, BackendOption], info: ValidationInfo
    ) -> dict[str, BackendOption]:
        # Checked here rather than when the actor starts: an unknown name was a TypeError inside
        # the backend's constructor, after the run had been accepted and its actors placed.
        backend = info.data.get("backend")
        if backend is None:  # the backend itself is invalid, and that error is reported
            return options
        valid = backend_options(backend)
        errors: list[InitErrorDetails] = []
        checked: dict[str, BackendOption] = {}
        for name, value in options.items():
            if name not in valid:
                errors.append(_unknown_option(backend, name, value, valid))
                continue
            if isinstance(value, str) and len(value) > MAX_PATH_CHARS:
                # Here rather than in BackendOption: a constraint inside the union would report
                # the value against each of its four types.
                errors.append(
                    InitErrorDetails(
                        type="string_too_long",
                        loc=(name,),
                        input=value,
                        ctx={"max_length": MAX_PATH_CHARS},
                    )
                )
                continue
            adapter = _OPTION_VALUES.get(name)
            if adapter is None:
                checked[name] = value
                continue
            try:
                checked[name] = adapter.validate_python(value)
            except ValidationError as error:
                # Each problem keeps pydantic's own message, located at the option itself.
                errors.extend(
                    InitErrorDetails(
                        type=PydanticCustomError(
                            "backend_option", "{message}", {"message": e["msg"]}
                        ),
                        loc=(name, *e["loc"]),
                        input=value,
                    )
                    for e in error.errors()
                )
        if errors:
            # Raised as a ValidationError so each error's location is generation.options.<name>.
            raise ValidationError.from_exception_data("GenerationConfig.options", errors)
        return checked

    @model_validator(mode="after")
    def _engine_needs_vllm(self) -> GenerationConfig:
        if self.engine and self.backend != "vllm":
            raise ValueError(
                f"engine holds vLLM engine arguments, but backend is {self.backend!r}: "
                "use options for the hf backend"
            )
        return self

    @field_validator("engine")
    @classmethod
    def _engine_arguments_allowed(cls, engine: dict[str, JsonValue]) -> dict[str, JsonValue]:
        # An allowlist (services/generation/engine_args.py): other arguments load code by name.
        errors = engine_arg_errors(engine, backend_options("vllm"))
        if errors:
            # Raised as a ValidationError so each error's location is generation.engine.<name>.
            raise ValidationError.from_exception_data("GenerationConfig.engine", errors)
        return engine


def _unknown_option(
    backend: str, name: str, value: object, valid: frozenset[str]
) -> InitErrorDetails:
    """The error of an option that backend `backend` does not take, saying what to set instead."""
    # The error's location names the field (generation.options.<name>); the message says why.
    elsewhere = _OPTIONS_SET_ELSEWHERE.get(name)
    if elsewhere is not None:
        message = f"not a backend option: set {elsewhere}"
    else:
        names = ", ".join(sorted(valid)) or "none"
        message = f"not an option of the {backend} backend; its options are: {names}"
    return InitErrorDetails(
        type=PydanticCustomError("backend_option", "{message}", {"message": message}),
        loc=(name,),
        input=value,
    )


class RewardConfig(StrictModel):
    """Verifier actors and the verifier they run."""

    verifier: VerifierName = "exact"
    num_workers: int = Field(1, ge=1, le=MAX_ACTORS, description="verifier actors")
    # 256: a process per core of the largest nodes; an actor's processes share its node.
    processes_per_worker: int = Field(
        1, ge=1, le=256, description="check processes per verifier actor"
    )
    num_cpus: float = Field(
        0.25, ge=0.0, le=MAX_CPUS_PER_ACTOR, description="CPUs reserved per verifier actor"
    )
    timeout_s: float = Field(2.0, gt=0.0, description="wall-clock limit of one check")
    format_reward: float = Field(0.0, ge=0.0, lt=1.0, description="added for a well-formed answer")
    call_timeout_s: float = Field(
        300.0,
        gt=0.0,
        description="wall-clock limit of one verifier actor call (a whole batch); an actor "
        "past it is taken for hung, replaced, and the batch scored again",
    )

    @model_validator(mode="after")
    def _call_outlasts_a_check(self) -> RewardConfig:
        if self.call_timeout_s <= self.timeout_s:
            raise ValueError(
                f"call_timeout_s ({self.call_timeout_s}) must exceed timeout_s "
                f"({self.timeout_s}): a call holds at least one check"
            )
        return self


class LoraConfig(StrictModel):
    """Low-rank adapters (PEFT LoRA) on the policy: only the adapters train (docs/pipeline.md)."""

    # 4096: the hidden size of 8B models; a rank above a layer's width adds nothing.
    rank: int = Field(16, ge=1, le=4096, description="r: each adapter is B [out, r] @ A [r, in]")
    alpha: float = Field(32.0, gt=0.0, description="the adapters' update is scaled by alpha / r")
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="dropout on the adapters' input in training forwards (never in the "
        "proximal log-probs); > 0 makes even on-policy ratios differ from 1",
    )
    target_modules: list[NameItem] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        min_length=1,
        max_length=MAX_LIST_ITEMS,
        description="suffixes of the module names that get adapters (default: the attention "
        "and MLP projections of Llama/Qwen)",
    )


class LearnerConfig(StrictModel):
    """The learner group: optimiser, PPO epochs and minibatches, ranks, memory, placement.

    `num_cpus`, `num_gpus` and `resources` are per rank. The master weights and AdamW state are
    always float32; `compute_dtype` is what the forward and backward run in (and what the
    weights are published in).
    """

    lr: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(
        0, ge=0, le=MAX_STEPS, description="linear learning-rate warm-up, in steps"
    )
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="null: no gradient clipping")
    # PPO makes 1-4 passes; 64 is far beyond where re-using a batch still helps.
    ppo_epochs: int = Field(1, ge=1, le=64, description="passes over each batch")
    # Each minibatch holds at least one response (checked against the batch below); 65,536
    # optimiser steps per pass is far more than any batch is split into.
    minibatches: int = Field(1, ge=1, le=65_536, description="optimiser steps per pass")
    strategy: Literal["single", "fsdp2"] = Field(
        "single",
        description="single: one process holds the whole model; fsdp2: world_size ranks shard "
        "parameters, gradients and optimiser state (torch FSDP2)",
    )
    world_size: int = Field(
        1, ge=1, le=MAX_ACTORS, description="learner ranks (fsdp2), one per GPU"
    )
    # Loading an 8B model's weights and AdamW state (~100 GB over the ranks) from network
    # storage takes minutes; a rank still silent after this is hung, not slow.
    resume_timeout_s: float = Field(
        900.0,
        gt=0.0,
        le=86_400.0,
        description="seconds every rank has to load a checkpoint on resume; a rank that has not "
        "answered by then fails the run with its rank named",
    )
    micro_batch_tokens: int = Field(
        0,
        ge=0,
        le=MAX_TOKEN_BUDGET,
        description="tokens per forward pass (real tokens with packed rows, else padded): "
        "each rank's share of a minibatch is split into micro-batches under this budget and "
        "gradients accumulate (the result equals the whole minibatch); 0: one forward per "
        "minibatch share",
    )
    pack_rows: bool | Literal["auto"] = Field(
        "auto",
        description="concatenate a micro-batch's rows into one sequence without padding "
        "(position ids restart per row; attention through torch's variable-length kernel on "
        "CUDA, per row on CPU); auto: on CUDA with sdpa or flash-attention, padded elsewhere",
    )
    compile: bool = Field(
        False,
        description="compile each decoder layer on its own with torch.compile (regional "
        "compilation: one compiled layer serves them all); the first steps pay the compile",
    )
    logprob_chunk_tokens: int = Field(
        1024,
        ge=1,
        le=MAX_TOKEN_BUDGET,
        description="response positions projected to the vocabulary at once when computing "
        "log-probs and entropy",
    )
    logprob_vocab_chunk: int = Field(
        32_768,
        ge=1,
        le=MAX_TOKEN_BUDGET,
        description="vocabulary entries per block of that projection (online log-sum-exp): "
        "the float32 logits held at once are logprob_chunk_tokens x this, forward and backward",
    )
    attn_implementation: AttnImplementation = Field(
        "sdpa",
        description="the model's attention kernel; with flash-attention (GPUs, the "
        "flash-attn package) rows are packed without padding",
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in the backward pass"
    )
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="dtype of the forward/backward and of the published weights; master "
        "weights and optimiser state stay float32 (float16 is refused: AdamW's eps underflows)",
    )
    device: NameText = Field(
        "cpu", description="cpu, or cuda (each rank uses the GPU Ray assigns it)"
    )
    num_cpus: float = Field(
        1.0, ge=0.0, le=MAX_CPUS_PER_ACTOR, description="CPUs reserved per learner rank"
    )
    num_gpus: float = Field(
        0.0, ge=0.0, le=MAX_GPUS_PER_ACTOR, description="GPUs reserved per learner rank"
    )
    resources: CustomResources = Field(
        default_factory=dict,
        description="custom Ray resources per learner rank, e.g. {learner_gpu: 1}: the "
        "rank lands only on nodes that advertise them (the chart's worker groups)",
    )
    nonfinite: Literal["raise", "mask"] = Field(
        "mask", description="NaN/inf log-probs in valid tokens: fail the step, or mask and count"
    )
    record_ratios_every: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="every N steps, save the step's token log-ratios under the run "
        "directory's ratios/ (for offline ratio diagnostics); 0: off",
    )
    lora: LoraConfig | None = Field(
        None,
        description="train LoRA adapters instead of every weight (PEFT); generation receives "
        "the merged weights; null: full fine-tuning",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_dtype(cls, data: object) -> object:
        if isinstance(data, Mapping) and "dtype" in data:
            raise ValueError(
                "learner.dtype was replaced by learner.compute_dtype (float32 | bfloat16): "
                "master weights and optimiser state are now always float32, and compute_dtype "
                f"sets only the forward/backward; write compute_dtype: {data['dtype']}"
            )
        return data

    @field_validator("compute_dtype", mode="before")
    @classmethod
    def _no_float16(cls, value: object) -> object:
        if value == "float16":
            raise ValueError(
                "float16 is not supported for training: its range overflows in the backward "
                "pass without loss scaling, and AdamW's eps (1e-8) underflows in it; use "
                "bfloat16 or float32"
            )
        return value

    @model_validator(mode="after")
    def _strategy_fits(self) -> LearnerConfig:
        if self.strategy == "single" and self.world_size != 1:
            raise ValueError(
                f"strategy 'single' runs one rank, so world_size must be 1 (got "
                f"{self.world_size}); use strategy 'fsdp2' to shard over several ranks"
            )
        return self

    @model_validator(mode="after")
    def _lora_single(self) -> LearnerConfig:
        if self.lora is not None and self.strategy != "single":
            raise ValueError(
                "learner.lora is not supported with learner.strategy 'fsdp2' yet: use "
                "strategy 'single', or drop lora for full fine-tuning"
            )
        return self


class PipelineConfig(StrictModel):
    """The run driver: synchronous or asynchronous, staleness bound, buffer, steps, checkpoints."""

    mode: Literal["async", "sync"] = Field(
        "async",
        description="sync: generation pauses while the learner trains (the on-policy baseline)",
    )
    max_staleness: int = Field(
        -1,
        ge=-1,
        le=MAX_STALENESS,
        description="max learner version minus a group's version; -1: 0 (sync), 2",
    )
    admission: Literal["staleness", "capacity"] = Field(
        "staleness",
        description="async only. staleness: generation is asked only for groups that can "
        "still be trained within max_staleness (no wasted rollouts, as in AReaL); capacity: "
        "generation runs ahead until the buffer is full, and groups that age past the bound "
        "are dropped and counted",
    )
    batch_groups: int = Field(
        16, ge=1, le=MAX_BATCH_GROUPS, description="groups (prompts) per learner step"
    )
    lead_batches: int = Field(
        0,
        ge=0,
        le=MAX_STALENESS,
        description="async only. The learner trains only while the buffer holds this many "
        "batches beyond the one it takes, so generation runs that many versions ahead: a "
        "controlled staleness, as with many rollout workers (at most max_staleness)",
    )
    buffer_groups: int = Field(
        0,
        ge=0,
        le=MAX_BUFFER_GROUPS,
        description="rollout buffer capacity in groups; 0: max(4, lead_batches + 1) batches",
    )
    steps: int = Field(100, ge=1, le=MAX_STEPS, description="learner steps of the run")
    checkpoint_every: int = Field(
        10, ge=0, le=MAX_STEPS, description="steps between checkpoints; 0: last only"
    )
    # A checkpoint of an 8B model with its optimiser state is about 100 GB, on a volume that all
    # runs share: 100 of them is already far more than one run should hold.
    keep_checkpoints: int = Field(2, ge=1, le=100, description="newest checkpoints kept on disk")
    # Each restart reloads the model and the last checkpoint on the learner's GPUs: a learner
    # that died 100 times will die again.
    learner_restarts: int = Field(
        2,
        ge=0,
        le=100,
        description="times the run resumes itself from its last checkpoint after the learner "
        "dies; 0: a dead learner fails the run",
    )
    # 10,000: ten for each of the most actors a run may have.
    actor_replacements: int = Field(
        10,
        ge=0,
        le=10 * MAX_ACTORS,
        description="generation and verifier actors that may die (or hang) and be replaced, "
        "in all, before the run fails",
    )
    weight_transport: Literal["object_store", "collective"] = Field(
        "object_store",
        description="how new weights reach generation: object_store (tensors in buckets "
        "through Ray's object store) or collective (a torch.distributed broadcast from learner "
        "rank 0 to every generation worker's receiving processes; NCCL on GPUs, CUDA IPC handles "
        "where they all share one GPU, gloo on CPU)",
    )
    weight_bucket_mb: int = Field(
        256,
        ge=1,
        le=16384,
        description="size of one bucket of weights sent at a time: bounds the full tensors "
        "held beyond a rank's shard while gathering, and each message on the way",
    )
    overlap_publish: bool = Field(
        True,
        description="async: read and put (object_store) or broadcast (collective) each new "
        "version while the next learner step trains (its first optimiser update waits until "
        "the weights are read) instead of before it; a sharded learner gathers before the next "
        "step and puts or broadcasts beside it; a sync run publishes before the next step",
    )
    publish_in_flight: int = Field(
        1,
        ge=1,
        le=MAX_STALENESS + 1,
        description="a sharded learner's overlapped publishes whose gathered host copy of the "
        "weights may be held at once (each until it is put or broadcast): the next publish "
        "waits for room, so host memory holds at most this many copies beyond the shards",
    )
    in_flight_updates: bool = Field(
        False,
        description="async only. Load new weights between decoding steps without waiting for "
        "the responses in flight (their KV cache is kept, see recompute_kv); each token keeps "
        "the version and behaviour log-prob of the weights that sampled it",
    )
    recompute_kv: bool = Field(
        False,
        description="with in_flight_updates: recompute the KV cache of responses in flight "
        "under the new weights (exact, costs a prefill) instead of keeping it",
    )

    @model_validator(mode="after")
    def _resolve(self) -> PipelineConfig:
        if self.mode == "sync" and self.max_staleness > 0:
            raise ValueError(
                f"mode 'sync' trains on-policy, so max_staleness must be 0 or left out "
                f"(got {self.max_staleness}); use mode 'async' for stale batches"
            )
        if self.max_staleness < 0:
            object.__setattr__(self, "max_staleness", 0 if self.mode == "sync" else 2)
        if self.buffer_groups == 0:
            batches = max(4, self.lead_batches + 1)
            object.__setattr__(self, "buffer_groups", batches * self.batch_groups)
        if self.buffer_groups < self.batch_groups:
            raise ValueError(
                f"buffer_groups ({self.buffer_groups}) must hold at least one batch "
                f"(batch_groups = {self.batch_groups})"
            )
        if self.lead_batches > 0:
            self._check_lead()
        if self.in_flight_updates and self.mode == "sync":
            raise ValueError("in_flight_updates needs mode 'async' (sync trains on-policy)")
        if self.recompute_kv and not self.in_flight_updates:
            raise ValueError("recompute_kv applies to in_flight_updates: set that too")
        return self

    def _check_lead(self) -> None:
        # Every condition below would leave the learner waiting for a buffer level that
        # generation is never allowed to reach.
        if self.mode == "sync":
            raise ValueError("lead_batches needs mode 'async' (sync trains on-policy)")
        if self.lead_batches > self.max_staleness:
            raise ValueError(
                f"lead_batches ({self.lead_batches}) must not exceed max_staleness "
                f"({self.max_staleness}): older batches could never be trained"
            )
        needed = (self.lead_batches + 1) * self.batch_groups
        if self.buffer_groups < needed:
            raise ValueError(
                f"buffer_groups ({self.buffer_groups}) must hold lead_batches + 1 batches "
                f"({needed} groups)"
            )


class WandbTracking(StrictModel):
    """Weights & Biases: every metrics record as the W&B run's history, the resolved spec as its
    config. The API key comes from the environment (WANDB_API_KEY) or `wandb login`, never the
    spec."""

    project: NameText = Field(description="W&B project to log the run to")
    entity: NameText | None = Field(
        None, description="W&B team or user; default: the API key's default entity"
    )
    name: NameText | None = Field(
        None, description="W&B run name; default: the run id (RUN_DIR's name)"
    )
    mode: Literal["online", "offline", "disabled"] = Field(
        "online",
        description="online: stream to the W&B server; offline: files only, for `wandb sync` "
        "later; disabled: log nothing",
    )
    tags: tuple[NameItem, ...] = Field((), max_length=MAX_LIST_ITEMS, description="W&B run tags")
    dir: PathText | None = Field(
        None, description="W&B writes its files in DIR/wandb; default RUN_DIR"
    )


class MlflowTracking(StrictModel):
    """MLflow: every metrics record as the MLflow run's metrics, the resolved spec as its params.
    Server credentials come from the environment (MLFLOW_TRACKING_TOKEN, ...), never the spec."""

    tracking_uri: PathText | None = Field(
        None,
        description="MLflow tracking URI; default: MLFLOW_TRACKING_URI when set, else a file "
        "store in RUN_DIR/mlruns",
    )
    experiment: NameText = Field("kpo-rl", description="MLflow experiment (made if new)")
    run_name: NameText | None = Field(
        None, description="MLflow run name; default: the run id (RUN_DIR's name)"
    )


class TensorboardTracking(StrictModel):
    """TensorBoard: every metrics record as scalars of an event file, the resolved spec as text."""

    log_dir: PathText | None = Field(
        None, description="where the event files go; default RUN_DIR/tensorboard"
    )


class TrackingConfig(StrictModel):
    """Experiment trackers that mirror every metrics record (services/tracking), beside
    metrics.jsonl and Prometheus. Each is off when absent (null); `{}` turns one on with its
    defaults. They need the `tracking` extra: pip install 'kpo-rl[tracking]'."""

    wandb: WandbTracking | None = None
    mlflow: MlflowTracking | None = None
    tensorboard: TensorboardTracking | None = None


class EvalConfig(StrictModel):
    """Held-out evaluation during a run (services/pipeline/evaluation.py)."""

    every: int = Field(
        10,
        ge=1,
        le=MAX_STEPS,
        description="evaluate after every this many learner steps (and at the end)",
    )
    samples: int = Field(
        8, ge=1, le=256, description="k: responses per held-out prompt (avg@k, pass@k)"
    )
    temperature: float = Field(
        1.0, gt=0.0, le=MAX_TEMPERATURE, description="sampling temperature of evaluation"
    )
    # 16,384: more than the usual held-out sets (GSM8K's 1,319, MATH's 5,000, MMLU's 14,042),
    # each evaluated `samples` times at every eval.
    max_prompts: int = Field(
        64, ge=1, le=16_384, description="held-out prompts evaluated (the first ones)"
    )
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_RESPONSE_TOKENS,
        description="response length limit (default: generation.max_new_tokens)",
    )
    # Evaluation trains nothing, so its sampling may be truncated whatever training's is.
    top_p: float | None = Field(
        None, gt=0.0, le=1.0, description="nucleus sampling of evaluation (default: generation's)"
    )
    top_k: int | None = Field(
        None, ge=0, le=2**20, description="top-k of evaluation, 0 = off (default: generation's)"
    )


# Tool calls of one response, and model turns: verl's multi-turn agent loop and CTPO's
# tool-integrated setting use 5 turns; 256 is far past where a response still fits a context.
MAX_TOOL_TURNS = 256
# Characters of one tool observation: 1M characters is some 250K tokens, more than any context.
MAX_TOOL_OUTPUT_CHARS = 1_000_000
# Sandbox calls in flight at once per generation worker.
MAX_TOOL_CONCURRENCY = 1024
# Seconds of one sandbox call: a call blocks its response, and an hour already stalls a run.
MAX_TOOL_TIMEOUT_S = 3600.0


def _sandbox_url(value: str) -> str:
    # Checked here, so that a typo fails the spec rather than the first tool call of a run.
    scheme, sep, rest = value.partition("://")
    if scheme not in ("http", "https") or not sep or not rest or rest[0] in "/?#":
        raise ValueError(f"must be an http:// or https:// URL with a host, got {value!r}")
    if any(char.isspace() for char in value):
        raise ValueError("must not contain whitespace")
    return value


def _env_var_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise ValueError(
            f"must be the name of an environment variable (letters, digits, _), got {value!r}; "
            "the token itself never goes in the spec"
        )
    return value


SandboxUrl = Annotated[
    str, StringConstraints(max_length=MAX_PATH_CHARS), AfterValidator(_sandbox_url)
]
EnvVarName = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_env_var_name)
]


class ToolsConfig(StrictModel):
    """Tool-integrated rollouts (services/tools): decoding stops at a Python tool call, the
    sandbox runs it, its output is appended to the context as observation tokens (no
    log-prob, no loss) and decoding continues, until the response ends or a limit does (its
    finish reason says which). The sandbox's token comes from the environment variable
    `sandbox_token_env` names, never from the spec."""

    enabled: bool = Field(False, description="multi-turn rollouts with a Python tool")
    max_turns: int = Field(
        5,
        ge=1,
        le=MAX_TOOL_TURNS,
        description="model turns per response (a tool call ends a turn): a call made in the "
        "last turn is not run and the response ends with finish reason max_turns",
    )
    max_calls: int | None = Field(
        None,
        ge=0,
        le=MAX_TOOL_TURNS,
        description="tool calls run per response; a further call ends the response with "
        "finish reason max_calls; null: max_turns - 1 (one call per turn)",
    )
    max_context_tokens: int | None = Field(
        None,
        ge=1,
        le=2**20,
        description="prompt + response tokens (model and observation) of one response; "
        "reaching it ends the response with finish reason max_context; null: the model's "
        "context length. generation.max_new_tokens still counts model tokens only",
    )
    max_output_chars: int = Field(
        1000,
        ge=1,
        le=MAX_TOOL_OUTPUT_CHARS,
        description="characters of one observation (stdout, or the error's last line); "
        "longer output is truncated",
    )
    call_format: Literal["auto", "fenced", "hermes"] = Field(
        "auto",
        description="what a tool call looks like: fenced (a closed ```python block), hermes "
        '(<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>, '
        "the tool declared to the chat template) or auto (hermes when the model's chat "
        "template declares tools, else fenced)",
    )
    sandbox_url: SandboxUrl | None = Field(
        None,
        description="the sandbox server (kpo sandbox serve) the generation workers call, "
        "http(s)://host:port; null: a local pool of sandboxed processes in each worker",
    )
    sandbox_token_env: EnvVarName = Field(
        "KPO_SANDBOX_TOKEN",
        description="name of the environment variable that holds the sandbox server's bearer "
        "token (on the generation workers); unset: calls carry no token",
    )
    timeout_s: float = Field(
        5.0, gt=0.0, le=MAX_TOOL_TIMEOUT_S, description="wall-clock limit of one tool call"
    )
    max_concurrent_calls: int = Field(
        4,
        ge=1,
        le=MAX_TOOL_CONCURRENCY,
        description="tool calls in flight at once per generation worker (others queue; "
        "responses not waiting on a call keep decoding)",
    )

    @model_validator(mode="after")
    def _calls_fit_turns(self) -> ToolsConfig:
        if self.max_calls is None:
            object.__setattr__(self, "max_calls", self.max_turns - 1)
        return self


class RunSpec(StrictModel):
    """One RL run: the body of `POST /v1/runs` and the schema of a YAML run file."""

    name: str = Field(
        "run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$", description="a label for the run"
    )
    seed: int = Field(0, ge=0, le=MAX_SEED)
    model: PathText = Field(
        "tiny-arith",
        description="a built-in model name (tiny-arith), a local Hugging Face model directory, "
        "or a hub id (org/name), downloaded once by the driver into the Hugging Face cache",
    )
    model_revision: NameText | None = Field(
        None,
        description="branch, tag or commit of a hub model (default: main)",
    )
    task: TaskConfig = Field(default_factory=ArithTask)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    eval: EvalConfig | None = Field(
        None, description="held-out evaluation during the run (off when absent)"
    )
    tools: ToolsConfig = Field(
        default_factory=ToolsConfig,
        description="tool-integrated (multi-turn) rollouts with a sandboxed Python tool; off "
        "by default",
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig,
        description="experiment trackers (W&B, MLflow, TensorBoard) that mirror every metrics "
        "record; none by default",
    )

    @model_validator(mode="after")
    def _truncated_sampling_declared(self) -> RunSpec:
        # The learner's log-probs are of the full softmax (services/learner/logprobs.py): with
        # top-p/top-k the behaviour log-probs are of a renormalised subset, every on-policy
        # ratio falls below 1, and the loss is biased without a word. So it is a choice.
        if self.algorithm.off_policy.truncated_sampling == "allow":
            return self
        truncated = {
            "top_p": (self.generation.top_p, self.generation.top_p < 1.0, "< 1"),
            "top_k": (self.generation.top_k, self.generation.top_k > 0, "> 0"),
        }
        errors = [
            InitErrorDetails(
                type=PydanticCustomError(
                    "truncated_sampling",
                    "{value} {bound} truncates training sampling, but the learner's log-probs "
                    "are of the full softmax, so every importance ratio is biased (below 1 even "
                    "on-policy); sample training rollouts untruncated (top_p 1, top_k 0; "
                    "eval.top_p / eval.top_k truncate evaluation only), or declare it with "
                    "algorithm.off_policy.truncated_sampling: allow",
                    {"value": value, "bound": bound},
                ),
                loc=("generation", name),
                input=value,
            )
            for name, (value, is_truncated, bound) in truncated.items()
            if is_truncated
        ]
        if errors:
            raise ValidationError.from_exception_data("RunSpec", errors)
        return self

    @model_validator(mode="after")
    def _version_switch_needs_in_flight_updates(self) -> RunSpec:
        # A response's tokens come from several policy versions only when weights load between
        # decoding steps; without that every token of a response has one version, the switch
        # never fires, and a setting that does nothing would be read as one that works.
        switch = getattr(self.algorithm.estimator, "version_switch", "off")
        if switch == "off" or self.pipeline.in_flight_updates:
            return self
        message = (
            f"algorithm.estimator.version_switch: {switch} acts where a response's tokens were "
            "sampled by several policy versions, which happens only with "
            "pipeline.in_flight_updates: true; set it, or version_switch: off"
        )
        errors = [
            InitErrorDetails(
                type=PydanticCustomError("version_switch", message),
                loc=loc,
                input=value,
            )
            for loc, value in (
                (("algorithm", "estimator", "version_switch"), switch),
                (("pipeline", "in_flight_updates"), False),
            )
        ]
        raise ValidationError.from_exception_data("RunSpec", errors)

    @property
    def overlaps_publish(self) -> bool:
        """Whether each publish runs beside the next learner step (`pipeline.overlap_publish`
        where it applies: a sync run waits for every version to reach generation). A sharded
        learner gathers before the next step (a collective of the training ranks, ordered with
        the step's own) and puts or broadcasts beside it."""
        pipe = self.pipeline
        return pipe.overlap_publish and pipe.mode == "async"

    @model_validator(mode="after")
    def _minibatches_fit(self) -> RunSpec:
        rows = self.pipeline.batch_groups * self.generation.group_size
        if self.learner.minibatches > rows:
            raise ValueError(
                f"learner.minibatches ({self.learner.minibatches}) exceeds the responses in a "
                f"batch (pipeline.batch_groups x generation.group_size = {rows})"
            )
        return self
