"""Clipped policy-gradient surrogates, loss aggregation, entropy and KL.

Shapes: logp, ref_logp, behaviour_logp, mask [B, T]; advantages [B] or [B, T]; logits [B, T, V].

Per token, with ratio rho from an estimator (`kpo_core.ratios`) and window [lo, hi]:

    l(rho, A) = max(-A rho, -A clip(rho, lo, hi))              (PPO pessimistic surrogate)
    l = min(l, c |A|)  for A < 0, when the estimator has a dual clip c
    l = -A rho                                                  (unclipped estimators)

A token is "clipped" when the clipped term is the larger one. With `behaviour_logp` the loss is
multiplied by the detached decoupled-PPO weight pi_ref / pi_behaviour (AReaL, arXiv 2505.24298).
Aggregation modes follow verl's names (SPEC.md); empty responses are left out of every mean.
Masked positions (padding, and the observation tokens of a multi-turn response: tool output in
the context) have no loss and no gradient, and no token or sequence count includes them:
token-level GRPO/PPO simply skips them, and the sequence-level estimators see model tokens only
(`kpo_core.ratios`). seq-mean-token-sum-norm's divisor is a length, not a count: `norm_length`,
or else the padded width, which spans a response's observation tokens too.

Bad numbers (docs/numerics.md): NaN/inf in a valid token of any input is an error
(`nonfinite="raise"`) or drops that token, counted as `nonfinite_tokens` ("mask"); a valid token
whose log-ratio (or, with `behaviour_logp`, log-weight) exceeds `MAX_ABS_LOG_RATIO` in magnitude
is counted as `extreme_ratio_tokens` and trained with its saturated ratio. For finite inputs the
loss and its gradient are finite (advantages large enough to overflow the loss itself aside).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from pydantic import ValidationError
from torch import Tensor

from kpo_core.config import (
    LOSS_AGG_MODES,
    EstimatorConfig,
    LossAggMode,
    OffPolicyCorrection,
    describe_validation_error,
)
from kpo_core.ratios import (
    RatioEstimate,
    behaviour_weight_tensors,
    extreme_token_count,
    get_estimator,
    masked_log_ratio,
    masked_mean_or,
    metric_floats,
)

NonFinitePolicy = Literal["raise", "mask"]
# truncated_sampling is a rule of the run's sampling, not an option of the loss.
_CORRECTION_OPTIONS = frozenset(OffPolicyCorrection.model_fields) - {
    "level",
    "truncated_sampling",
} | {"tis_level"}


class NonFiniteInputError(ValueError):
    """NaN or inf in a valid position of a loss input."""


def clipped_surrogate(
    estimate: RatioEstimate, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-token loss [B, T] (0 off the mask) and the bool [B, T] of clipped tokens."""
    rho, adv = estimate.ratio, advantages
    unclipped = -adv * rho
    if estimate.clip_low is None and estimate.clip_high is None:
        loss = unclipped
        clipped = estimate.clipped if estimate.clipped is not None else torch.zeros_like(mask)
    else:
        bounded = -adv * _clamp(rho, estimate.clip_low, estimate.clip_high)
        loss = torch.maximum(unclipped, bounded)
        clipped = bounded > unclipped
    if estimate.dual_clip is not None:
        cap = -adv * estimate.dual_clip  # = c |A| where A < 0
        capped = (adv < 0) & (loss > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
        clipped = clipped | capped
    if estimate.backstop is not None:
        # The value stays (the loss reads the same), the gradient goes: as PPO's clipped term.
        loss = torch.where(estimate.backstop, loss.detach(), loss)
        clipped = clipped | estimate.backstop
    return torch.where(mask, loss, 0.0), clipped & mask


def _clamp(x: Tensor, low: Tensor | float | None, high: Tensor | float | None) -> Tensor:
    if low is not None:
        x = torch.maximum(x, torch.as_tensor(low, dtype=x.dtype, device=x.device))
    if high is not None:
        x = torch.minimum(x, torch.as_tensor(high, dtype=x.dtype, device=x.device))
    return x


@dataclass(frozen=True)
class LossNormaliser:
    """The denominators of a minibatch's loss, counted once over the whole minibatch.

    tokens: valid tokens; sequences: responses with at least one valid token; width: the padded
    response length (seq-mean-token-sum-norm's default divisor). When a minibatch
    is split into micro-batches (and over ranks), each part's loss is divided by the counts of
    the whole, so that the parts' losses (and gradients) add up to the unsplit one, as verl's
    global batch info does.

    The counts are floats or 0-dim tensors: `of` counts a mask on its device without reading
    the counts back, so that a step never waits on the device for its denominators.
    """

    tokens: float | Tensor
    sequences: float | Tensor
    width: int

    @classmethod
    def of(cls, mask: Tensor, width: int | None = None) -> LossNormaliser:
        """The counts of a bool mask [B, T] (0-dim tensors); the width is T unless given."""
        lengths = mask.sum(-1)
        return cls(
            tokens=lengths.sum(),
            sequences=(lengths > 0).sum(),
            width=int(mask.shape[-1]) if width is None else width,
        )


def _at_least_one(count: float | Tensor) -> float | Tensor:
    """max(count, 1), on the device for a tensor count."""
    return count.clamp_min(1.0) if isinstance(count, Tensor) else max(count, 1.0)


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    mode: LossAggMode,
    norm_length: int | None = None,
    normaliser: LossNormaliser | None = None,
) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar by one of verl's aggregation modes.

    The denominators (token count, non-empty sequence count, padded width) are those of `mask`
    unless `normaliser` gives the counts of the whole minibatch this is a part of: a
    micro-batch of short rows is padded less than its minibatch, and seq-mean-token-sum-norm
    must still divide by the minibatch's width.
    """
    weights = mask.to(per_token.dtype)
    token_sum = (per_token * weights).sum(-1)
    lengths = weights.sum(-1)
    nonempty = lengths > 0
    counts = normaliser or LossNormaliser.of(mask)
    if mode == "token-sum":
        return token_sum.sum()
    if mode == "token-mean":
        return token_sum.sum() / _at_least_one(counts.tokens)
    if mode == "seq-mean-token-mean":
        per_sequence = token_sum / lengths.clamp_min(1.0)
    elif mode == "seq-mean-token-sum":
        per_sequence = token_sum
    elif mode == "seq-mean-token-sum-norm":
        per_sequence = token_sum / float(norm_length or counts.width)
    else:
        valid = ", ".join(LOSS_AGG_MODES)
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {valid}")
    return (per_sequence * nonempty).sum() / _at_least_one(counts.sequences)


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1 with d = ref_logp - logp >= 0."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return d.exp() - d - 1.0


def token_entropy(logits: Tensor, chunk_tokens: int = 1024) -> Tensor:
    """Entropy of softmax(logits) per token, [B, T, V] -> [B, T], float32.

    Rows are processed `chunk_tokens` at a time, so the float32 softmax of a real vocabulary is
    only ever held for one chunk, never as a second full-size [B, T, V] copy. A logit of -inf
    (a token with probability 0) contributes 0, as p log p does in the limit; NaN or +inf logits
    give NaN.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for chunk in torch.split(flat, chunk_tokens):
        chunk32 = chunk.float()
        log_z = torch.logsumexp(chunk32, dim=-1, keepdim=True)
        probs = (chunk32 - log_z).exp()
        # 0 * -inf would be NaN: the clamp makes it 0 * (-3.4e38) = 0, with a zero gradient.
        floor = torch.finfo(chunk32.dtype).min
        parts.append(log_z.squeeze(-1) - (probs * chunk32.clamp_min(floor)).sum(-1))
    if not parts:
        return logits.new_zeros(logits.shape[:-1], dtype=torch.float32)
    return torch.cat(parts).reshape(logits.shape[:-1])


