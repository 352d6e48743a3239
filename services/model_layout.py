"""What a decoder family's layers attend to and how its head turns states into logits, read from
its config: the one place the learner, the `hf` engine and the pre-run check ask.

A causal LM is scored right only if every layer gets the mask its family trains with: full
causal attention, a sliding window (Mistral, Phi-3, Qwen2's upper layers, Gemma 2 and 3's local
layers: a query sees the `span` keys ending at itself), or chunks (Llama 4: a query sees the keys
of its own `span`-token chunk, counted from the row's first token); layers without rotary
embeddings (SmolLM3, Llama 4) need no mask of their own, only the row's positions. Some families
also shape their logits: attention logits soft-capped (Gemma 2), final logits soft-capped
(Gemma 2) or scaled (Granite, Cohere), and some attend to learned sinks (gpt-oss).

The layer types are read as transformers reads them when it builds a model's cache
(`layer_types`, else one type for every layer from `sliding_window` or `attention_chunk_size`),
and the masks themselves are built with transformers' own mask functions
(`transformers.masking_utils`), so a window means here exactly what it means to the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    chunked_causal_mask_function,
    padding_mask_function,
    sliding_window_causal_mask_function,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
ATTENTION_KINDS = (FULL, SLIDING, CHUNKED)

# Families whose attention adds learned per-head sink logits to every softmax (transformers
# passes them to the attention function as `s_aux`; no config field says so).
SINK_FAMILIES = frozenset({"gpt_oss"})

MaskFunction = Callable[[Any, Any, Any, Any], Any]


class UnsupportedModel(ValueError):
    """A model the learner cannot score as it samples; the message names the model and why."""


@dataclass(frozen=True)
class LayerAttention:
    """What one decoder layer attends to: `kind` (transformers' layer type) and `span` (the
    window of a sliding layer, the chunk of a chunked one, None for full attention). A layer
    without rotary embeddings takes the same masks: only its positions differ, which the
    model reads from the row's position ids."""

    kind: str
    span: int | None = None

    def binds(self, length: int) -> bool:
        """Whether a row of `length` tokens sees fewer keys than plain causal attention."""
        return self.span is not None and length > self.span

    def mask_function(self, left_padding: torch.Tensor) -> MaskFunction:
        """transformers' mask function of this layer for rows whose first real token sits at
        column `left_padding[b]` (chunks count from there)."""
        if self.kind == SLIDING:
            assert self.span is not None
            return sliding_window_causal_mask_function(self.span)
        if self.kind == CHUNKED:
            assert self.span is not None
            return chunked_causal_mask_function(self.span, left_padding)
        return causal_mask_function

    def allowed(self, real: torch.Tensor, left_padding: torch.Tensor) -> torch.Tensor:
        """[B, 1, L, L] bool: which keys each query may attend, for rows whose real tokens are
        `real` [B, L]. A padding query attends every key, so that no softmax row is empty (NaN);
        real queries never see padding, so those rows reach nothing that is scored."""
        rows, length = real.shape
        device = real.device
        batch = torch.arange(rows, device=device)[:, None, None, None]
        head = torch.zeros(1, dtype=torch.long, device=device)[None, :, None, None]
        query = torch.arange(length, device=device)[None, None, :, None]
        key = torch.arange(length, device=device)[None, None, None, :]
        rule = and_masks(self.mask_function(left_padding), padding_mask_function(real))
        allowed: torch.Tensor = rule(batch, head, query, key).expand(rows, 1, length, length)
        return allowed | ~real[:, None, :, None]


