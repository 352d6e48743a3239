"""Sampling of the `hf` backend: the processed distribution and one draw per row.

Each row of a batch may belong to a group with its own settings (temperature, min-p, top-k,
top-p): rows of equal settings share one pass. A row is sampled by inverse CDF from a uniform number
its caller supplies (`uniforms`), so the randomness of a row is whatever stream the caller
keeps for it (the engine keeps one per group: see `hf_engine.GroupNoise`), independent of the
other rows in the batch.

Kept sets (`SamplingSettings.replay_max_kept`): a row that asks gets, with its token, the ids
of the tokens its processed distribution kept (those of finite log-prob), ascending, so that
the learner can take its log-probs over that same set (truncated-sampling replay,
services/learner/vocab_logprobs.py). A set of more than `replay_max_kept` ids is recorded as
the empty list: the learner then drops that token rather than train it on a wrong set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.generation.base import SamplingSettings


def processed_logprobs(logits: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    """Log-probs of the distribution sampled from, given next-token `logits` of shape (B, V).

    In order, as vLLM's sampler: divide by the temperature (which must be > 0), keep the tokens
    whose probability is at least `min_p` times the most likely one's, keep the `top_k` largest
    logits (ties with the k-th are kept), keep the smallest set of most likely tokens whose
    probability reaches `top_p`, then renormalise. Tokens outside the kept set get -inf. With
    temperature 1, min_p 0, top_k 0 and top_p 1 this is exactly `log_softmax(logits)`.
    Computed in float32.

    min-p and top-k commute (each keeps a prefix of the tokens by probability, and top-k leaves
    the ratios to the most likely token as they were), but min-p and top-p do not: top-p's mass
    is counted over what min-p kept, renormalised, as vLLM counts it.
    """
    scaled = logits.float() / sampling.temperature
    if sampling.min_p > 0:
        probs = scaled.softmax(dim=-1)
        threshold = sampling.min_p * probs.amax(dim=-1, keepdim=True)
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
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


def kept_sets(processed: torch.Tensor, max_kept: int) -> list[list[int]]:
    """Per row of `processed` (B, V) log-probs: the ids of finite log-prob, ascending, or []
    where there are more than `max_kept` of them. One read of the ids, of the rows within the
    limit only."""
    finite = torch.isfinite(processed)
    counts = finite.sum(dim=-1)
    within = counts <= max_kept
    ids = (finite & within[:, None]).nonzero()[:, 1].tolist()  # row-major: grouped by row
    sets: list[list[int]] = []
    start = 0
    for size in torch.where(within, counts, 0).tolist():
        sets.append(ids[start : start + size])
        start += size
    return sets


@dataclass(frozen=True)
class Draws:
    """One token per row: tokens (B,) int64, their processed log-probs (B,) float32, and the
    kept sets of the rows whose settings ask for them (`kept_sets`), by row index."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    kept: dict[int, list[int]] = field(default_factory=dict)


_SettingsKey = tuple[float, int, float, float, int | None]


def _settings_key(sampling: SamplingSettings) -> _SettingsKey:
    """What shapes the distribution and what is recorded of it (the seed and length limit do
    not)."""
    return (
        sampling.temperature,
        sampling.top_k,
        sampling.top_p,
        sampling.min_p,
        sampling.replay_max_kept,
    )


def sample_rows(
    logits: torch.Tensor, settings: Sequence[SamplingSettings], uniforms: torch.Tensor
) -> Draws:
    """Sample one token per row of `logits` (B, V) under that row's settings.

    Temperature 0 is greedy decoding: the processed distribution is then a point mass on the
    arg-max token, so its log-prob is 0.0 (and the row's uniform is unused), and its kept set,
    where asked for, is that token alone.
    """
    rows_by_key: dict[_SettingsKey, list[int]] = {}
    for row, sampling in enumerate(settings):
        rows_by_key.setdefault(_settings_key(sampling), []).append(row)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    logprobs = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    kept: dict[int, list[int]] = {}
    for rows in rows_by_key.values():
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        sampling = settings[rows[0]]
        if sampling.temperature == 0:
            greedy = logits[index].argmax(dim=-1)
            tokens[index] = greedy
            if sampling.replay_max_kept is not None:
                kept.update(zip(rows, ([t] for t in greedy.tolist()), strict=True))
            continue
        processed = processed_logprobs(logits[index], sampling)
        drawn = inverse_cdf(processed, uniforms[index])
        tokens[index] = drawn
        logprobs[index] = processed.gather(-1, drawn[:, None]).squeeze(-1)
        if sampling.replay_max_kept is not None:
            kept.update(zip(rows, kept_sets(processed, sampling.replay_max_kept), strict=True))
    return Draws(tokens, logprobs, kept)