def entropy_from_logits(logits: Tensor, mask: Tensor, chunk_tokens: int = 1024) -> Tensor:
    """Masked mean token entropy (a scalar tensor; differentiable when logits are)."""
    entropy = token_entropy(logits, chunk_tokens)
    weights = mask.to(entropy.dtype)
    return (entropy * weights).sum() / weights.sum().clamp_min(1.0)


def _broadcast_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    if advantages.shape == mask.shape:
        return advantages
    if advantages.ndim == 1 and advantages.shape[0] == mask.shape[0]:
        return advantages.unsqueeze(-1).expand(mask.shape)
    raise ValueError(
        f"advantages must have shape [B] = [{mask.shape[0]}] or [B, T] = {list(mask.shape)}, "
        f"got {list(advantages.shape)}"
    )


def _nonfinite_tokens(tensors: dict[str, Tensor], mask: Tensor) -> Tensor:
    bad = torch.zeros_like(mask)
    for tensor in tensors.values():
        bad |= ~torch.isfinite(tensor) & mask
    return bad


def _check_inputs(
    tensors: dict[str, Tensor], mask: Tensor, nonfinite: NonFinitePolicy
) -> tuple[Tensor, Tensor]:
    """Validate shapes and finiteness; returns the mask to use and the count of dropped tokens
    (a 0-dim tensor: "mask" never reads it back, "raise" must, to decide whether to raise)."""
    for name, tensor in tensors.items():
        if tensor.shape != mask.shape:
            raise ValueError(
                f"{name} shape {list(tensor.shape)} must equal mask shape {list(mask.shape)}"
            )
    bad = _nonfinite_tokens(tensors, mask)
    dropped = bad.sum()
    if nonfinite == "raise" and bool(dropped):
        counts = {name: int((~torch.isfinite(t) & mask).sum()) for name, t in tensors.items()}
        where = ", ".join(f"{name}: {n}" for name, n in counts.items() if n)
        raise NonFiniteInputError(
            f"NaN/inf in valid tokens ({where}); pass nonfinite='mask' to drop those tokens"
        )
    return mask & ~bad, dropped


