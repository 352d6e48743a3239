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
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from services.spec import ArithTask, RunSpec
from services.tasks import generate_prompts
from services.tasks.answers import is_correct
from services.tasks.models import resolve_model
from services.tasks.sampling_eval import SampledBatch, sample_batches

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


def _token_log_probs(model: PreTrainedModel, batch: SampledBatch, temperature: float) -> Tensor:
    """log pi(token) of each sampled response token at the sampling temperature, [B, N]."""
    mask = batch.attention_mask
    # Left-padded prompts: positions count real tokens only, as generation counted them.
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=batch.sequences, attention_mask=mask, position_ids=positions).logits
    width = batch.prompt_width
    # The logits at position t predict token t + 1.
    predicting = logits[:, width - 1 : -1].float() / temperature
    return torch.log_softmax(predicting, -1).gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)


def _load(model_dir: str | Path, device: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
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
        model = _load(model_dir, self.device)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        gen = self.spec.generation
        with torch.no_grad():
            batches = sample_batches(
                model,
                tokenizer,
                self.prompts,
                seed=EVAL_SAMPLING_SEED,
                max_new_tokens=gen.max_new_tokens,
                temperature=gen.temperature,
            )
            correct = ended = 0
            kl_sum, tokens = 0.0, 0
            prompts = iter(self.prompts)
            for batch in batches:
                texts = tokenizer.batch_decode(batch.responses, skip_special_tokens=True)
                correct += sum(is_correct(text, next(prompts).answer) for text in texts)
                ended += int(batch.ended.sum())
                log_ratio = _token_log_probs(self._start_model, batch, gen.temperature)
                log_ratio = log_ratio - _token_log_probs(model, batch, gen.temperature)
                # k3 = (r - 1) - log r with r = pi_start / pi: unbiased and never negative.
                k3 = log_ratio.exp() - 1.0 - log_ratio
                kl_sum += float(k3[batch.response_mask].sum())
                tokens += int(batch.response_mask.sum())
        count = len(self.prompts)
        return Evaluation(correct / count, 1.0 - ended / count, kl_sum / max(tokens, 1))

    @cached_property
    def initial(self) -> Evaluation:
        """The starting model's evaluation: step 0 of every run's curve."""
        return self.evaluate(resolve_model(self.spec.model))