@dataclass(frozen=True)
class ModelLayout:
    """A decoder's layers and the logit transforms of its family (module doc)."""

    model_type: str
    layers: tuple[LayerAttention, ...]
    attention_softcap: float | None = None
    final_softcap: float | None = None
    logit_multiplier: float = 1.0  # the head's logits are multiplied by this (Granite, Cohere)
    attention_sinks: bool = False
    supports_sdpa: bool = True

    @classmethod
    def of(cls, config: PretrainedConfig) -> ModelLayout:
        """The layout of a model of `config` (its text config, for a multimodal one)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        count = int(text.num_hidden_layers)
        kinds = list(getattr(text, "layer_types", None) or [_one_kind(text)] * count)
        layers = tuple(LayerAttention(kind, _span(text, kind)) for kind in kinds[:count])
        multiplier = float(getattr(text, "logit_scale", None) or 1.0)
        scaling = getattr(text, "logits_scaling", None)
        if scaling:
            multiplier /= float(scaling)
        return cls(
            model_type=str(text.model_type),
            layers=layers,
            attention_softcap=getattr(text, "attn_logit_softcapping", None),
            final_softcap=getattr(text, "final_logit_softcapping", None),
            logit_multiplier=multiplier,
            attention_sinks=text.model_type in SINK_FAMILIES,
            supports_sdpa=_supports_sdpa(config),
        )

    @property
    def kinds(self) -> dict[str, LayerAttention]:
        """One entry per layer type the decoder uses, in order of first use."""
        kinds: dict[str, LayerAttention] = {}
        for layer in self.layers:
            kinds.setdefault(layer.kind, layer)
        return kinds

    @property
    def hybrid(self) -> bool:
        """Layers of several types: the decoder takes a mask per type (a mapping keyed by type)."""
        return len(self.kinds) > 1

    def unsupported(self) -> str | None:
        """Why neither the learner nor the `hf` engine can score this model; None if they can."""
        for index, layer in enumerate(self.layers):
            if layer.kind not in ATTENTION_KINDS:
                return (
                    f"layer {index} is a {layer.kind!r} layer: the learner and the hf engine "
                    f"score attention layers only ({', '.join(ATTENTION_KINDS)})"
                )
            if layer.kind != FULL and (layer.span is None or layer.span < 1):
                return f"layer {index} is a {layer.kind!r} layer without a size in its config"
        spans = {(layer.kind, layer.span) for layer in self.layers}
        if len(spans) != len(self.kinds):
            return "layers of one type have different windows: a mask per layer type cannot serve"
        return None

    def packing_problem(self, device_type: str, varlen_window: bool) -> str | None:
        """Why a micro-batch's rows cannot be packed into one sequence for this model on
        `device_type` (`varlen_window`: torch's variable-length kernel takes a window); None
        if they can. Off CUDA every row is attended on its own, with its mask, soft-cap and
        all; on CUDA the variable-length kernel does causal attention and sliding windows."""
        if self.attention_sinks:
            return f"{self.model_type} attends to learned sinks, which packing does not add"
        if device_type != "cuda":
            return None
        if self.attention_softcap is not None:
            return "its attention logits are soft-capped, which the varlen kernel cannot do"
        if CHUNKED in self.kinds:
            return "its chunked attention layers are not a window the varlen kernel takes"
        if SLIDING in self.kinds and not varlen_window:
            return "this torch's variable-length kernel takes no sliding window (torch 2.11+ does)"
        return None

    def attention_for(self, requested: str) -> str:
        """The attention implementation to load the model with for `requested`: eager where
        SDPA cannot run the family as it trains: soft-capped attention logits (Gemma 2; SDPA
        has no soft-cap, and transformers before 5.2x let it run such a model without one), or
        a family transformers says SDPA does not serve."""
        if requested == "sdpa" and (not self.supports_sdpa or self.attention_softcap is not None):
            return "eager"
        return requested

    def padded_masks(
        self, real: torch.Tensor, left_padding: torch.Tensor, additive: torch.dtype | None
    ) -> dict[str, torch.Tensor]:
        """The mask of every layer type for rows `real` [B, L] (bool): [B, 1, L, L], boolean,
        or additive (0 / min of `additive`) for eager attention."""
        masks = {}
        for kind, layer in self.kinds.items():
            allowed = layer.allowed(real, left_padding)
            if additive is not None:
                zeros = torch.zeros(allowed.shape, dtype=additive, device=allowed.device)
                masks[kind] = zeros.masked_fill(~allowed, torch.finfo(additive).min)
            else:
                masks[kind] = allowed
        return masks


def _one_kind(config: PretrainedConfig) -> str:
    """The layer type of every layer of a config without `layer_types`, as transformers' cache
    reads it: a window makes every layer sliding (Mistral, Phi-3), a chunk size chunked."""
    if getattr(config, "sliding_window", None) is not None:
        return SLIDING
    if getattr(config, "attention_chunk_size", None) is not None:
        return CHUNKED
    return FULL


def _span(config: PretrainedConfig, kind: str) -> int | None:
    if kind == SLIDING:
        return getattr(config, "sliding_window", None)
    if kind == CHUNKED:
        return getattr(config, "attention_chunk_size", None)
    return None


def _supports_sdpa(config: PretrainedConfig) -> bool:
    """Whether the family's causal-LM class runs under SDPA (transformers' own flag)."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    model_class = getattr(transformers, name, None) if isinstance(name, str) else None
    return bool(getattr(model_class, "_supports_sdpa", True))


def check_causal_lm(config: PretrainedConfig, name: str) -> ModelLayout:
    """The layout of the model `name` of `config`, or UnsupportedModel saying why it cannot be
    trained here (read from the config alone: no weights are loaded)."""
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModel(
            f"{name}: transformers has no causal LM for model type {config.model_type!r}"
        )
    if not getattr(config, "is_causal", True):
        raise UnsupportedModel(f"{name}: its config makes attention bidirectional (is_causal)")
    layout = ModelLayout.of(config)
    problem = layout.unsupported()
    if problem is not None:
        raise UnsupportedModel(f"{name} ({config.model_type}): {problem}")
    return layout
