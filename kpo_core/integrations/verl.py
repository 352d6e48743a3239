"""kpo_core's estimators as verl policy losses (verl >= 0.9; see docs/integrations.md).

Importing this module registers, in verl's policy-loss registry:

    kpo                  KPO: Kalman-filtered token ratios (estimator `kalman`)
    ctpo                 CTPO: cumulative token ratio, sqrt(t)-scaled window (`cumulative`)
    kpo_core.<name>      every kpo_core estimator by its own name: token, sequence,
                         geometric, kalman, cumulative

verl loads it by itself: the package declares it as a `verl.plugins` entry point, which verl
imports whenever `verl` is imported (unless VERL_USE_EXTERNAL_PLUGINS=none), in the trainer and
in every Ray worker alike. So `actor_rollout_ref.actor.policy_loss.loss_mode=kpo` is all a run
needs.

verl's conventions hold: the clip window is the actor's `clip_ratio_low`/`clip_ratio_high` (or
`clip_ratio`), the token estimator's dual clip is `clip_ratio_c`, the loss is aggregated by verl's
`agg_loss` with the actor's `loss_agg_mode` and `global_batch_info` (so micro-batches and data-
parallel ranks add up to the mini-batch loss), and `rollout_is_weights` multiply the per-token
loss (a response's geometric mean of them for the sequence-level `geometric` estimator, as verl's
`geo_mean` does). Other estimator options (q, r, p0, x0, gradient, clipped, max_log_ratio,
CTPO's dual_clip_c) come from `KpoPolicyLossConfig.estimator_options`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast, get_args

import torch
from torch import Tensor
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, agg_loss, register_policy_loss
from verl.workers.config import PolicyLossConfig

from kpo_core.config import EstimatorConfig
from kpo_core.integrations.options import check_truncated_sampling, framework_estimator_config
from kpo_core.losses import NonFinitePolicy, token_policy_loss
from kpo_core.ratios import get_estimator

# verl loss name -> kpo_core estimator.
VERL_LOSSES: dict[str, str] = {
    "kpo": "kalman",
    "ctpo": "cumulative",
    **{
        f"kpo_core.{name}": name
        for name in ("token", "sequence", "geometric", "kalman", "cumulative")
    },
}
_ACTOR_PATH = "actor_rollout_ref.actor"
_ROLLOUT_PATH = "actor_rollout_ref.rollout"
_OPTIONS_PATH = f"{_ACTOR_PATH}.policy_loss.estimator_options"
_RESPONSE_LENGTH_PATH = (
    f"{_ACTOR_PATH}.policy_loss.response_length "
    "(=${actor_rollout_ref.rollout.response_length}, verl's response limit)"
)

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Any]]]


@dataclass
class KpoPolicyLossConfig(PolicyLossConfig):  # type: ignore[misc]
    """verl's policy-loss config plus kpo_core's estimator options.

    Select it with `actor_rollout_ref.actor.policy_loss._target_=` this class's path, then add
    options with `+actor_rollout_ref.actor.policy_loss.estimator_options.q=1e-5` (see
    docs/integrations.md). `nonfinite`: "raise" stops on NaN/inf in a valid token's inputs;
    "mask" drops those tokens and reports their count as `actor/kpo/nonfinite_tokens`.
    """

    estimator_options: dict[str, Any] = field(default_factory=dict)
    nonfinite: str = "raise"
    # verl's response limit, which KPO's `reference_length: auto` resolves to. The actor config
    # does not hold it (the rollout's does): `${actor_rollout_ref.rollout.response_length}`.
    response_length: int | None = None
    # Truncated training sampling (`check_truncated_sampling`): None or "allow" trains on it as
    # verl does, "refuse" refuses it; "replay" is refused (verl's rollout does not record each
    # token's kept set). The rollout's settings, which the actor config does not hold either:
    # `${actor_rollout_ref.rollout.top_p}` and `${actor_rollout_ref.rollout.top_k}`.
    truncated_sampling: str | None = None
    rollout_top_p: float | None = None
    rollout_top_k: int | None = None


def estimator_config(estimator: str, actor_config: Any) -> EstimatorConfig:
    """The kpo_core config of `estimator` under verl's actor config (clip ratios and options).

    ValueError naming the option and the config path for an unknown or invalid option.
    """
    clip = actor_config.get("clip_ratio", 0.2)
    low = actor_config.get("clip_ratio_low")
    high = actor_config.get("clip_ratio_high")
    # Options verl's actor config owns: option -> (its key there, its value).
    from_actor = {
        "clip_low": (f"{_ACTOR_PATH}.clip_ratio_low", clip if low is None else low),
        "clip_high": (f"{_ACTOR_PATH}.clip_ratio_high", clip if high is None else high),
    }
    if estimator == "token":
        dual_clip = actor_config.get("clip_ratio_c", 3.0)
        from_actor["dual_clip_c"] = (f"{_ACTOR_PATH}.clip_ratio_c", dual_clip)
    section = _policy_loss_section(actor_config)
    options = section.get("estimator_options") or {}
    length = (_RESPONSE_LENGTH_PATH, section.get("response_length"))
    return framework_estimator_config(estimator, options, from_actor, _OPTIONS_PATH, length)


def _policy_loss_section(actor_config: Any) -> Mapping[str, Any]:
    section = actor_config.get("policy_loss")
    return section if section is not None else {}


def _nonfinite_policy(actor_config: Any) -> NonFinitePolicy:
    policy = _policy_loss_section(actor_config).get("nonfinite") or "raise"
    if policy not in get_args(NonFinitePolicy):
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.nonfinite must be 'raise' or 'mask', "
            f"got {policy!r}"
        )
    return cast(NonFinitePolicy, policy)


def _check_truncation(actor_config: Any) -> None:
    """`check_truncated_sampling` of the policy-loss section's mode and rollout settings."""
    section = _policy_loss_section(actor_config)
    top_p, top_k = section.get("rollout_top_p"), section.get("rollout_top_k")
    truncating: dict[str, Any] = {}
    if top_p is not None and top_p < 1.0:
        truncating[f"{_ROLLOUT_PATH}.top_p"] = top_p
    if top_k is not None and top_k > 0:  # verl's -1 (and 0) keep every token
        truncating[f"{_ROLLOUT_PATH}.top_k"] = top_k
    mode_setting = f"{_ACTOR_PATH}.policy_loss.truncated_sampling"
    check_truncated_sampling(section.get("truncated_sampling"), truncating, mode_setting)


