"""Held-out accuracy of a model directory: one sample per unseen prompt, paired across models.

Every model answers the same prompts with the same sampling seed, so differences between two
models (a checkpoint and the starting weights) are paired and far less noisy than either value.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.spec import ArithTask, RunSpec
from services.tasks import generate_prompts
from services.tasks.models import resolve_model
from services.tasks.sampling_eval import sampled_accuracy

EVAL_PROMPT_SEED = 99
EVAL_SAMPLING_SEED = 7


class HeldOutEvaluator:
    """Accuracy on `num_prompts` held-out prompts of the spec's arithmetic task.

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

    def accuracy(self, model_dir: str | Path) -> float:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        model = model.to(self.device)  # type: ignore[arg-type]  # transformers' wrapped `to`
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        gen = self.spec.generation
        with torch.no_grad():
            return sampled_accuracy(
                model,
                tokenizer,
                self.prompts,
                seed=EVAL_SAMPLING_SEED,
                max_new_tokens=gen.max_new_tokens,
                temperature=gen.temperature,
            )

    @cached_property
    def initial_accuracy(self) -> float:
        """The starting model's accuracy: step 0 of every run's curve."""
        return self.accuracy(resolve_model(self.spec.model))
