"""Accuracy of a model measured the way RL sees it: one sample per prompt at temperature 1,
drawn through the generation backend that runs sample with.

Every evaluation samples through a `GenerationBackend` (the `hf` backend for a model on disk or
in training), never through `model.generate`: the same prompt encoding, the same sampler (the
full softmax at `temperature`, no top-k or top-p truncation: the RL policy's distribution), the
same multi-turn rollout when the backend has tools enabled. Held-out evaluation during a run
(services.pipeline.evaluation) asks the run's generation workers, whose backends do the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.generation.base import GenerationBackend, SamplingSettings
from services.messages import Prompt, Response
from services.tasks.answers import is_correct


def sample_responses(
    backend: GenerationBackend,
    prompts: Sequence[Prompt],
    *,
    seed: int,
    max_new_tokens: int,
    temperature: float = 1.0,
) -> list[Response]:
    """One response per prompt, in prompt order, sampled from the full softmax at
    `temperature`; the draws depend only on `seed`, the prompts and the weights."""
    sampling = SamplingSettings(
        temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens, seed=seed
    )
    return [group[0] for group in backend.generate(list(prompts), 1, sampling)]


def sampled_accuracy(
    backend: GenerationBackend,
    prompts: Sequence[Prompt],
    *,
    seed: int,
    max_new_tokens: int,
    temperature: float = 1.0,
) -> float:
    """Fraction of prompts whose sampled response ends in `####<answer>`."""
    if not prompts:
        raise ValueError("sampled_accuracy needs at least one prompt")
    responses = sample_responses(
        backend, prompts, seed=seed, max_new_tokens=max_new_tokens, temperature=temperature
    )
    correct = [is_correct(r.text, p.answer) for r, p in zip(responses, prompts, strict=True)]
    return sum(correct) / len(prompts)
