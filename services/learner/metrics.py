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

from kpo_core.diagnostics import diagnostics_of_sums, ratio_diagnostics
from kpo_core.ratios import MAX_ABS_LOG_RATIO, masked_log_ratio, masked_mean_or, metric_floats
from services.learner.batch import TrainingBatch

# Counts: summed over a step's minibatches (present even when every minibatch was skipped).
SUMMED = frozenset(
    {"nonfinite_tokens", "extreme_ratio_tokens", "skipped_minibatches", "empty_minibatches"}
)
# Token counts that every epoch sees again: reported per pass over the batch (sum / epochs).
PER_PASS = ("nonfinite_tokens", "extreme_ratio_tokens")
# The shadow estimators' keys (`algorithm.shadow`): `shadow_<name>_<key>`.
SHADOW_PREFIX = "shadow_"


def shadow_key(name: str, key: str) -> str:
    """The record key of shadow estimator `name`'s `key`."""
    return f"{SHADOW_PREFIX}{name}_{key}"


def summed_over_parts(key: str) -> bool:
    """Whether a micro-batch metric adds up over a minibatch's parts: the counts (SUMMED), and
    the shadow estimators' losses (`shadow_<name>_policy_loss`), whose parts are normalised by
    the whole minibatch as the training loss's are. Over minibatches a loss is averaged, like
    `policy_loss` (`reduce_minibatches`)."""
    return key in SUMMED or (key.startswith(SHADOW_PREFIX) and key.endswith("_policy_loss"))


def batch_metrics(batch: TrainingBatch, num_groups: int | None = None) -> dict[str, float]:
    """`batch_metric_tensors` read back as floats (one read)."""
    return metric_floats(dict(batch_metric_tensors(batch, num_groups)))


def batch_metric_tensors(batch: TrainingBatch, num_groups: int | None = None) -> dict[str, Tensor]:
    """Reward, accuracy, length, truncation, staleness and token counts of a batch.

    Rewards that are NaN/inf are counted (`nonfinite_rewards`) and left out of reward_mean,
    reward_std (population std; both 0.0 when no reward is finite) and of the groups:
    zero_variance_group_fraction is the fraction of groups whose finite rewards are all equal
    (including groups with at most one finite reward: they carry no GRPO learning signal).
    Lengths count model tokens (`response_mask`): response_length_mean, empty_responses (no
    model token) and tokens_trained (every model token of the batch, including those the loss
    later masks for a NaN/inf reward or log-prob) leave observation tokens out;
    observation_tokens counts those. A replayed batch (with kept sets) adds
    `replay_metric_tensors`.

    0-dim float64 tensors on the batch's device, nothing read back. `num_groups`: the number of
    groups the rows' group_ids index (known to the caller on the host); without it the distinct
    ids are counted with `torch.unique` (a data-dependent shape, which waits on the device).
    """
    rewards = batch.rewards.double()
    finite = torch.isfinite(rewards)
    count = finite.sum()
    kept = torch.where(finite, rewards, 0.0)
    reward_mean = kept.sum() / count.clamp_min(1)
    spread = torch.where(finite, rewards - reward_mean, 0.0)
    reward_std = (spread.square().sum() / count.clamp_min(1)).sqrt()
    lengths = batch.response_mask.sum(-1).double()
    # Response positions (model and observation tokens) less the model tokens: as `collate`
    # made it, the mask is False exactly at the observation tokens and the padding.
    positions = batch.attention_mask[:, batch.prompt_width :].sum().double()
    if num_groups is None:
        _, inverse = torch.unique(batch.group_ids, return_inverse=True)
        present = torch.ones(int(inverse.max()) + 1 if inverse.numel() else 0, dtype=torch.bool)
    else:
        inverse = batch.group_ids
        # Groups without a row (no responses) are not groups of this batch.
        present = torch.zeros(num_groups, dtype=torch.bool, device=inverse.device)
        present = present.index_fill(0, inverse, True)
    shape = (present.numel(),)
    high = torch.where(finite, rewards, -math.inf)
    low = torch.where(finite, rewards, math.inf)
    g_max = rewards.new_full(shape, -math.inf).scatter_reduce(0, inverse, high, "amax")
    g_min = rewards.new_full(shape, math.inf).scatter_reduce(0, inverse, low, "amin")
    staleness = batch.staleness.double()
    zero_variance = ((g_min >= g_max) & present.to(g_min.device)).sum() / present.sum()
    replay = {} if batch.kept is None else replay_metric_tensors(batch)
    return replay | {
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "accuracy": batch.correct.double().mean(),
        "response_length_mean": lengths.mean(),
        "truncated_fraction": batch.truncated.double().mean(),
        "zero_variance_group_fraction": zero_variance.double(),
        "nonfinite_rewards": (~finite).sum().double(),
        "empty_responses": (lengths == 0).sum().double(),
        "staleness_mean": staleness.mean(),
        "staleness_max": staleness.max(),
        "tokens_trained": lengths.sum(),
        "observation_tokens": positions - lengths.sum(),
    }


