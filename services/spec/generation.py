"""The `generation` section: the generation actors, their backend and its options, sampling."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from kpo_core.config import StrictModel
from services.generation.engine_args import engine_arg_errors
from services.generation.registry import backend_names, backend_options
from services.spec.bounds import (
    MAX_ACTORS,
    MAX_CPUS_PER_ACTOR,
    MAX_GPUS_PER_ACTOR,
    MAX_GROUP_SIZE,
    MAX_PATH_CHARS,
    MAX_PROMPTS_PER_BATCH,
    MAX_REPLAY_KEPT,
    MAX_RESPONSE_TOKENS,
    MAX_SEED,
    MAX_TEMPERATURE,
    AttnImplementation,
    CustomResources,
    field_error,
)

if TYPE_CHECKING:
    BackendName = str
else:
    # A Literal built from the registry: the JSON schema lists the names, and pydantic's error
    # for a bad one names the valid ones.
    BackendName = Literal[tuple(backend_names())]


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


def _actors_error(loc: tuple[str | int, ...], message: str, value: Any) -> ValidationError:
    return field_error("GenerationConfig", "elastic_pool", loc, message, value)


class ElasticActors(StrictModel):
    """An elastic pool of generation workers (`generation.actors: {min, max}`): the driver
    adds a worker while the learner starves for data and removes one while scored groups wait
    for the learner, within [min, max] (services/pipeline/elastic_policy.py)."""

    min: int = Field(ge=1, le=MAX_ACTORS, description="the fewest generation workers")
    max: int = Field(ge=1, le=MAX_ACTORS, description="the most generation workers")
    window_s: float = Field(
        60.0,
        gt=0.0,
        le=86400.0,
        description="seconds of evidence behind each decision: the fractions below are "
        "measured over the last window_s seconds, and a decision waits for a full window",
    )
    cooldown_s: float = Field(
        120.0,
        ge=0.0,
        le=86400.0,
        description="seconds after a decision during which no other is taken (a new worker "
        "needs time to start and to show its effect)",
    )
    grow_idle_fraction: float = Field(
        0.3,
        gt=0.0,
        le=1.0,
        description="add a worker when the learner waited for data at least this fraction "
        "of the window",
    )
    shrink_full_fraction: float = Field(
        0.8,
        gt=0.0,
        le=1.0,
        description="remove a worker when admission was closed with a batch waiting for the "
        "learner at least this fraction of the window",
    )

    @model_validator(mode="after")
    def _ordered(self) -> ElasticActors:
        if self.max < self.min:
            raise _actors_error(
                ("max",), f"must be at least min ({self.min}), got {self.max}", self.max
            )
        return self


class GenerationConfig(StrictModel):
    """Generation actors: how many, where, and how they sample."""

    backend: BackendName = "hf"
    num_workers: int = Field(1, ge=1, le=MAX_ACTORS, description="generation actors")
    standby: int = Field(
        0,
        ge=0,
        le=MAX_ACTORS,
        description="warm standby generation actors: each loads the model and receives every "
        "weight publish but takes no prompts, and takes a lost worker's place at once (one "
        "more model's resources per standby)",
    )
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
    actors: ElasticActors | None = Field(
        None,
        description="an elastic pool: {min, max} workers (num_workers is the starting size, "
        "within them), grown and shrunk by the driver from the learner's idleness and the "
        "buffer's fullness; none: a fixed pool of num_workers",
    )
    temperature: float = Field(1.0, gt=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # 2^20: above any vocabulary (Gemma 3's is 262,144); a larger k keeps every token anyway.
    top_k: int = Field(0, ge=0, le=2**20, description="0 = no top-k truncation")
    min_p: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="keep the tokens whose probability is at least min_p times the most likely "
        "token's (applied before top-k and top-p, as vLLM does); 0 = off",
    )
    replay_max_kept: int = Field(
        256,
        ge=1,
        le=MAX_REPLAY_KEPT,
        description="truncated-sampling replay: the largest kept set recorded per token; a "
        "token whose set is larger is dropped from the loss (counted in "
        "replay_dropped_tokens), never trained on a wrong set",
    )
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

    @model_validator(mode="after")
    def _starting_size_within_the_pool(self) -> GenerationConfig:
        pool = self.actors
        if pool is not None and not pool.min <= self.num_workers <= pool.max:
            raise _actors_error(
                ("num_workers",),
                f"the starting size of the elastic pool must lie within actors.min and "
                f"actors.max ([{pool.min}, {pool.max}]), got {self.num_workers}",
                self.num_workers,
            )
        if pool is not None and self.standby:
            # Standby streams sit after the serving ones, and an elastic pool grows and shrinks
            # at the end of the serving ones: the two would move each other's places. A worker
            # the pool adds starts from the learner's whole weights instead.
            raise _actors_error(
                ("standby",),
                "generation.standby cannot be combined with an elastic pool "
                "(generation.actors): set one of them",
                self.standby,
            )
        return self

    @property
    def max_workers(self) -> int:
        """The most generation workers the run may hold at once (what it may reserve)."""
        return self.num_workers if self.actors is None else self.actors.max

    @field_validator("engine")
    @classmethod
    def _engine_arguments_allowed(cls, engine: dict[str, JsonValue]) -> dict[str, JsonValue]:
        # An allowlist (services/generation/engine_args.py): other arguments load code by name.
        errors = engine_arg_errors(engine, backend_options("vllm"))
        if errors:
            # Raised as a ValidationError so each error's location is generation.engine.<name>.
            raise ValidationError.from_exception_data("GenerationConfig.engine", errors)
        return engine

    @property
    def truncated(self) -> dict[str, tuple[float, str]]:
        """The settings that truncate sampling: name -> (value, what makes it truncate)."""
        candidates = {
            "top_p": (self.top_p, self.top_p < 1.0, "< 1"),
            "top_k": (self.top_k, self.top_k > 0, "> 0"),
            "min_p": (self.min_p, self.min_p > 0.0, "> 0"),
        }
        return {name: (value, bound) for name, (value, on, bound) in candidates.items() if on}


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
