"""The `eval` section: held-out evaluation during a run."""

from __future__ import annotations

from pydantic import (
    Field,
)

from kpo_core.config import StrictModel
from services.spec.bounds import MAX_RESPONSE_TOKENS, MAX_STEPS, MAX_TEMPERATURE


class EvalConfig(StrictModel):
    """Held-out evaluation during a run (services/pipeline/evaluation.py)."""

    every: int = Field(
        10,
        ge=1,
        le=MAX_STEPS,
        description="evaluate after every this many learner steps (and at the end)",
    )
    samples: int = Field(
        8, ge=1, le=256, description="k: responses per held-out prompt (avg@k, pass@k)"
    )
    temperature: float = Field(
        1.0, gt=0.0, le=MAX_TEMPERATURE, description="sampling temperature of evaluation"
    )
    # 16,384: more than the usual held-out sets (GSM8K's 1,319, MATH's 5,000, MMLU's 14,042),
    # each evaluated `samples` times at every eval.
    max_prompts: int = Field(
        64, ge=1, le=16_384, description="held-out prompts evaluated (the first ones)"
    )
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_RESPONSE_TOKENS,
        description="response length limit (default: generation.max_new_tokens)",
    )
    # Evaluation trains nothing, so its sampling may be truncated whatever training's is.
    top_p: float | None = Field(
        None, gt=0.0, le=1.0, description="nucleus sampling of evaluation (default: generation's)"
    )
    top_k: int | None = Field(
        None, ge=0, le=2**20, description="top-k of evaluation, 0 = off (default: generation's)"
    )
    min_p: float | None = Field(
        None, ge=0.0, le=1.0, description="min-p of evaluation, 0 = off (default: generation's)"
    )


# Tool calls of one response, and model turns: verl's multi-turn agent loop and CTPO's
# tool-integrated setting use 5 turns; 256 is far past where a response still fits a context.