def _split_options(
    estimator: str, options: dict[str, Any]
) -> tuple[EstimatorConfig, OffPolicyCorrection]:
    registered = get_estimator(estimator)
    correction_keys = {k for k in options if k in _CORRECTION_OPTIONS}
    correction_args = {k: options[k] for k in correction_keys}
    if "tis_level" in correction_args:
        correction_args["level"] = correction_args.pop("tis_level")
    estimator_args = {k: v for k, v in options.items() if k not in correction_keys}
    try:
        config = registered.make_config(**estimator_args)
        correction = OffPolicyCorrection(**correction_args)
    except ValidationError as error:
        valid = sorted(set(registered.config_type.model_fields) - {"name"} | _CORRECTION_OPTIONS)
        raise ValueError(
            f"{describe_validation_error(error, f'{estimator} options')}\n"
            f"valid options for {estimator!r}: {', '.join(valid)}"
        ) from None
    return config, correction


def policy_loss(
    estimator: str,
    logp: Tensor,
    ref_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    behaviour_logp: Tensor | None = None,
    loss_agg_mode: LossAggMode | None = None,
    norm_length: int | None = None,
    nonfinite: NonFinitePolicy = "raise",
    **options: Any,
) -> tuple[Tensor, dict[str, float]]:
    """Policy-gradient loss of the estimator called `estimator`, and its metrics.

    `options` are the fields of that estimator's config (e.g. clip_low, clip_high, dual_clip_c,
    q, r, p0, x0, gradient, clipped) plus the off-policy options tis_cap, mis_low, mis_high and
    tis_level ("token" | "sequence" | "sequence-mean"), which apply when `behaviour_logp` is given.
    `nonfinite="raise"` (default) rejects NaN/inf in valid tokens; "mask" drops those tokens and
    reports their count as `nonfinite_tokens`. `extreme_ratio_tokens` counts the valid tokens
    whose |log-ratio| or |log-weight| exceeds `kpo_core.ratios.MAX_ABS_LOG_RATIO`.
    """
    config, correction = _split_options(estimator, options)
    return compute_policy_loss(
        config,
        logp,
        ref_logp,
        advantages,
        mask,
        behaviour_logp=behaviour_logp,
        correction=correction,
        loss_agg_mode=loss_agg_mode,
        norm_length=norm_length,
        nonfinite=nonfinite,
    )


