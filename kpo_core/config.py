"""Pydantic models of the algorithm part of a run, shared by YAML run files and the REST API.

Every model is strict (`extra="forbid"`): a typo in a key is an error naming the key, and a bad
value is an error naming the field and the valid values. Estimators are a discriminated union on
`name`, so adding one means one config class here and one function in `kpo_core.ratios`.
Defaults are the papers' (see SPEC.md): KPO from arXiv 2602.10609's official code, CTPO from
arXiv 2605.07331, GSPO 2507.18671, GMPO 2507.20673.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

LossAggMode = Literal[
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
GradientMode = Literal["straight_through", "through_filter"]


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class _ClippedEstimator(StrictModel):
    clip_low: float = Field(ge=0.0, lt=1.0, description="ratio clipped below at 1 - clip_low")
    clip_high: float = Field(ge=0.0, description="ratio clipped above at 1 + clip_high")


class TokenEstimator(_ClippedEstimator):
    """GRPO/PPO token ratio rho_t = exp(z_t), clipped to [1 - clip_low, 1 + clip_high]."""

    name: Literal["token"] = "token"
    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    clip_high: float = Field(0.2, ge=0.0)
    dual_clip_c: float | None = Field(
        3.0, gt=1.0, description="for A < 0 the loss is capped at c*|A|; null disables"
    )
    default_loss_agg_mode: ClassVar[LossAggMode] = "token-mean"


class SequenceEstimator(_ClippedEstimator):
    """GSPO: the length-normalised sequence ratio exp(mean z), applied per token."""

    name: Literal["sequence"] = "sequence"
    clip_low: float = Field(3e-4, ge=0.0, lt=1.0)
    clip_high: float = Field(4e-4, ge=0.0)
    max_log_ratio: float = Field(10.0, gt=0.0, description="cap on log rho before exp")
    default_loss_agg_mode: ClassVar[LossAggMode] = "seq-mean-token-mean"


class GeometricEstimator(_ClippedEstimator):
    """GMPO: geometric mean of token ratios, each clipped in log space with the sign trick."""

    name: Literal["geometric"] = "geometric"
    clip_low: float = Field(0.4, ge=0.0)
    clip_high: float = Field(0.4, ge=0.0)
    default_loss_agg_mode: ClassVar[LossAggMode] = "seq-mean-token-mean"


class KalmanEstimator(_ClippedEstimator):
    """KPO: token log-ratios smoothed by a causal Kalman filter, as straight-through weights."""

    name: Literal["kalman"] = "kalman"
    q: float = Field(1e-6, ge=0.0, description="process noise variance Q")
    r: float = Field(1.0, gt=0.0, description="measurement noise variance R")
    p0: float = Field(0.0, ge=0.0, description="initial state variance")
    x0: float = Field(0.0, description="initial state mean (log-ratio)")
    gradient: GradientMode = "straight_through"
    clipped: bool = True
    clip_low: float = Field(3e-4, ge=0.0, lt=1.0)
    clip_high: float = Field(4e-4, ge=0.0)
    max_log_ratio: float = Field(10.0, gt=0.0, description="cap on log rho before exp")
    default_loss_agg_mode: ClassVar[LossAggMode] = "seq-mean-token-mean"


class CumulativeEstimator(_ClippedEstimator):
    """CTPO: cumulative token ratio with a sqrt(n_t)-scaled clip window in log space."""

    name: Literal["cumulative"] = "cumulative"
    clip_low: float = Field(0.025, ge=0.0, description="log rho >= -clip_low * sqrt(n_t)")
    clip_high: float = Field(0.05, ge=0.0, description="log rho <= clip_high * sqrt(n_t)")
    dual_clip_c: float | None = Field(
        0.05, gt=0.0, description="for A < 0 the ratio is capped at exp(c * sqrt(n_t))"
    )
    max_log_ratio: float = Field(10.0, gt=0.0, description="cap on log rho before exp")
    default_loss_agg_mode: ClassVar[LossAggMode] = "token-mean"


EstimatorConfig = Annotated[
    TokenEstimator | SequenceEstimator | GeometricEstimator | KalmanEstimator | CumulativeEstimator,
    Field(discriminator="name"),
]


class OffPolicyCorrection(StrictModel):
    """Decoupled PPO (AReaL): weight each token's loss by the detached w = pi_ref / pi_behaviour.

    `tis_cap` truncates w at C (TIS); `mis_low`/`mis_high` zero the weight outside [lo, hi]
    (IcePop/MIS). `level="sequence"` uses the product of a response's token weights.
    """

    level: Literal["token", "sequence"] = "token"
    tis_cap: float | None = Field(None, gt=0.0)
    mis_low: float | None = Field(None, ge=0.0)
    mis_high: float | None = Field(None, gt=0.0)

    @model_validator(mode="after")
    def _bounds_ordered(self) -> OffPolicyCorrection:
        if self.mis_low is not None and self.mis_high is not None and self.mis_low >= self.mis_high:
            raise ValueError(f"mis_low ({self.mis_low}) must be below mis_high ({self.mis_high})")
        return self


class AdvantageConfig(StrictModel):
    """Group-relative advantages (see kpo_core.advantages)."""

    mode: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    eps: float = Field(1e-6, ge=0.0)
    std_unbiased: bool = True


class AlgorithmConfig(StrictModel):
    """What the learner optimises: estimator, aggregation, advantages and stale-data correction."""

    estimator: EstimatorConfig = Field(default_factory=KalmanEstimator)
    loss_agg_mode: LossAggMode | None = Field(
        None, description="null: the estimator's default aggregation"
    )
    norm_length: int | None = Field(
        None, gt=0, description="length for seq-mean-token-sum-norm; null: padded length"
    )
    advantages: AdvantageConfig = Field(default_factory=AdvantageConfig)
    reference: Literal["behaviour", "proximal"] = Field(
        "behaviour",
        description="ratios against the generation log-probs, or proximal log-probs recomputed "
        "by the learner at the start of the step (then `off_policy` weights apply)",
    )
    off_policy: OffPolicyCorrection = Field(default_factory=OffPolicyCorrection)

    @property
    def resolved_loss_agg_mode(self) -> LossAggMode:
        return self.loss_agg_mode or self.estimator.default_loss_agg_mode


def describe_validation_error(
    error: ValidationError, source: str = "config", renamed: Mapping[str, str] | None = None
) -> str:
    """One line per problem: `source: key.path: message`, for CLI and API error messages.

    `renamed` maps key paths whose value the user set elsewhere to the name of that setting,
    which the line then names instead (`name: message`).
    """
    renamed = renamed or {}
    lines = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "(root)"
        if path in renamed:
            lines.append(f"{renamed[path]}: {item['msg']}")
        else:
            lines.append(f"{source}: {path}: {item['msg']}")
    return "\n".join(lines)
