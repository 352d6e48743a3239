"""The interface every generation backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from services.messages import Prompt, Response

# "processed": log-probs of the distribution actually sampled from (after temperature, top-k,
# top-p). This is the behaviour policy the importance ratio must be taken against.
LogprobsMode = Literal["processed"]


@dataclass(frozen=True)
class SamplingSettings:
    """How responses are sampled. Filled from the run config; read by the backend."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    max_new_tokens: int = 256
    seed: int | None = None


class GenerationBackend(ABC):
    """Samples groups of responses with behaviour log-probs and swaps weights in place."""

    logprobs_mode: LogprobsMode = "processed"

    @property
    @abstractmethod
    def policy_version(self) -> int:
        """Version of the weights currently loaded."""

    @abstractmethod
    def generate(
        self, prompts: list[Prompt], group_size: int, sampling: SamplingSettings
    ) -> list[list[Response]]:
        """Return `group_size` responses for each prompt, in prompt order."""

    @abstractmethod
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the model weights in place (no rebuild) and record their version."""


class StateDictMismatchError(ValueError):
    """A state dict whose keys or shapes do not match the live model's parameters."""


def validate_sampling(sampling: SamplingSettings, group_size: int) -> None:
    """Raise ValueError for settings that do not describe a sampling distribution."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if sampling.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {sampling.top_k}")
    if sampling.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")


def encode_prompts(tokenizer: Any, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Token ids of each prompt text with the tokenizer's default encoding (no padding).

    Every backend encodes through this function, so all of them see the same prompt ids.
    """
    encoded = tokenizer([prompt.text for prompt in prompts])["input_ids"]
    for prompt, ids in zip(prompts, encoded, strict=True):
        if not ids:
            raise ValueError(f"prompt {prompt.prompt_id!r} encodes to no tokens")
    return [list(ids) for ids in encoded]