# The quantile of the kept-set sizes `replay_kept_p99` reports.
KEPT_QUANTILE = 0.99


def replay_metric_tensors(batch: TrainingBatch) -> dict[str, Tensor]:
    """The kept sets of a replayed batch (`TrainingBatch.kept`), over its model tokens:
    replay_kept_mean and replay_kept_p99 (nearest rank), the sizes of the sets recorded (0.0
    when none was), and replay_dropped_tokens, the tokens whose set was over the limit.

    0-dim float64 tensors, nothing read back: the quantile is taken by sorting every position
    with the positions that do not count put first, so no shape depends on the data."""
    assert batch.kept is not None and batch.replay_dropped is not None
    sizes = (batch.kept >= 0).sum(dim=-1).double().flatten()
    counted = (batch.response_mask & ~batch.replay_dropped).flatten()
    count = counted.sum()
    ordered = torch.where(counted, sizes, -1.0).sort().values
    # Nearest rank: the ceil(q n)-th of the n counted sizes, which sort after the others.
    rank = (KEPT_QUANTILE * count.double()).ceil().long().clamp_min(1)
    at = (ordered.numel() - count + rank - 1).clamp(0, ordered.numel() - 1)
    p99 = torch.where(count > 0, ordered[at], 0.0)
    mean = torch.where(counted, sizes, 0.0).sum() / count.clamp_min(1)
    return {
        "replay_kept_mean": mean,
        "replay_kept_p99": p99,
        "replay_dropped_tokens": batch.replay_dropped.sum().double(),
    }


# The sums behind the on-policy ratio's statistics: tokens, sum of r, sum of r^2.
ONPOLICY_SUMS = 3


