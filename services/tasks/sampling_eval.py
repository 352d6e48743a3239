"""Accuracy of a model measured the way RL sees it: one sample per prompt at temperature 1."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.utils import GenerationMixin

from services.messages import Prompt
from services.tasks.answers import is_correct


@dataclass(frozen=True)
class SampledBatch:
    """Prompts (left-padded) followed by one sampled response each.

    sequences, attention_mask: [B, P + N]; the first `prompt_width` columns are the prompts.
    response_mask: [B, N], True on each response's tokens up to and including its first EOS.
    ended: [B], True where the response ended with EOS within max_new_tokens.
    """

    sequences: Tensor
    attention_mask: Tensor
    prompt_width: int
    response_mask: Tensor
    ended: Tensor

    @property
    def responses(self) -> Tensor:
        return self.sequences[:, self.prompt_width :]


def sample_batches(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    seed: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    batch_size: int = 128,
) -> list[SampledBatch]:
    """Sample one response per prompt from the full softmax at `temperature`, in batches.

    No top-k or top-p truncation: this is the distribution the RL policy samples from. The
    global torch RNG is seeded inside a fork, so the result depends only on `seed` and the
    weights, and the caller's RNG state is left untouched.
    """
    # transformers leaves this constructor unannotated.
    config = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=True,
        temperature=temperature,
        top_k=0,  # 0 disables top-k (the library default would truncate to 50)
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    was_training = model.training
    model.train(False)
    batches: list[SampledBatch] = []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(prompts), batch_size):
                chunk = [p.text for p in prompts[start : start + batch_size]]
                # Left padding keeps every prompt's last token next to its first sampled one.
                enc = tokenizer(
                    chunk,
                    return_tensors="pt",
                    padding=True,
                    padding_side="left",
                    add_special_tokens=False,
                ).to(model.device)
                # PreTrainedModel does not declare `generate`; every causal LM class mixes it in.
                out = cast(GenerationMixin, model).generate(**enc, generation_config=config)
                batches.append(_sampled_batch(out, enc["attention_mask"], tokenizer.eos_token_id))
    finally:
        model.train(was_training)
    return batches


def _sampled_batch(sequences: Tensor, prompt_mask: Tensor, eos_id: int) -> SampledBatch:
    width = prompt_mask.shape[1]
    is_eos = sequences[:, width:] == eos_id
    # A token belongs to the response while no EOS came before it (the EOS itself included).
    eos_before = is_eos.long().cumsum(-1) - is_eos.long()
    response_mask = eos_before == 0
    attention = torch.cat([prompt_mask.bool(), response_mask], 1).long()
    return SampledBatch(sequences, attention, width, response_mask, is_eos.any(-1))


def sample_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    seed: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    batch_size: int = 128,
) -> list[str]:
    """The text of one sampled response per prompt (`sample_batches`)."""
    batches = sample_batches(
        model,
        tokenizer,
        prompts,
        seed=seed,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        batch_size=batch_size,
    )
    texts: list[str] = []
    for batch in batches:
        texts.extend(tokenizer.batch_decode(batch.responses, skip_special_tokens=True))
    return texts


def sampled_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    seed: int,
    max_new_tokens: int,
    temperature: float = 1.0,
) -> float:
    """Fraction of prompts whose sampled response ends in `####<answer>`."""
    if not prompts:
        raise ValueError("sampled_accuracy needs at least one prompt")
    texts = sample_responses(
        model,
        tokenizer,
        prompts,
        seed=seed,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
    )
    return sum(is_correct(t, p.answer) for t, p in zip(texts, prompts, strict=True)) / len(prompts)
