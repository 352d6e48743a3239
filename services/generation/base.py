"""The interface every generation backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

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
