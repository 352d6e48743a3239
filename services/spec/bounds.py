"""The run spec's upper bounds and the field types its sections share.

Every count, list and free-text string of a spec has an upper bound (the MAX_* constants): a run
spec may come from any client of the API, and none may ask the cluster for an unbounded amount
of work, memory, disk or scheduling. The bounds are far above what a run of a 4B-8B model on a
large GPU cluster asks for; past one, the error names the field and the bound.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    StringConstraints,
    ValidationError,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

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
# Ids of one token's kept set that truncated-sampling replay records (generation.replay_max_kept):
# the learner's batch holds [responses, tokens, this many] int64 ids (32 KiB a token at the
# bound), and a set that large is hardly truncated any more.
MAX_REPLAY_KEPT = 4096

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


def field_error(
    model: str, kind: str, loc: tuple[str | int, ...], message: str, value: Any
) -> ValidationError:
    """A validation error of `model` at `loc` (within the model that raises it) saying
    `message`: what a model validator raises to name the one field a rule across several
    fields blames (`kind`: the error's type)."""
    details = InitErrorDetails(
        type=PydanticCustomError(kind, "{message}", {"message": message}), loc=loc, input=value
    )
    return ValidationError.from_exception_data(model, [details])