def compute_policy_loss(
    config: EstimatorConfig,
    logp: Tensor,
    ref_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    behaviour_logp: Tensor | None = None,
    correction: OffPolicyCorrection | None = None,
    loss_agg_mode: LossAggMode | None = None,
    norm_length: int | None = None,
    nonfinite: NonFinitePolicy = "raise",
    normaliser: LossNormaliser | None = None,
    token_versions: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """`policy_loss` for an already-validated estimator config.

    `normaliser`: the counts of the whole minibatch when this is a micro-batch of it
    (`aggregate_loss`). `token_versions`: as `token_policy_loss`.
    """
    token_loss = token_policy_loss(
        config,
        logp,
        ref_logp,
        advantages,
        mask,
        behaviour_logp=behaviour_logp,
        correction=correction,
        nonfinite=nonfinite,
        token_versions=token_versions,
    )
    mode = loss_agg_mode or config.default_loss_agg_mode
    loss = aggregate_loss(token_loss.per_token, token_loss.mask, mode, norm_length, normaliser)
    return loss, token_loss.metrics


@dataclass(frozen=True)
class TokenPolicyLoss:
    """The policy loss before aggregation, for callers that aggregate by their own rules.

    per_token: [B, T], 0 off `mask`. mask: bool [B, T], the input mask less the tokens dropped
    for NaN/inf. clipped: bool [B, T], tokens whose clipped term won. ratio: [B, T] detached,
    the estimator's ratio (for KPO the filtered one), 1 off `mask`. metric_tensors: the metrics
    of `policy_loss` as 0-dim tensors on the loss's device, never read back here (a training
    loop sums them over its micro-batches and reads them once); `metrics` reads them as floats.
    """

    per_token: Tensor
    mask: Tensor
    clipped: Tensor
    ratio: Tensor
    metric_tensors: dict[str, Tensor]

    @property
    def metrics(self) -> dict[str, float]:
        """The metrics as floats (one read-back of all of them); as `policy_loss`."""
        return metric_floats(dict(self.metric_tensors))


def token_policy_loss(
    config: EstimatorConfig,
    logp: Tensor,
    ref_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    behaviour_logp: Tensor | None = None,
    correction: OffPolicyCorrection | None = None,
    nonfinite: NonFinitePolicy = "raise",
    token_versions: Tensor | None = None,
) -> TokenPolicyLoss:
    """Per-token clipped surrogate of the estimator `config` (times the behaviour weights).

    What `compute_policy_loss` aggregates; the framework integrations (kpo_core.integrations)
    aggregate it with the framework's own normalisers instead. `token_versions` [B, T]: the
    policy version that sampled each token, read by KPO's `version_switch` (None: each row
    was sampled by one version); the other estimators do not depend on it.
    """
    if nonfinite not in get_args(NonFinitePolicy):
        raise ValueError(f"nonfinite must be one of {get_args(NonFinitePolicy)}, got {nonfinite!r}")
    mask = mask.to(torch.bool)
    adv = _broadcast_advantages(advantages, mask)
    inputs = {"logp": logp, "ref_logp": ref_logp, "advantages": adv}
    if behaviour_logp is not None:
        inputs["behaviour_logp"] = behaviour_logp
    mask, dropped = _check_inputs(inputs, mask, nonfinite)
    # Padding often holds -inf/NaN log-probs. where() (not a product) keeps them out of the
    # values and out of the gradient: 0 * NaN would otherwise reach the model's parameters.
    logp = torch.where(mask, logp, 0.0)
    ref_logp = torch.where(mask, ref_logp, 0.0).detach()
    if behaviour_logp is not None:
        behaviour_logp = torch.where(mask, behaviour_logp, 0.0).detach()
    adv = torch.where(mask, adv, 0.0).detach()
    estimate = get_estimator(config.name).estimate(
        logp, ref_logp, adv, mask, config, token_versions
    )
    per_token, clipped = clipped_surrogate(estimate, adv, mask)
    metrics = _loss_metrics(logp, ref_logp, estimate, clipped, mask)
    if behaviour_logp is not None:
        weights, weight_metrics = behaviour_weight_tensors(
            ref_logp, behaviour_logp, mask, correction or OffPolicyCorrection()
        )
        per_token = per_token * weights
        metrics.update(weight_metrics)
    metrics["nonfinite_tokens"] = dropped
    metrics["extreme_ratio_tokens"] = _extreme_tokens(logp, ref_logp, behaviour_logp, mask)
    one = torch.ones((), dtype=estimate.ratio.dtype, device=estimate.ratio.device)
    ratio = torch.where(mask, estimate.ratio.detach(), one)
    device = mask.device
    # Floats (a custom estimator's metrics) go to the device too: one dtype, one device, so
    # that a caller can stack them all into one read.
    tensors = {
        key: torch.as_tensor(value, device=device).to(torch.float64).reshape(())
        for key, value in metrics.items()
    }
    return TokenPolicyLoss(per_token, mask, clipped, ratio, tensors)


def _extreme_tokens(
    logp: Tensor, ref_logp: Tensor, behaviour_logp: Tensor | None, mask: Tensor
) -> Tensor:
    """Valid tokens with |z| or (with behaviour_logp) |log w| above MAX_ABS_LOG_RATIO."""
    with torch.no_grad():
        logp = logp.detach()
        extreme = masked_log_ratio(logp, ref_logp, mask).abs()
        if behaviour_logp is not None:
            log_w = masked_log_ratio(ref_logp, behaviour_logp, mask).abs()
            extreme = torch.maximum(extreme, log_w)
        return extreme_token_count(extreme, mask)


def _masked_extreme(values: Tensor, mask: Tensor, largest: bool, empty: float) -> Tensor:
    """Max (or min) of `values` over `mask`, `empty` for an empty mask; 0-dim, no read-back."""
    if not values.numel():
        return values.new_tensor(empty)
    fill = -torch.inf if largest else torch.inf
    kept = torch.where(mask, values, fill)
    top = kept.amax() if largest else kept.amin()
    return torch.where(mask.any(), top, empty)


def _loss_metrics(
    logp: Tensor, ref_logp: Tensor, estimate: RatioEstimate, clipped: Tensor, mask: Tensor
) -> dict[str, Tensor | float]:
    # Masked reductions through where(), not boolean indexing: nothing here reads a value or a
    # data-dependent shape back to the host. An empty mask reports the on-policy placeholders
    # (ratios 1, no clipping, no KL).
    with torch.no_grad():
        ratio = estimate.ratio.detach()
        kl = kl_k3(logp.detach(), ref_logp.detach())
        metrics: dict[str, Tensor | float] = {
            "clip_fraction": masked_mean_or(clipped.to(torch.float64), mask, 0.0),
            "ratio_mean": masked_mean_or(ratio, mask, 1.0),
            "ratio_max": _masked_extreme(ratio, mask, largest=True, empty=1.0),
            "ratio_min": _masked_extreme(ratio, mask, largest=False, empty=1.0),
            "approx_kl": masked_mean_or(kl, mask, 0.0),
        }
    return {**metrics, **estimate.metrics}
