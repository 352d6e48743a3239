"""Sampling of the `hf` backend: the processed distribution and one draw per row.

Each row of a batch may belong to a group with its own settings (temperature, top-k, top-p):
rows of equal settings share one pass. A row is sampled by inverse CDF from a uniform number
its caller supplies (`uniforms`), so the randomness of a row is whatever stream the caller
keeps for it (the engine keeps one per group: see `hf_engine.GroupNoise`), independent of the
other rows in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.generation.base import SamplingSettings


def processed_logprobs(logits: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    """Log-probs of the distribution sampled from, given next-token `logits` of shape (B, V).

    In order: divide by the temperature (which must be > 0), keep the `top_k` largest logits
    (ties with the k-th are kept), keep the smallest set of most likely tokens whose probability
    reaches `top_p`, then renormalise. Tokens outside the kept set get -inf. With temperature 1,
    top_k 0 and top_p 1 this is exactly `log_softmax(logits)`. Computed in float32.
    """
    scaled = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scaled.shape[-1]:
        kth_largest = torch.topk(scaled, sampling.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # A token is dropped when the tokens ranked above it already reach top_p; the most likely
        # token has zero mass above it, so at least one token always survives.
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = torch.zeros_like(mass_above, dtype=torch.bool)
        drop.scatter_(-1, order, mass_above >= sampling.top_p)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.log_softmax(dim=-1)


def inverse_cdf(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token of each row of `logprobs` (B, V) drawn with `uniforms` (B,) in [0, 1).

    Token i is drawn when u * total falls in [cdf[i-1], cdf[i]): a token of zero probability
    has an empty interval and is never drawn. Rounding can put u * total at the very end of the
    cdf; the last token with mass is drawn then.
    """
    probs = logprobs.exp()
    cdf = probs.cumsum(dim=-1)
    targets = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    last_with_mass = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(tokens, last_with_mass)


def _settings_key(sampling: SamplingSettings) -> tuple[float, int, float]:
    """What shapes the distribution (the seed and length limit do not)."""
    return (sampling.temperature, sampling.top_k, sampling.top_p)


def sample_rows(
    logits: torch.Tensor, settings: Sequence[SamplingSettings], uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` (B, V) under that row's settings.

    Returns (tokens (B,) int64, their processed log-probs (B,) float32). Temperature 0 is
    greedy decoding: the processed distribution is then a point mass on the arg-max token, so
    its log-prob is 0.0 (and the row's uniform is unused).
    """
    rows_by_key: dict[tuple[float, int, float], list[int]] = {}
    for row, sampling in enumerate(settings):
        rows_by_key.setdefault(_settings_key(sampling), []).append(row)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    logprobs = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    for rows in rows_by_key.values():
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        sampling = settings[rows[0]]
        if sampling.temperature == 0:
            tokens[index] = logits[index].argmax(dim=-1)
            continue
        processed = processed_logprobs(logits[index], sampling)
        drawn = inverse_cdf(processed, uniforms[index])
        tokens[index] = drawn
        logprobs[index] = processed.gather(-1, drawn[:, None]).squeeze(-1)
    return tokens, logprobs
