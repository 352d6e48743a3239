"""A tied variant of the tests' tiny Qwen2 (input embedding shared with the head), on disk."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.services.generation.tiny_model import build_tokenizer


def save_tied_model(directory: Path, seed: int = 0) -> Path:
    """Tokenizer, config and random weights of a tied tiny Qwen2, saved to `directory`."""
    tokenizer = build_tokenizer()
    config = Qwen2Config(  # type: ignore[call-arg]  # head_dim is accepted, not declared
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