def onpolicy_ratio_sums(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """[ONPOLICY_SUMS] float64 on the device: the count, sum and sum of squares of the ratios
    r = exp(log_ratio) [b, t] over `mask`'s finite tokens (sums of parts add up)."""
    counted = finite_mask(mask, log_ratio)
    clamped = log_ratio.double().clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    ratio = torch.where(counted, clamped.exp(), 0.0)
    return torch.stack([counted.sum().double(), ratio.sum(), ratio.square().sum()])


def onpolicy_ratio_metrics(sums: Sequence[float]) -> dict[str, float]:
    """onpolicy_ratio_mean and onpolicy_ratio_std of `onpolicy_ratio_sums` values, and
    onpolicy_tokens; the first two absent where no token counted."""
    count, total, squares = sums
    if count == 0:
        return {"onpolicy_tokens": 0.0}
    mean = total / count
    return {
        "onpolicy_tokens": count,
        "onpolicy_ratio_mean": mean,
        "onpolicy_ratio_std": math.sqrt(max(squares / count - mean * mean, 0.0)),
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
    return float(masked_mean_or(values, mask, 0.0))


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
    `*_min`), or a sum (a count, or a shadow estimator's loss: `summed_over_parts`): means are
    weighted by the parts' valid tokens, so the merged record equals that of the unsplit
    minibatch. Parts without a valid token report placeholder values and are left out, unless
    no part has one.
    """
    with_tokens = [r for r in records if r.tokens > 0] or list(records[:1])
    total = sum(r.tokens for r in records)
    keys = dict.fromkeys(key for r in records for key in r.metrics)
    out: dict[str, float] = {}
    for key in keys:
        if summed_over_parts(key):
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


def diagnostic_sum_metrics(prefix: str, sums: Sequence[float]) -> dict[str, float]:
    """`diagnostic_metrics` from `diagnostic_sums` values (summed over several sets of rows:
    then those of their union)."""
    return {prefix + name: value for name, value in diagnostics_of_sums(sums).items()}


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


def _kind(key: str) -> str:
    """How `merge_micro_batches` combines a key: "sum", "max", "min" or (weighted) "mean"."""
    if summed_over_parts(key):
        return "sum"
    if key.endswith("_max"):
        return "max"
    if key.endswith("_min"):
        return "min"
    return "mean"


class MinibatchAccumulator:
    """`merge_micro_batches` on the device: one minibatch's micro-batch metrics summed as they
    come, with nothing read back, then packed for one collective per step (`sum_part`,
    `max_part`) and merged on the host from the ranks' reduced values (`merged`).

    Every rank adds the same passes with the same keys (filler passes too, with `real` False,
    and no token): the packed layouts of the ranks then agree. Means are weighted by the parts'
    valid tokens; without any valid token in the minibatch a key takes the parts' own value, the
    placeholder every part without a token reports (e.g. ratio_mean 1), averaged over the real
    parts of every rank.
    """

    def __init__(self) -> None:
        self.keys: list[str] = []
        self._sums: dict[str, Tensor] = {}
        self._fallback: dict[str, Tensor] = {}
        self._extreme: dict[str, Tensor] = {}
        self._tokens: Tensor | None = None
        self._real_parts = 0

    @property
    def tokens(self) -> Tensor:
        """The valid tokens of the parts added so far on this rank (0-dim float64)."""
        assert self._tokens is not None, "no part added"
        return self._tokens

    def add(self, metrics: dict[str, Tensor], tokens: Tensor, real: bool) -> None:
        """One micro-batch's 0-dim metrics and its valid token count; `real` False: a filler."""
        tokens = tokens.to(torch.float64)
        if self._tokens is None:
            self.keys = list(metrics)
            self._tokens = torch.zeros_like(tokens)
        has_tokens = tokens > 0
        self._tokens = self._tokens + tokens
        self._real_parts += int(real)
        for key in self.keys:
            value = metrics[key].to(torch.float64)
            kind = _kind(key)
            if real and kind != "sum":
                self._fallback[key] = self._fallback.get(key, 0.0) + value
            if kind == "sum":
                self._sums[key] = self._sums.get(key, 0.0) + value
            elif kind == "mean":
                # where(), not a product: a part without tokens may report NaN (no value).
                weighted = torch.where(has_tokens, tokens * value, 0.0)
                self._sums[key] = self._sums.get(key, 0.0) + weighted
            else:
                # min is packed as max of -value: one MAX collective serves both.
                signed = value if kind == "max" else -value
                kept = torch.where(has_tokens, signed, -torch.inf)
                previous = self._extreme.get(key)
                self._extreme[key] = kept if previous is None else torch.maximum(previous, kept)

    def sum_part(self) -> Tensor:
        """[tokens, real parts, per key: its sum (weighted for a mean; none for a max or min),
        then its placeholder sum (not for a sum)] float64."""
        tokens = self.tokens
        parts: list[Tensor | float] = [tokens, float(self._real_parts)]
        for key in self.keys:
            kind = _kind(key)
            if kind in ("sum", "mean"):
                parts.append(self._sums[key])
            if kind != "sum":
                parts.append(self._fallback.get(key, 0.0))
        return torch.stack(
            [torch.as_tensor(p, dtype=torch.float64, device=tokens.device) for p in parts]
        )

    def max_part(self) -> Tensor:
        """[per max/min key: the max (min: max of -value) over parts with tokens] float64."""
        values = [self._extreme[key] for key in self.keys if _kind(key) in ("max", "min")]
        if not values:
            return self.tokens.new_zeros(0)
        return torch.stack(values)

    def merged(self, summed: Sequence[float], maxed: Sequence[float]) -> dict[str, float]:
        """The minibatch's record from the ranks' reduced `sum_part` and `max_part` values."""
        tokens, real_parts = summed[0], max(summed[1], 1.0)
        out: dict[str, float] = {}
        position, extreme = 2, iter(maxed)
        for key in self.keys:
            kind = _kind(key)
            if kind in ("sum", "mean"):
                value = summed[position]
                position += 1
            if kind == "sum":
                out[key] = value
                continue
            fallback = summed[position] / real_parts
            position += 1
            if kind == "mean":
                out[key] = value / tokens if tokens > 0 else fallback
            else:
                top = next(extreme)
                signed = top if kind == "max" else -top
                out[key] = signed if tokens > 0 else fallback
        return out
