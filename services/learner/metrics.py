"""The metrics of one learner step: batch statistics, minibatch reductions, ratio diagnostics.

Every function returns plain floats (one metrics record per step, see DESIGN.md). NaN is kept
out of the record: a minibatch whose loss or gradient was non-finite is skipped and counted
(`skipped_minibatches`) rather than reported as NaN, NaN/inf rewards are counted
(`nonfinite_rewards`) and left out of the reward statistics. docs/numerics.md has the policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kpo_core.diagnostics import ratio_diagnostics
from kpo_core.ratios import MAX_ABS_LOG_RATIO, masked_log_ratio
from services.learner.batch import TrainingBatch

# Counts: summed over a step's minibatches (present even when every minibatch was skipped).
SUMMED = frozenset(
    {"nonfinite_tokens", "extreme_ratio_tokens", "skipped_minibatches", "empty_minibatches"}
)
# Token counts that every epoch sees again: reported per pass over the batch (sum / epochs).
PER_PASS = ("nonfinite_tokens", "extreme_ratio_tokens")


def batch_metrics(batch: TrainingBatch) -> dict[str, float]:
    """Reward, accuracy, length, truncation, staleness and token counts of a batch.

    Rewards that are NaN/inf are counted (`nonfinite_rewards`) and left out of reward_mean,
    reward_std (population std; both 0.0 when no reward is finite) and of the groups:
    zero_variance_group_fraction is the fraction of groups whose finite rewards are all equal
    (including groups with at most one finite reward: they carry no GRPO learning signal).
    empty_responses counts responses with no token; tokens_trained counts every response
    token of the batch, including those the loss later masks.
    """
    rewards = batch.rewards.double()
    finite = torch.isfinite(rewards)
    kept = rewards[finite]
    lengths = batch.response_mask.sum(-1).double()
    groups, inverse = torch.unique(batch.group_ids, return_inverse=True)
    shape = (groups.numel(),)
    high = torch.where(finite, rewards, -math.inf)
    low = torch.where(finite, rewards, math.inf)
    g_max = rewards.new_full(shape, -math.inf).scatter_reduce(0, inverse, high, "amax")
    g_min = rewards.new_full(shape, math.inf).scatter_reduce(0, inverse, low, "amin")
    staleness = batch.staleness.double()
    return {
        "reward_mean": float(kept.mean()) if kept.numel() else 0.0,
        "reward_std": float(kept.std(correction=0)) if kept.numel() else 0.0,
        "accuracy": float(batch.correct.double().mean()),
        "response_length_mean": float(lengths.mean()),
        "truncated_fraction": float(batch.truncated.double().mean()),
        "zero_variance_group_fraction": float((g_min >= g_max).double().mean()),
        "nonfinite_rewards": float((~finite).sum()),
        "empty_responses": float((lengths == 0).sum()),
        "staleness_mean": float(staleness.mean()),
        "staleness_max": float(staleness.max()),
        "tokens_trained": float(lengths.sum()),
    }


def finite_mask(mask: Tensor, *tensors: Tensor) -> Tensor:
    """`mask` [B, T] without the positions where any of `tensors` [B, T] is NaN or inf.

    The same tokens `compute_policy_loss(nonfinite="mask")` drops, so metrics see what the loss saw.
    """
    for tensor in tensors:
        mask = mask & torch.isfinite(tensor)
    return mask


def masked_mean(values: Tensor, mask: Tensor) -> float:
    """Mean of `values` [B, T] over `mask` (NaN off the mask is ignored); 0.0 for an empty mask."""
    total = torch.where(mask, values, 0.0).sum()
    return float(total / mask.sum().clamp_min(1))


@torch.no_grad()
def raw_ratios(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """Detached raw ratios exp(clamp(z, -20, 20)) [B, T] with z = logp - ref_logp, 1 off `mask`.

    The estimator's own ratio comes with its loss (`TokenPolicyLoss.ratio`): the estimator is
    never run a second time for the metrics.
    """
    z = masked_log_ratio(logp.detach(), ref_logp, mask)
    raw = z.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO).exp()
    return torch.where(mask, raw, torch.ones((), dtype=raw.dtype, device=raw.device))


@dataclass(frozen=True)
class MicroBatchRecord:
    """What one micro-batch's loss reports: its loss metrics (`token_policy_loss`'s, plus
    entropy) and its valid token count (the weight of its means in the minibatch's record)."""

    metrics: dict[str, float]
    tokens: float


def merge_micro_batches(records: Sequence[MicroBatchRecord]) -> MicroBatchRecord:
    """The loss metrics of a minibatch from those of its micro-batches (of every rank).

    Every loss metric is a mean over valid tokens (clip_fraction, ratio_mean, approx_kl,
    entropy, the Kalman gain, the behaviour-weight statistics), a max or min (`*_max`,
    `*_min`), or a count (SUMMED): means are weighted by the parts' valid tokens, so the merged
    record equals that of the unsplit minibatch. Parts without a valid token report placeholder
    values and are left out, unless no part has one.
    """
    with_tokens = [r for r in records if r.tokens > 0] or list(records[:1])
    total = sum(r.tokens for r in records)
    keys = dict.fromkeys(key for r in records for key in r.metrics)
    out: dict[str, float] = {}
    for key in keys:
        if key in SUMMED:
            out[key] = float(sum(r.metrics.get(key, 0.0) for r in records))
            continue
        present = [r for r in with_tokens if key in r.metrics]
        if not present:
            continue
        values = [r.metrics[key] for r in present]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        else:
            weight = sum(r.tokens for r in present)
            if weight == 0:
                out[key] = values[0]
            else:
                out[key] = sum(r.tokens * v for r, v in zip(present, values, strict=True)) / weight
    return MicroBatchRecord(out, total)


def diagnostic_metrics(prefix: str, ratios: Tensor, mask: Tensor) -> dict[str, float]:
    """The scalar entries of `ratio_diagnostics(ratios [N, T], mask [N, T])`, names prefixed."""
    return {
        prefix + name: float(value)
        for name, value in ratio_diagnostics(ratios, mask).items()
        if isinstance(value, float | int)
    }


def reduce_minibatches(records: Sequence[dict[str, float]]) -> dict[str, float]:
    """One value per key over the minibatch records of a step.

    `*_max` keys take the max, `*_min` the min, counts in SUMMED the sum, everything else the
    mean over the records that have the key with a finite value (a key whose values are all
    non-finite is left out).
    """
    keys = dict.fromkeys(key for record in records for key in record)
    out: dict[str, float] = {}
    for key in keys:
        values = [r[key] for r in records if key in r and math.isfinite(r[key])]
        if key in SUMMED:
            out[key] = float(sum(values))
        elif not values:
            continue
        elif key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    return out
