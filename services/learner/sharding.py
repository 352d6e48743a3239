"""Building the learner's model: fp32 master weights, activation checkpointing, FSDP2 sharding.

`single`: the whole model on one device in float32; with `compute_dtype: bfloat16` the forward
and backward run under autocast (`compute_context`), so AdamW updates float32 weights (at lr 1e-6
a bfloat16 weight would round most updates away).

`fsdp2`: `fully_shard` on every decoder layer and on the root (`ResponseLogProbs`, which holds
the embedding, final norm and head), with `MixedPrecisionPolicy(param_dtype=compute_dtype,
reduce_dtype=float32)`: each rank keeps 1/W of the float32 parameters, gradients and AdamW
state, gathers a layer's parameters in the compute dtype for its forward and backward, and
reduce-scatters gradients in float32. Gradients are summed over ranks, not averaged: the loss of
each rank's rows is already normalised by the whole minibatch's counts.

Only rank 0 reads the checkpoint from disk; the other ranks build the model on the meta device
and receive the weights by broadcast while sharding, so a node of 8 ranks holds one full copy in
host memory at start-up, not eight.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint as checkpoint_activations
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from services.learner.distributed import RankGroup
from services.learner.logprobs import ResponseLogProbs, decoder_of
from services.learner.lora import apply_lora
from services.learner.packed_attention import (
    register_learner_attention,
    varlen_problem,
    varlen_takes_window,
)
from services.learner.toolchain import compile_problem
from services.model_layout import ModelLayout
from services.spec import LearnerConfig

log = logging.getLogger(__name__)


def decoder_layers(policy: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (`model.layers` and its kin)."""
    decoder = decoder_of(policy)
    for name in ("layers", "h", "blocks"):
        layers = getattr(decoder, name, None)
        if isinstance(layers, nn.ModuleList):
            return list(layers)
    raise ValueError(
        f"cannot find the decoder layers of {type(policy).__name__} (looked for layers, h, "
        "blocks): fsdp2 and gradient_checkpointing need them"
    )


def compute_dtype(learner: LearnerConfig) -> torch.dtype:
    dtype: torch.dtype = getattr(torch, learner.compute_dtype)
    return dtype


def packing_problem(
    learner: LearnerConfig, device: torch.device, layout: ModelLayout
) -> str | None:
    """Why this learner cannot pack the model's rows on `device` by what the model and this
    torch allow; None if it can. flash-attention packs any family it serves itself (windows and
    soft-caps included). Whether the kernel runs on the device itself is `kernel_problem`'s,
    asked where the learner runs (this is also asked by the driver, which may have no GPU)."""
    if learner.attn_implementation.startswith("flash_attention"):
        return None
    return layout.packing_problem(device.type, varlen_takes_window())


def kernel_problem(learner: LearnerConfig, device: torch.device) -> str | None:
    """Why the kernel packed rows would run through cannot run on `device`; None if it can, or
    where no probe is needed: torch's variable-length kernel serves bfloat16 compute on CUDA
    (probed once per device: `varlen_problem`); flash-attention, and per-row attention (CPU,
    float32 compute), are not probed."""
    varlen = (
        device.type == "cuda"
        and learner.compute_dtype == "bfloat16"
        and not learner.attn_implementation.startswith("flash_attention")
    )
    return varlen_problem(device) if varlen else None


def pack_rows(learner: LearnerConfig, device: torch.device, layout: ModelLayout) -> bool:
    """Whether micro-batches are packed without padding: as set (ValueError saying why where the
    model cannot be, or the kernel does not run on `device`), or with `auto` where a
    variable-length kernel runs them (CUDA with SDPA, bfloat16 compute and torch's varlen
    attention where a probe of it ran on the device, or flash-attention) and the model's layout
    allows it; padded elsewhere, where per-row attention would be slower than padding."""
    problem = packing_problem(learner, device, layout)
    if learner.pack_rows is True:
        problem = problem or kernel_problem(learner, device)
        if problem is not None:
            raise ValueError(f"learner.pack_rows: {layout.model_type} cannot be packed: {problem}")
        return True
    if learner.pack_rows is False or problem is not None:
        return False
    if learner.attn_implementation.startswith("flash_attention"):
        return True
    if not (
        device.type == "cuda"
        and learner.attn_implementation == "sdpa"
        and learner.compute_dtype == "bfloat16"
    ):
        return False
    problem = kernel_problem(learner, device)
    if problem is not None:
        log.warning("learner.pack_rows: auto pads the rows: %s", problem)
    return problem is None


