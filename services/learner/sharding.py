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

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint as checkpoint_activations
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from services.learner.distributed import RankGroup
from services.learner.logprobs import ResponseLogProbs
from services.learner.lora import apply_lora
from services.spec import LearnerConfig


def decoder_layers(policy: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (`model.layers` and its kin)."""
    decoder = policy.get_decoder()  # type: ignore[operator]
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


def _load(model_path: str, on_meta: bool, attention: str) -> nn.Module:
    model: nn.Module
    if on_meta:
        config = AutoConfig.from_pretrained(model_path)
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
    train (services.learner.lora)."""
    sharded = learner.strategy == "fsdp2"
    on_meta = sharded and group.rank != 0
    policy = _load(model_path, on_meta, learner.attn_implementation).eval()
    if learner.lora is not None:
        # Before activation checkpointing and sharding, which wrap the modules PEFT replaces.
        policy = apply_lora(policy, learner.lora)
    # Flash-attention takes variable-length rows: micro-batches are packed, not padded.
    packed = learner.attn_implementation.startswith("flash_attention")
    model = ResponseLogProbs(policy, learner.logprob_chunk_tokens, packed)
    if learner.gradient_checkpointing:
        for layer in decoder_layers(policy):
            checkpoint_activations(layer)
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
