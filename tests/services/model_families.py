"""Tiny random models of the decoder families users train with RL, saved as a user's would be.

Each family is a transformers config class with the few settings that make it that family's
shape (its attention layout above all: sliding windows shorter than the rows the tests score,
per-layer-type windows, layers without rotary embeddings, logit soft-capping), at a size that
runs in milliseconds on a CPU. Every model is saved with the project's character tokenizer
(`tests.services.generation.tiny_model.build_tokenizer`) through `save_pretrained`, so backends
and learners load it through the ordinary `from_pretrained` path, as they load a hub model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig

from tests.services.generation.tiny_model import build_tokenizer

# Shorter than the rows the family tests score (a 4-token prompt and 40 response tokens), so a
# learner that ignores a window scores those rows wrong.
WINDOW = 8

# Shared by every family: two query heads on one key/value head (grouped-query attention, as
# every family below ships), head dimension 32.
COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 512,
    # Wider than the usual 0.02, so that log-probs are far from uniform and a wrong mask shows.
    "initializer_range": 0.2,
}


@dataclass(frozen=True)
class Family:
    """A decoder family: its config class and the settings that give it its layout."""

    name: str
    config_class: str  # a name in `transformers`
    settings: dict[str, Any]
    layers: int = 2

    def config(self, vocab_size: int, special_ids: dict[str, int]) -> PretrainedConfig:
        make: Callable[..., PretrainedConfig] = getattr(transformers, self.config_class)
        return make(
            vocab_size=vocab_size,
            num_hidden_layers=self.layers,
            **COMMON,
            **special_ids,
            **self.settings,
        )


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("llama", "LlamaConfig", {}),
        Family("mistral", "MistralConfig", {"sliding_window": None}),
        Family("mistral-window", "MistralConfig", {"sliding_window": WINDOW}),
        Family("qwen2", "Qwen2Config", {}),
        # Qwen2's own hybrid: full attention below max_window_layers, windowed above.
        Family(
            "qwen2-window",
            "Qwen2Config",
            {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        ),
        Family("qwen3", "Qwen3Config", {}),
        # Gemma 2: alternating sliding and full layers, attention and final logit soft-capping.
        Family("gemma2", "Gemma2Config", {"sliding_window": WINDOW, "query_pre_attn_scalar": 32}),
        # Gemma 3: five sliding layers to one full layer (here 1:1 over 2 layers), two rotary bases.
        Family(
            "gemma3",
            "Gemma3TextConfig",
            {"sliding_window": WINDOW, "sliding_window_pattern": 2, "query_pre_attn_scalar": 32},
        ),
        Family("phi3", "Phi3Config", {"sliding_window": WINDOW}),
        # Granite: logits divided by logits_scaling after the head (and scaled residuals).
        Family("granite", "GraniteConfig", {"logits_scaling": 4.0, "residual_multiplier": 0.5}),
        # SmolLM3: every fourth layer without rotary embeddings (NoPE; here every second).
        Family("smollm3", "SmolLM3Config", {"no_rope_layer_interval": 2}),
        # Llama 4 (text): chunked attention in its rotary layers, full attention without rotary
        # in every fourth, mixture-of-experts MLPs.
        Family(
            "llama4",
            "Llama4TextConfig",
            {
                "attention_chunk_size": WINDOW,
                "intermediate_size_mlp": 128,
                "num_local_experts": 2,
                "interleave_moe_layer_step": 2,
            },
            layers=4,
        ),
        # gpt-oss: alternating sliding and full layers whose softmax adds learned sinks.
        Family(
            "gpt-oss",
            "GptOssConfig",
            {"sliding_window": WINDOW, "num_local_experts": 2, "num_experts_per_tok": 1},
        ),
    )
}

# Refused by design: Qwen3-Next's linear-attention layers keep a recurrent state, which neither
# the learner's masks nor the hf engine's batched cache can hold.
REFUSED: dict[str, Family] = {
    "qwen3-next": Family("qwen3-next", "Qwen3NextConfig", {"num_experts": 2}, layers=4)
}


def family_ids(tokenizer: Any) -> dict[str, int]:
    return {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def save_family_config(name: str, directory: Path) -> Path:
    """Only the config (naming its causal-LM class) and the tokenizer of family `name`, as a
    model folder whose weights are never read: what a check before the run reads."""
    family = FAMILIES.get(name) or REFUSED[name]
    tokenizer = build_tokenizer()
    config = family.config(len(tokenizer), family_ids(tokenizer))
    config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_family_model(name: str, directory: Path, seed: int = 0) -> Path:
    """A random model of family `name` (float32) with the character tokenizer, in `directory`."""
    family = FAMILIES[name]
    tokenizer = build_tokenizer()
    config = family.config(len(tokenizer), family_ids(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
