"""Importance-ratio estimators, registered by name, and the off-policy weights for stale data.

Shapes: logp, ref_logp, mask [B, T]; advantages [B, T] (already broadcast). z_t = logp - ref_logp
is the token log-ratio against the reference policy (behaviour or proximal, SPEC.md).

Each estimator turns (logp, ref_logp, advantages, mask) into a `RatioEstimate`: the ratio as a
differentiable tensor plus the clip window the surrogate in `kpo_core.losses` applies to it.

- `token` (GRPO/PPO): rho_t = exp(clamp(z_t, -20, 20)).
- `sequence` (GSPO, arXiv 2507.18671): rho_t = exp(sg(mean z) + logp_t - sg(logp_t)).
- `geometric` (GMPO, arXiv 2507.20673): rho = exp(clamp(mean z~, -20, 20)), z~ the sign-trick
  log-space clip.
- `kalman` (KPO, arXiv 2602.10609): rho_t = exp(min(sg(x_t) + logp_t - sg(logp_t), 10)), x the
  Kalman-filtered z; or autograd through x with `gradient="through_filter"`. Options: constants
  matched to a reference length, a diffuse prior with a clip in posterior standard deviations,
  and PPO's token clip as a backstop (`KalmanEstimator`).
- `cumulative` (CTPO, arXiv 2605.07331): rho_t = exp(min(sg(c_t) + logp_t - sg(logp_t), 10)),
  c_t = sum_{k<=t} m_k z_k, clipped to [exp(-eps_low sqrt n_t), exp(eps_high sqrt n_t)].

Masked positions (SPEC.md, "Multi-turn responses"): padding and the observation tokens of a
multi-turn response (tool output placed in the context; no behaviour log-prob, no loss) are
both off `mask`, and every estimator reads only its valid tokens, wherever the masked runs sit:
lengths, means, sums and positions count valid (model) tokens, so a response with an
observation in it gets, on its model tokens, the values of the same response with the
observation cut out. Each estimator's docstring says what that means for it.

Extreme inputs (docs/numerics.md): z is held to +-`LOG_RATIO_LIMIT` (far beyond any real
log-ratio: a float32 probability cannot go below e^-104), so that no sum or filter over a
response can overflow, and every ratio is exp of a log-ratio capped at `MAX_ABS_LOG_RATIO` (20)
or at the estimator's `max_log_ratio`. Any finite input therefore gives finite ratios, loss and
gradient. A valid token with |z| > `MAX_ABS_LOG_RATIO` is an extreme token
(`count_extreme_tokens`, the loss's `extreme_ratio_tokens`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
from pydantic import BaseModel
from torch import Tensor

from kpo_core.config import (
    CumulativeEstimator,
    EstimatorConfig,
    GeometricEstimator,
    KalmanEstimator,
    OffPolicyCorrection,
    SequenceEstimator,
    TokenEstimator,
)
from kpo_core.kalman import version_aware_filter

Bound = Tensor | float | None

# |log-ratio| beyond which a ratio saturates: the token estimator clamps z to +-20 before exp
# (rho in [2e-9, 4.9e8]), GMPO's mean log-ratio and the decoupled-PPO log-weights are capped
# there too, and tokens past it are counted as extreme.
MAX_ABS_LOG_RATIO = 20.0
# Bound on z itself: T tokens of it sum to at most T * 1e6, finite in float32 for any length.
LOG_RATIO_LIMIT = 1e6


@dataclass(frozen=True)
class RatioEstimate:
    """What an estimator hands the clipped surrogate.

    ratio: [B, T] with the estimator's gradient path. clip_low/clip_high: the ratio window
    (scalars or [B, T]); None for an unclipped surrogate -A * rho. dual_clip: ratio cap for A < 0.
    clipped: [B, T] bool for estimators that clip inside the ratio (GMPO), else None (the
    surrogate decides). backstop: [B, T] bool of tokens that get no gradient on top of the
    window (KPO's `token_clip`), counted as clipped. metrics: estimator-specific values, 0-dim
    tensors on the ratio's device (or floats): the built-in estimators never read a value back to
    the host, so that a training step need not wait on the device for its metrics.
    """

    ratio: Tensor
    clip_low: Bound
    clip_high: Bound
    dual_clip: Bound = None
    clipped: Tensor | None = None
    metrics: dict[str, Tensor | float] = field(default_factory=dict)
    backstop: Tensor | None = None


ConfigT = TypeVar("ConfigT", bound=BaseModel)
EstimatorFn = Callable[..., RatioEstimate]
EstimatorFnT = TypeVar("EstimatorFnT", bound=EstimatorFn)


@dataclass(frozen=True)
class RegisteredEstimator:
    """An estimator function `fn(logp, ref_logp, advantages, mask, config)`, which may also
    take `token_versions` by keyword (`reads_versions`: KPO's `version_switch` reads them)."""

    name: str
    config_type: type[BaseModel]
    fn: EstimatorFn
    reads_versions: bool

    def estimate(
        self,
        logp: Tensor,
        ref_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        config: Any,
        token_versions: Tensor | None = None,
    ) -> RatioEstimate:
        """The estimate of `config`; `token_versions` [B, T] (the policy version that sampled
        each token, None: one per row) reaches the estimators that read them."""
        if self.reads_versions:
            return self.fn(logp, ref_logp, advantages, mask, config, token_versions=token_versions)
        return self.fn(logp, ref_logp, advantages, mask, config)

    def make_config(self, **options: Any) -> EstimatorConfig:
        """This estimator's config from `options`; pydantic's ValidationError if invalid."""
        return cast("EstimatorConfig", self.config_type(**options))


ESTIMATORS: dict[str, RegisteredEstimator] = {}


def register_estimator(
    name: str, config_type: type[ConfigT]
) -> Callable[[EstimatorFnT], EstimatorFnT]:
    """Register an estimator function under `name` with its pydantic config type: it is called
    as fn(logp, ref_logp, advantages, mask, config), with `token_versions=` too when its
    signature names that parameter."""

    def decorator(fn: EstimatorFnT) -> EstimatorFnT:
        if name in ESTIMATORS:
            raise ValueError(f"estimator {name!r} is already registered")
        reads_versions = "token_versions" in inspect.signature(fn).parameters
        ESTIMATORS[name] = RegisteredEstimator(name, config_type, fn, reads_versions)
        return fn

    return decorator


def get_estimator(name: str) -> RegisteredEstimator:
    """The registered estimator called `name`; ValueError listing the valid names otherwise."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown estimator {name!r}; valid estimators: {', '.join(sorted(ESTIMATORS))}"
        ) from None


def masked_log_ratio(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """z = logp - ref_logp on valid tokens, 0 elsewhere (padding may hold -inf or NaN).

    z is clamped to +-`LOG_RATIO_LIMIT` (a difference of two finite float32 values can
    overflow to inf); real log-ratios never get near it.
    """
    z = (logp - ref_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.where(mask, z, 0.0)


def count_extreme_tokens(log_ratio: Tensor, mask: Tensor) -> int:
    """Valid tokens whose |log-ratio| exceeds `MAX_ABS_LOG_RATIO` (NaN counts as not extreme)."""
    return int(extreme_token_count(log_ratio, mask))


def extreme_token_count(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """`count_extreme_tokens` as a 0-dim int64 tensor on the device (no read-back)."""
    return ((log_ratio.abs() > MAX_ABS_LOG_RATIO) & mask).sum()


def straight_through(log_value: Tensor, logp: Tensor) -> Tensor:
    """A log-ratio whose value is `log_value` (detached) and whose gradient is that of logp."""
    return log_value.detach() + logp - logp.detach()


def valid_counts(mask: Tensor) -> Tensor:
    """n_t: number of valid tokens up to and including t, [B, T] int64."""
    return mask.to(torch.long).cumsum(-1)


@register_estimator("token", TokenEstimator)
def token_ratio(
    logp: Tensor, ref_logp: Tensor, advantages: Tensor, mask: Tensor, cfg: TokenEstimator
) -> RatioEstimate:
    """GRPO/PPO: each token's own ratio exp(z_t), clipped to [1 - clip_low, 1 + clip_high].

    Across an observation nothing carries over: each model token stands alone, and the masked
    observation tokens get ratio 1 and no loss.
    """
    z = masked_log_ratio(logp, ref_logp, mask).clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    return RatioEstimate(z.exp(), 1.0 - cfg.clip_low, 1.0 + cfg.clip_high, cfg.dual_clip_c)


def _sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over each response's valid tokens, [B, T] -> [B, 1]; 0 for an empty response."""
    lengths = mask.sum(-1, keepdim=True).clamp_min(1)
    return (values * mask).sum(-1, keepdim=True) / lengths


@register_estimator("sequence", SequenceEstimator)
def sequence_ratio(
    logp: Tensor, ref_logp: Tensor, advantages: Tensor, mask: Tensor, cfg: SequenceEstimator
) -> RatioEstimate:
    """GSPO: the sequence ratio exp(mean z) over the response's valid tokens, on every token
    with the token's own gradient (straight through).

    Across an observation: the mean and its length count model tokens only (an observation
    adds neither a term nor a token), so the ratio is that of the response without it.
    """
    log_s = _sequence_mean(masked_log_ratio(logp, ref_logp, mask), mask)
    log_rho = straight_through(log_s.expand_as(logp), logp).clamp(max=cfg.max_log_ratio)
    return RatioEstimate(log_rho.exp(), 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)


@register_estimator("geometric", GeometricEstimator)
def geometric_ratio(
    logp: Tensor, ref_logp: Tensor, advantages: Tensor, mask: Tensor, cfg: GeometricEstimator
) -> RatioEstimate:
    """GMPO: exp of the mean of the sign-trick clipped log-ratios z~ over the valid tokens.

    Across an observation: the geometric mean and its length count model tokens only, as for
    GSPO; observation tokens are never clipped (they are not tokens of the mean).
    """
    z = masked_log_ratio(logp, ref_logp, mask)
    sign = torch.sign(advantages)
    z_clamped = z.clamp(-cfg.clip_low, cfg.clip_high)
    # z~ = sgn(A) min(sgn(A) z, sgn(A) clamp(z)): pessimistic in the direction the advantage
    # pushes, so a positive advantage cannot lift rho past e^eps_high (nor a negative push it
    # below e^-eps_low).
    z_tilde = sign * torch.minimum(sign * z, sign * z_clamped)
    # For A < 0 the sign trick leaves log rho unbounded above (GMPO's code has no cap): cap it
    # like the token estimator's z, so that exp cannot overflow.
    log_rho = _sequence_mean(z_tilde, mask).clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    rho = log_rho.exp().expand_as(logp)
    clipped = (z_tilde != z) & mask
    return RatioEstimate(rho, None, None, clipped=clipped)


def _version_aware_filter(
    z: Tensor, mask: Tensor, cfg: KalmanEstimator, token_versions: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The filtered log-ratios and the gains, [B, T] each, with `cfg.version_switch` applied
    at the tokens where the sampling version changed (SPEC.md; `version_aware_filter`)."""
    return version_aware_filter(
        z,
        mask,
        token_versions,
        cfg.effective_q,
        cfg.r,
        cfg.effective_p0,
        cfg.x0,
        cfg.version_switch,
        cfg.switch_q,
    )


@register_estimator("kalman", KalmanEstimator)
def kalman_ratio(
    logp: Tensor,
    ref_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: KalmanEstimator,
    token_versions: Tensor | None = None,
) -> RatioEstimate:
    """KPO: the Kalman-filtered log-ratio x_t (`kpo_core.kalman`) as the ratio's log.

    Across an observation: an observation token is no measurement of the filter, exactly as a
    masked token: no update, x and P carry over to the next model token, and the gain table's
    count t (hence the gains, the posterior-width clip window and `reference_length`'s
    matching) counts model tokens only.

    token_versions: [B, T] the policy version that sampled each token (read on valid tokens
    only), for `cfg.version_switch`; None: every row sampled by one version.
    """
    z = masked_log_ratio(logp, ref_logp, mask)
    q = cfg.effective_q
    if cfg.gradient == "straight_through":
        # The paper's code: observations detached, filtered value as a straight-through weight.
        x, gains = _version_aware_filter(z.detach(), mask, cfg, token_versions)
        log_rho = straight_through(x, logp)
    else:
        x, gains = _version_aware_filter(z, mask, cfg, token_versions)
        log_rho = x
    rho = log_rho.clamp(max=cfg.max_log_ratio).exp()
    metrics = _kalman_metrics(x.detach(), gains, mask, cfg.max_log_ratio)
    backstop = None
    if cfg.token_clip is not None:
        backstop = token_backstop(z.detach(), advantages, mask, *cfg.token_clip)
        metrics["token_backstop_fraction"] = _fraction(backstop, mask)
    if not cfg.clipped:
        return RatioEstimate(rho, None, None, metrics=metrics, backstop=backstop)
    low, high = cfg.effective_clip
    if cfg.clip_mode == "ratio":
        return RatioEstimate(rho, 1.0 - low, 1.0 + high, metrics=metrics, backstop=backstop)
    # The posterior standard deviation of x_t is sqrt(K_t R); in units of sqrt(R) the window
    # k sqrt(K_t) with k = eps / (q/r)^(1/4) meets eps where K_t reaches sqrt(q/r), its
    # steady state, and is wider while the filter has seen few tokens.
    spread = gains.sqrt().to(logp.dtype) / (q / cfg.r) ** 0.25
    return RatioEstimate(
        rho, torch.exp(-low * spread), torch.exp(high * spread), metrics=metrics, backstop=backstop
    )


def token_backstop(
    log_ratio: Tensor, advantages: Tensor, mask: Tensor, low: float, high: float
) -> Tensor:
    """[B, T] bool: valid tokens whose raw ratio exp(z) left [1 - low, 1 + high] in the
    direction their advantage pushes (PPO's clip condition), which then get no gradient."""
    above = (advantages > 0) & (log_ratio > math.log1p(high))
    below = (advantages < 0) & (log_ratio < math.log1p(-low))
    return (above | below) & mask


def _fraction(flags: Tensor, mask: Tensor) -> Tensor:
    """The share of `mask`'s tokens that are flagged, 0-dim float64 (0 for an empty mask)."""
    return flags.sum(dtype=torch.float64) / mask.sum().clamp_min(1)


def masked_mean_or(values: Tensor, mask: Tensor, empty: float) -> Tensor:
    """Mean of `values` over `mask` as a 0-dim tensor, `empty` when the mask has no token.

    where(), not boolean indexing: the result's shape never depends on the data, so nothing is
    read back to the host (NaN or inf off the mask stay out of the sum).
    """
    count = mask.sum()
    total = torch.where(mask, values, 0.0).sum()
    mean = total / count.clamp_min(1)
    return torch.where(count > 0, mean, torch.full_like(mean, empty))


def _kalman_metrics(
    x: Tensor, gains: Tensor, mask: Tensor, max_log_ratio: float
) -> dict[str, Tensor | float]:
    # With x0 = 0 the filtered value is a weighted sum of the log-ratios so far whose weights
    # add up to W_t = 1 - prod(1 - K): how far the filter has moved from its prior.
    shrinkage = -torch.expm1(torch.log1p(-gains).cumsum(-1))
    # An empty mask reports the prior: no gain, no shrinkage, ratio 1.
    return {
        "kalman_gain_mean": masked_mean_or(gains, mask, 0.0),
        "kalman_shrinkage_mean": masked_mean_or(shrinkage, mask, 0.0),
        "filtered_ratio_mean": masked_mean_or(x.clamp(max=max_log_ratio).exp(), mask, 1.0),
    }


@register_estimator("cumulative", CumulativeEstimator)
def cumulative_ratio(
    logp: Tensor, ref_logp: Tensor, advantages: Tensor, mask: Tensor, cfg: CumulativeEstimator
) -> RatioEstimate:
    """CTPO: the cumulative log-ratio c_t = sum_{k<=t} m_k z_k as the ratio's log, clipped to
    a window that widens like sqrt(n_t).

    Across an observation: c_t sums model tokens only (an observation adds 0 and c carries
    over), and n_t, the clip scale's position, counts model tokens only (`valid_counts`), not
    the column: the second turn's first model token continues the first turn's count.
    """
    cumulative = masked_log_ratio(logp, ref_logp, mask).cumsum(-1)
    rho = straight_through(cumulative, logp).clamp(max=cfg.max_log_ratio).exp()
    # The cumulative log-ratio's spread grows like sqrt(t), so the window does too.
    root_n = valid_counts(mask).clamp_min(1).to(logp.dtype).sqrt()
    lower = torch.exp(-cfg.clip_low * root_n)
    upper = torch.exp(cfg.clip_high * root_n)
    dual = None if cfg.dual_clip_c is None else torch.exp(cfg.dual_clip_c * root_n)
    return RatioEstimate(rho, lower, upper, dual)


def behaviour_weights(
    ref_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, cfg: OffPolicyCorrection
) -> tuple[Tensor, dict[str, float]]:
    """`behaviour_weight_tensors` with its metrics read back as floats (one read)."""
    w, metrics = behaviour_weight_tensors(ref_logp, behaviour_logp, mask, cfg)
    return w, metric_floats(metrics)


def metric_floats(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """Metrics of 0-dim tensors (or floats) as floats, read back in one transfer.

    A NaN marks a metric with no value (e.g. a weight statistic over no token): it is left out.
    """
    if not metrics:
        return {}
    tensors = [v for v in metrics.values() if isinstance(v, Tensor)]
    device = tensors[0].device if tensors else None
    values = [torch.as_tensor(v, dtype=torch.float64, device=device) for v in metrics.values()]
    floats = torch.stack(values).tolist()
    return {key: value for key, value in zip(metrics, floats, strict=True) if not math.isnan(value)}


def behaviour_weight_tensors(
    ref_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, cfg: OffPolicyCorrection
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """Detached decoupled-PPO weights w = pi_ref / pi_behaviour, [B, T], with TIS/MIS applied.

    Token level: w_t = exp(ref_logp_t - behaviour_logp_t). Sequence level: the product of a
    response's token weights, broadcast to its tokens; sequence-mean level: their geometric
    mean exp(mean log w). Products and means run over `mask`'s tokens only: the observation
    tokens of a multi-turn response (no behaviour log-prob) are neither factors nor counted.
    Truncation min(w, tis_cap) comes first, then weights outside [mis_low, mis_high] are zeroed
    (the token stays in the denominators).
    """
    with torch.no_grad():
        log_w = masked_log_ratio(ref_logp, behaviour_logp, mask)
        if cfg.level == "sequence":
            log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
        elif cfg.level == "sequence-mean":
            log_w = _sequence_mean(log_w, mask).expand_as(log_w)
        w = log_w.clamp(max=MAX_ABS_LOG_RATIO).exp()
        metrics: dict[str, Tensor | float] = {}
        if cfg.tis_cap is not None:
            metrics["tis_truncated_fraction"] = _fraction((w > cfg.tis_cap) & mask, mask)
            w = w.clamp(max=cfg.tis_cap)
        if cfg.mis_low is not None or cfg.mis_high is not None:
            low = cfg.mis_low if cfg.mis_low is not None else 0.0
            high = cfg.mis_high if cfg.mis_high is not None else float("inf")
            outside = ((w < low) | (w > high)) & mask
            metrics["mis_masked_fraction"] = _fraction(outside, mask)
            w = torch.where(outside, 0.0, w)
        w = torch.where(mask, w, 0.0)
        # Over no token the statistics have no value: NaN, which `metric_floats` leaves out.
        metrics["behaviour_weight_mean"] = masked_mean_or(w, mask, math.nan)
        top = torch.where(mask, w, -math.inf).amax() if w.numel() else w.new_tensor(-math.inf)
        metrics["behaviour_weight_max"] = torch.where(mask.any(), top, math.nan)
    return w, metrics
