"""LoRA on the learner's policy (`learner.lora`): PEFT adapters, and the merged weights published.

`apply_lora` wraps the Hugging Face model with PEFT (`get_peft_model`): each targeted module
becomes a LoRA layer that holds the frozen base module plus two small trainable matrices A [r, in]
and B [out, r] (B starts at zero, so version 0 is the base model). Only A and B require grad, so
the optimiser, the gradients and the checkpoints are adapter-sized; the base weights stay exactly
those read from `model`.

Generation never sees PEFT: `MergedWeights` is what is published, the base model's tensors under
their Hugging Face names, each adapted weight merged on the way out (W + alpha/r * B @ A, what
`merge_and_unload` computes), so every backend loads a version as it loads a full fine-tune.

The learner keeps the model in eval mode (see `services.learner.step`); adapter dropout is
switched on by a hook for forwards that build a graph, so it applies to the training forwards
and never to the proximal log-probs taken under no_grad.

PEFT is imported only where adapters are made or read: a learner without `learner.lora` (and
the GPU check on a bare machine) needs no PEFT installed. A model can only be a PEFT model once
PEFT has been imported, which is what `is_adapted` relies on.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import Tensor, nn

from services.learner.publish import Gather, module_sources, tied_names
from services.spec import LoraConfig

if TYPE_CHECKING:
    import peft
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

ADAPTER_DIR = "adapter"  # in a learner checkpoint: the adapter's config; beside an export: it
ADAPTER_CONFIG = "adapter_config.json"
BASE_LAYER = "base_layer."  # PEFT's name for the wrapped module inside a LoRA layer


def is_adapted(model: nn.Module) -> TypeGuard[PeftModel]:
    """Whether `model` is a PEFT model (without importing PEFT where nothing has)."""
    loaded = sys.modules.get("peft")
    return loaded is not None and isinstance(model, loaded.PeftModel)


def to_peft_config(config: LoraConfig) -> peft.LoraConfig:
    """The PEFT configuration of `learner.lora` (target names match as suffixes of module names)."""
    import peft

    return peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,  # type: ignore[arg-type]  # PEFT divides it by r: any float
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(policy: nn.Module, config: LoraConfig) -> PeftModel:
    """`policy` with adapters on the modules of `config.target_modules`, in eval mode; only
    the adapters' parameters require grad. PEFT names the modules it could not match."""
    from peft import get_peft_model

    model = get_peft_model(policy, to_peft_config(config))
    model.eval()
    # Only the adapters' dropout is toggled; the base model's own stays off.
    for layer in lora_layers(model).values():
        for dropout in layer.lora_dropout.values():
            if isinstance(dropout, nn.Dropout):
                dropout.register_forward_pre_hook(_dropout_while_training)
    return model


def _dropout_while_training(module: nn.Module, args: object) -> None:
    """Dropout in forwards that build a graph (training), none under no_grad (references)."""
    module.train(torch.is_grad_enabled())


def lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    """The LoRA layers of `model` by module name."""
    if "peft" not in sys.modules:
        return {}  # no PEFT loaded: no layer of it either
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable (adapter) parameters of `model` by name."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def base_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT model (its config, generation config); else itself."""
    if is_adapted(model):
        inner: nn.Module = model.get_base_model()
        return inner
    return model


class MergedWeights:
    """The published view of a PEFT model (`services.learner.publish.WeightView`): the base
    model's state dict under its Hugging Face names, adapted weights merged when gathered."""

    def __init__(self, model: PeftModel) -> None:
        self._model = base_model(model)
        layers = lora_layers(self._model)
        # Hugging Face name of each adapted weight -> its LoRA layer.
        self._merged = {f"{name}.weight": layer for name, layer in layers.items()}
        self._prefixes = {f"{name}.": name for name in layers}

    def published_name(self, name: str) -> str | None:
        """The Hugging Face name of a state-dict entry of the PEFT-wrapped model; None for an
        adapter's own tensors (lora_A, lora_B, ...), which are never published."""
        for prefix, layer in self._prefixes.items():
            if name.startswith(prefix):
                rest = name.removeprefix(prefix)
                if not rest.startswith(BASE_LAYER):
                    return None
                return f"{layer}.{rest.removeprefix(BASE_LAYER)}"
        return name

    def tensors(self) -> dict[str, Tensor]:
        published: dict[str, Tensor] = {}
        for name, tensor in module_sources(self._model).items():
            renamed = self.published_name(name)
            if renamed is not None:
                published[renamed] = tensor
        return published

    def aliases(self) -> dict[str, str]:
        renamed = {
            self.published_name(alias): self.published_name(name)
            for alias, name in tied_names(self._model).items()
        }
        return {
            alias: name for alias, name in renamed.items() if alias is not None and name is not None
        }

    def whole(self, name: str, tensor: Tensor, gather: Gather) -> Tensor:
        """The whole published tensor `name`: the gathered base weight, plus the adapters'
        delta (`get_delta_weight`, as `merge_and_unload` adds it) for an adapted one."""
        full = gather(tensor)
        layer = self._merged.get(name)
        if layer is None:
            return full
        for adapter in layer.active_adapters:
            full = full + layer.get_delta_weight(adapter)  # type: ignore[attr-defined]
        return full


def write_adapter_config(model: PeftModel, learner_dir: Path) -> None:
    """Write the adapter's PEFT config (with the base model's path) into `learner_dir`/adapter:
    the export rebuilds the adapter from it and the checkpoint's adapter weights."""
    directory = learner_dir / ADAPTER_DIR
    directory.mkdir(parents=True, exist_ok=True)
    model.peft_config[model.active_adapter].save_pretrained(str(directory))


def is_adapter_checkpoint(learner_dir: Path) -> bool:
    """Whether a learner checkpoint holds LoRA adapters rather than the full weights."""
    return (learner_dir / ADAPTER_DIR / ADAPTER_CONFIG).is_file()
