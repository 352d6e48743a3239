"""The `learner` section: the optimiser, the learner group, its memory and speed settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from kpo_core.config import StrictModel
from services.spec.bounds import (
    MAX_ACTORS,
    MAX_CPUS_PER_ACTOR,
    MAX_GPUS_PER_ACTOR,
    MAX_LIST_ITEMS,
    MAX_STEPS,
    MAX_TOKEN_BUDGET,
    AttnImplementation,
    CustomResources,
    NameItem,
    NameText,
)


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
        description="vocabulary entries per block of that projection (a log-sum-exp per block): "
        "the float32 logits held at once are logprob_chunk_tokens x this, forward and backward",
    )
    logprob_kernel: Literal["auto", "torch", "compiled"] = Field(
        "auto",
        description="how each block's elementwise work (softmax, log-sum-exp, entropy) runs: "
        "torch, eagerly; compiled, through torch.compile (needs a working compiler: Triton on "
        "CUDA, a C++ compiler on CPU); auto: compiled on CUDA where it compiles, else torch",
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