def rollout_weights(weights: Tensor, mask: Tensor, estimator: str) -> Tensor:
    """verl's rollout-correction weights as applied to the per-token loss, 0 off the mask.

    Sequence-level ratios (`geometric`) take each response's geometric mean of its token
    weights, as verl's geo_mean does; the others use the token weights as they are.
    """
    weights = torch.where(mask, weights, 0.0).detach()
    if estimator != "geometric":
        return weights
    lengths = mask.sum(-1, keepdim=True).clamp_min(1)
    log_weights = torch.where(mask, weights.clamp_min(1e-10).log(), 0.0)
    return (log_weights.sum(-1, keepdim=True) / lengths).exp().expand_as(weights)


def make_policy_loss(estimator: str) -> PolicyLossFn:
    """A verl policy-loss function (verl's signature) computing `estimator`'s loss."""
    get_estimator(estimator)

    def policy_loss(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        if config is None:
            raise ValueError(f"kpo_core's {estimator!r} loss needs verl's actor config")
        _check_truncation(config)
        token_loss = token_policy_loss(
            estimator_config(estimator, config),
            log_prob,
            old_log_prob,
            advantages,
            response_mask,
            nonfinite=_nonfinite_policy(config),
        )
        per_token, mask = token_loss.per_token, token_loss.mask
        if rollout_is_weights is not None:
            per_token = per_token * rollout_weights(rollout_is_weights, mask, estimator)
        loss = agg_loss(
            loss_mat=per_token,
            loss_mask=mask,
            loss_agg_mode=loss_agg_mode,
            **(config.get("global_batch_info") or {}),
        )
        return loss, _verl_metrics(
            old_log_prob, log_prob, advantages, token_loss.clipped, mask, token_loss.metrics
        )

    policy_loss.__name__ = policy_loss.__qualname__ = f"kpo_core_{estimator}_policy_loss"
    return policy_loss


def _verl_metrics(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    clipped: Tensor,
    mask: Tensor,
    kpo_metrics: dict[str, float],
) -> dict[str, Any]:
    """verl's three policy metrics, then kpo_core's own under actor/kpo/."""
    with torch.no_grad():
        valid = mask.sum().clamp_min(1)
        negative_kl = torch.where(mask, old_log_prob - log_prob.detach(), 0.0)
        lower = clipped & (advantages < 0)
        metrics: dict[str, Any] = {
            "actor/pg_clipfrac": kpo_metrics["clip_fraction"],
            "actor/ppo_kl": float(negative_kl.sum() / valid),
            "actor/pg_clipfrac_lower": float(lower.sum() / valid),
        }
    metrics.update({f"actor/kpo/{key}": value for key, value in kpo_metrics.items()})
    return metrics


def register_verl_losses() -> list[str]:
    """Register every loss of `VERL_LOSSES` in verl's registry; the names registered.

    Idempotent. A name verl already uses for a loss of its own is left alone, with a warning.
    """
    registered = []
    for name, estimator in VERL_LOSSES.items():
        existing = POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and existing.__module__ != __name__:
            warnings.warn(
                f"verl already has a policy loss called {name!r}; kpo_core's {estimator!r} "
                f"stays available as 'kpo_core.{estimator}'",
                stacklevel=2,
            )
            continue
        register_policy_loss(name)(make_policy_loss(estimator))
        registered.append(name)
    return registered


register_verl_losses()