def attention_implementation(learner: LearnerConfig, packed: bool, layout: ModelLayout) -> str:
    """The policy's attention: flash-attention as set (it packs by itself); packed rows, and
    padded rows of a family that runs under SDPA, through `LEARNER_ATTENTION` (the masks are the
    learner's own); eager where the family does not run under SDPA (`ModelLayout.attention_for`)
    or where it is asked for."""
    requested = learner.attn_implementation
    if requested.startswith("flash_attention"):
        return requested
    if packed or layout.attention_for(requested) == "sdpa":
        return register_learner_attention()
    return layout.attention_for(requested)


def compile_layers(policy: nn.Module) -> None:
    """Compile each decoder layer on its own (regional compilation): the layers share one
    code object, so one compilation serves them all, and a graph break stays inside a layer.
    Shapes vary with the micro-batch; dynamic shapes after the first recompilation keep that
    to a few compilations, and packed rows are rounded to a few lengths
    (`logprobs.COMPILED_LENGTH_MULTIPLE`)."""
    for layer in decoder_layers(policy):
        layer.compile()


def _load(model_path: str, config: PretrainedConfig, on_meta: bool, attention: str) -> nn.Module:
    model: nn.Module
    if on_meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, dtype=torch.float32, attn_implementation=attention
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation=attention
        )
    return model


def build_policy(
    model_path: str, learner: LearnerConfig, group: RankGroup, device: torch.device
) -> ResponseLogProbs:
    """The learner's model (see module doc), in eval mode: dropout stays off, or even on-policy
    ratios would not be 1. With `learner.lora` the policy is a PEFT model whose adapters alone
    train (services.learner.lora). ValueError, before anything loads, where `learner.compile`
    cannot build its code on this machine (services.learner.toolchain)."""
    if learner.compile and (problem := compile_problem(device.type)) is not None:
        raise ValueError(f"learner.compile: {problem}")
    sharded = learner.strategy == "fsdp2"
    on_meta = sharded and group.rank != 0
    config = AutoConfig.from_pretrained(model_path)
    layout = ModelLayout.of(config)
    packed = pack_rows(learner, device, layout)
    attention = attention_implementation(learner, packed, layout)
    policy = _load(model_path, config, on_meta, attention).eval()
    if learner.lora is not None:
        # Before activation checkpointing and sharding, which wrap the modules PEFT replaces.
        policy = apply_lora(policy, learner.lora)
    model = ResponseLogProbs(
        policy,
        learner.logprob_chunk_tokens,
        learner.logprob_vocab_chunk,
        kernel=learner.logprob_kernel,
        packed=packed,
        flash=learner.attn_implementation.startswith("flash_attention"),
        compiled=learner.compile,
        layout=layout,
    )
    if learner.gradient_checkpointing:
        for layer in decoder_layers(policy):
            checkpoint_activations(layer)
    if learner.compile:
        # After activation checkpointing (recomputation replays the compiled layer) and
        # before sharding (FSDP2's hooks stay outside the compiled region), as torchtitan does.
        compile_layers(policy)
    if not sharded:
        return model.to(device)
    full_state = None if on_meta else policy.state_dict()
    mesh = init_device_mesh(device.type, (group.world_size,))
    precision = MixedPrecisionPolicy(param_dtype=compute_dtype(learner), reduce_dtype=torch.float32)
    for layer in decoder_layers(policy):
        fully_shard(layer, mesh=mesh, mp_policy=precision)
    fully_shard(model, mesh=mesh, mp_policy=precision)
    if on_meta:
        model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(policy, full_state or {}, options=options)
    # Non-persistent buffers (rotary frequencies) are in no state dict: rank 0's are sent too.
    for buffer in model.buffers():
        dist.broadcast(buffer.data, src=0)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling anyway.
            module.set_force_sum_reduction_for_comms(True)
    return model


def compute_context(learner: LearnerConfig, device: torch.device) -> AbstractContextManager[None]:
    """Autocast to the compute dtype for a `single` bfloat16 learner (FSDP2 casts by itself)."""
    if learner.strategy == "single" and learner.compute_dtype != "float32":
        return torch.autocast(device.type, dtype=compute_dtype(learner))
    return nullcontext()
