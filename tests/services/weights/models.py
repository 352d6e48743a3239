"""A tied variant of the tests' tiny Qwen2 (input embedding shared with the head), on disk."""

from __future__ import annotations

from pathlib import Path

from tests.services.generation.tiny_model import build_model, build_tokenizer


def save_tied_model(directory: Path, seed: int = 0) -> Path:
    """Tokenizer, config and random weights of a tied tiny Qwen2, saved to `directory`."""
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed, tied=True).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
