"""Offline log-probs of a generated response, to check the ones its backend reported."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from services.messages import Response


def plain_logprobs(model: PreTrainedModel, response: Response) -> torch.Tensor:
    ids = torch.tensor([response.prompt_token_ids + response.response_token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    start = len(response.prompt_token_ids) - 1
    tokens = torch.tensor(response.response_token_ids)[:, None]
    out: torch.Tensor = logits[start : start + len(tokens)].log_softmax(-1).gather(-1, tokens)
    return out[:, 0]


def kept_cache_logprobs(
    old: PreTrainedModel, new: PreTrainedModel, response: Response, k: int
) -> torch.Tensor:
    """Log-probs of response tokens k.. under `new`, continuing `old`'s cache of the prompt and
    the first k - 1 tokens."""
    prompt, tokens = response.prompt_token_ids, response.response_token_ids
    cache = DynamicCache(config=old.config)
    with torch.no_grad():
        old(input_ids=torch.tensor([prompt + tokens[: k - 1]]), cache=cache, use_cache=True)
        logits = new(
            input_ids=torch.tensor([tokens[k - 1 : -1]]), cache=cache, use_cache=True
        ).logits[0]
    out: torch.Tensor = logits.float().log_softmax(-1).gather(-1, torch.tensor(tokens[k:])[:, None])
    return out[:, 0]
