"""Held-out evaluation of a model directory: one sample per unseen prompt, paired across models.

Every model answers the same prompts with the same sampling seed, so differences between two
models (a checkpoint and the starting weights) are paired and far less noisy than either value.
Besides accuracy, each evaluation measures what a collapse looks like: the fraction of responses
that run into the length limit, and how far the policy has moved from the starting model (the
KL divergence KL(pi || pi_start) per response token, estimated on the checkpoint's own samples).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.generation.hf_backend import HFBackend
from services.messages import Response
from services.spec import ArithTask, RunSpec
from services.tasks import generate_prompts
from services.tasks.answers import is_correct
from services.tasks.models import resolve_model
from services.tasks.sampling_eval import sample_responses

EVAL_PROMPT_SEED = 99
EVAL_SAMPLING_SEED = 7


@dataclass(frozen=True)
class Evaluation:
    """One model on the held-out prompts."""

    accuracy: float
    truncated: float  # fraction of responses without EOS within max_new_tokens
    kl_from_start: float  # KL(pi || pi_start) per response token (k3 estimator)

    def as_json(self) -> dict[str, float]:
        return {
            "accuracy": self.accuracy,
            "truncated": self.truncated,
            "kl_from_start": self.kl_from_start,
        }


def _token_log_probs(model: PreTrainedModel, response: Response, temperature: float) -> Tensor:
    """log pi(token) of each token of `response` under `model` at the sampling temperature, [N].

    One full forward pass for either model: the two sides of the ratio are computed alike, so
    a model measured against itself is exactly 0 apart (the sampler's own log-probs come from
    incremental decoding, equal only up to rounding)."""
    prompt, sampled = response.prompt_token_ids, response.response_token_ids
    input_ids = torch.tensor([prompt + sampled], device=model.device)
    logits = model(input_ids=input_ids).logits[0]
    # The logits at position t predict token t + 1.
    predicting = logits[len(prompt) - 1 : -1].float() / temperature
    tokens = torch.tensor(sampled, device=model.device).unsqueeze(-1)
    return torch.log_softmax(predicting, -1).gather(-1, tokens).squeeze(-1)


def _load(model_dir: str | Path, device: str) -> PreTrainedModel:
    # float32, as the sampling backend loads the evaluated model: both sides of the ratio alike.
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train(False)
    return model.to(device)  # type: ignore[arg-type, no-any-return]  # transformers' wrapped `to`


class HeldOutEvaluator:
    """Accuracy, truncation and drift on `num_prompts` held-out prompts of the arithmetic task.

    Sampling follows the run: its temperature and max_new_tokens, no top-k or top-p.
    """

    def __init__(self, spec: RunSpec, num_prompts: int, device: str = "cpu") -> None:
        if not isinstance(spec.task, ArithTask):
            raise ValueError(
                "held-out accuracy needs the built-in arith task (its eval split never "
                f"overlaps training); this spec's task is {spec.task.name!r}"
            )
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        self.prompts = generate_prompts(
            num_prompts, seed=EVAL_PROMPT_SEED, difficulty=spec.task.difficulty, split="eval"
        )
        self.spec = spec
        self.device = device

    @cached_property
    def _start_model(self) -> PreTrainedModel:
        return _load(resolve_model(self.spec.model), self.device)

    def evaluate(self, model_dir: str | Path) -> Evaluation:
        # Sampled by the hf generation backend, as the run's own workers sample.
        backend = HFBackend(str(model_dir), device=self.device, dtype=torch.float32)
        gen = self.spec.generation
        responses = sample_responses(
            backend,
            self.prompts,
            seed=EVAL_SAMPLING_SEED,
            max_new_tokens=gen.max_new_tokens,
            temperature=gen.temperature,
        )
        correct = sum(
            is_correct(r.text, p.answer) for r, p in zip(responses, self.prompts, strict=True)
        )
        ended = sum(r.finish_reason == "stop" for r in responses)
        kl_sum, tokens = 0.0, 0
        with torch.no_grad():
            for response in responses:
                start = _token_log_probs(self._start_model, response, gen.temperature)
                log_ratio = start - _token_log_probs(backend.model, response, gen.temperature)
                # k3 = (r - 1) - log r with r = pi_start / pi: unbiased and never negative.
                kl_sum += float((log_ratio.exp() - 1.0 - log_ratio).sum())
                tokens += len(response.response_token_ids)
        count = len(self.prompts)
        return Evaluation(correct / count, 1.0 - ended / count, kl_sum / max(tokens, 1))

    @cached_property
    def initial(self) -> Evaluation:
        """The starting model's evaluation: step 0 of every run's curve."""
        return self.evaluate(resolve_model(self.spec.model))
