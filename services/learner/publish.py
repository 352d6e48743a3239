"""The weights a learner publishes to generation: full tensors, in the compute dtype, on CPU.

Under FSDP2 every rank takes part in gathering the full state dict; rank 0 receives it (moved to
CPU tensor by tensor, so the device never holds more than one full tensor beyond its shard) and
the other ranks return an empty dict. Tied parameters (the input embedding and the head of most
small models) are published once, as one tensor under each of their names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from services.learner.distributed import RankGroup


def tied_names(model: nn.Module) -> dict[str, str]:
    """name -> the first name of the same parameter, for every alias of a tied parameter."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        key = id(parameter)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def full_state_dict(model: nn.Module, dtype: torch.dtype, group: RankGroup) -> dict[str, Tensor]:
    """Detached CPU copies of `model`'s full state dict in `dtype` (floating tensors only; on
    rank 0, empty elsewhere)."""
    aliases = tied_names(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if dist.is_initialized():  # sharded (FSDP2): gathered from every rank
        state = get_model_state_dict(model, options=options)
    else:
        state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    if group.rank != 0:
        return {}
    out: dict[str, Tensor] = {}
    for name, value in state.items():
        if name in aliases:
            continue
        tensor = value if isinstance(value, Tensor) else torch.as_tensor(value)
        cast = tensor.to(dtype) if tensor.is_floating_point() else tensor
        out[name] = cast.to("cpu", copy=True)
    for alias, name in aliases.items():
        if name in out:
            out[alias] = out[name]
    return out
