"""Pydantic models of the algorithm part of a run, shared by YAML run files and the REST API.

Every model is strict (`extra="forbid"`): a typo in a key is an error naming the key, and a bad
value is an error naming the field and the valid values. Estimators are a discriminated union on
`name`, so adding one means one config class here and one function in `kpo_core.ratios`.
Defaults are the papers' (see SPEC.md): KPO from arXiv 2602.10609's official code, CTPO from
arXiv 2605.07331, GSPO 2507.18671, GMPO 2507.20673.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
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


def read_as_off(value: object) -> object:
    """YAML 1.1 (PyYAML, and so run files and `--set`) reads an unquoted `off` as false: a
    setting whose values include 'off' takes false as 'off', as the user meant it."""
    return "off" if value is False else value


VersionSwitch = Annotated[Literal["off", "reset", "inflate"], BeforeValidator(read_as_off)]


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


# The response length the paper's constants (Q/R = 1e-6, clip 3e-4/4e-4) were set for.
PAPER_RESPONSE_LENGTH = 4096
# P0 -> infinity in practice: far above any R, so the first gain rounds to 1 (float64: 1 - 1e-6).
DIFFUSE_P0_PER_R = 1e6


class KalmanEstimator(_ClippedEstimator):
    """KPO: token log-ratios smoothed by a causal Kalman filter, as straight-through weights.

    The filter depends on a token's position t only through t sqrt(q/r) (SPEC.md), so constants
    set for responses of `constants_length` tokens act the same on responses of L tokens with
    q_L = q (constants_length / L)^2 and a clip window widened by the noise factor
    sqrt(constants_length / L): `reference_length: L` (or `auto`, the run's max_new_tokens).
    """

    name: Literal["kalman"] = "kalman"
    q: float = Field(1e-6, ge=0.0, description="process noise variance Q")
    r: float = Field(1.0, gt=0.0, description="measurement noise variance R")
    p0: float | Literal["diffuse"] = Field(
        0.0,
        description="initial state variance (>= 0), or `diffuse` (P0 = 1e6 R: gains about 1/t "
        "at first, so the filtered value is the running mean of the log-ratios)",
    )
    x0: float = Field(0.0, description="initial state mean (log-ratio)")
    gradient: GradientMode = "straight_through"
    clipped: bool = True
    clip_low: float = Field(3e-4, ge=0.0, lt=1.0)
    clip_high: float = Field(4e-4, ge=0.0)
    max_log_ratio: float = Field(10.0, gt=0.0, description="cap on log rho before exp")
    # `auto` by default: with the paper's constants as given, responses much shorter than 4,096
    # tokens are barely filtered and the clip window never binds (docs/results.md).
    reference_length: int | Literal["auto"] | None = Field(
        "auto",
        description="response length L to match q and the clip window to (q_L = q (C/L)^2, "
        "clip x sqrt(C/L), C = constants_length); `auto`: the run's generation.max_new_tokens, "
        "resolved by the learner (a loop of its own that does not resolve it gets q and clip as "
        "given: no length is known there); null: q and clip as given (the paper's)",
    )
    constants_length: int = Field(
        PAPER_RESPONSE_LENGTH,
        gt=0,
        description="response length q and the clip window are set for (the paper's 4,096)",
    )
    clip_mode: Literal["ratio", "posterior"] = Field(
        "ratio",
        description="ratio: the filtered ratio within [1 - clip_low, 1 + clip_high]; posterior: "
        "log rho_t within [-k_low sqrt(K_t), k_high sqrt(K_t)] with k = clip / (q/r)^(1/4), a "
        "window in posterior standard deviations that equals the ratio window once the gain is "
        "steady (for `p0: diffuse`)",
    )
    token_clip: tuple[float, float] | None = Field(
        None,
        description="[low, high]: a token whose raw ratio leaves [1 - low, 1 + high] in the "
        "direction of its advantage also gets no gradient (PPO's token trust region as a backstop)",
    )
    version_switch: VersionSwitch = Field(
        "off",
        description="at a model token sampled by another policy version than the previous model "
        "token of its response (in-flight weight updates): off: nothing; reset: the covariance "
        "restarts at the prior (needs p0 at least the steady-state covariance, e.g. `diffuse`); "
        "inflate: switch_q is added to the process noise at that token. x carries over in both",
    )
    switch_q: float = Field(
        1.0,
        ge=0.0,
        description="process noise added at a version switch with `version_switch: inflate` "
        "(in r's units: 1.0 = r takes the next gain to about 1/2)",
    )
    default_loss_agg_mode: ClassVar[LossAggMode] = "seq-mean-token-mean"

    @model_validator(mode="after")
    def _options_consistent(self) -> KalmanEstimator:
        if isinstance(self.p0, float) and not (math.isfinite(self.p0) and self.p0 >= 0.0):
            raise ValueError(f"p0 must be >= 0 or 'diffuse', got {self.p0}")
        if self.clip_mode == "posterior" and not self.clipped:
            raise ValueError("clip_mode 'posterior' is a clip window: it needs clipped: true")
        if self.clip_mode == "posterior" and self.q == 0.0:
            raise ValueError("clip_mode 'posterior' needs q > 0 (its window is in sqrt(q/r))")
        if isinstance(self.reference_length, int) and self.reference_length < 1:
            raise ValueError(f"reference_length must be >= 1, got {self.reference_length}")
        if self.token_clip is not None:
            low, high = self.token_clip
            if not (0.0 <= low < 1.0 and high >= 0.0):
                raise ValueError(
                    f"token_clip [low, high] needs 0 <= low < 1 and high >= 0, got [{low}, {high}]"
                )
        if self.version_switch == "reset":
            # Only here does the config need the filter's steady state (and torch with it).
            from kpo_core.kalman import check_reset_prior

            check_reset_prior(self.effective_q, self.r, self.effective_p0)
        return self

    def with_response_length(self, max_new_tokens: int) -> KalmanEstimator:
        """This config with `reference_length: auto` resolved to the run's response limit
        (validated again: q, and so the checks that read it, follow the length)."""
        if self.reference_length != "auto":
            return self
        return type(self).model_validate({**self.model_dump(), "reference_length": max_new_tokens})

    @property
    def length_factor(self) -> float:
        """C / L: how much shorter the reference length is than the constants' (1 if none, or
        `auto` left unresolved: the padded width is no fixed length, and would make the loss
        depend on padding)."""
        if self.reference_length is None or self.reference_length == "auto":
            return 1.0
        return self.constants_length / self.reference_length

    @property
    def effective_q(self) -> float:
        """q_L = q (C / L)^2: the same t sqrt(q/r) at the reference length as at C tokens."""
        return self.q * self.length_factor**2

    @property
    def effective_clip(self) -> tuple[float, float]:
        """(low, high) widened by the noise factor sqrt(C / L); low stays below 1."""
        factor = self.length_factor**0.5
        return min(self.clip_low * factor, 1.0 - 1e-6), self.clip_high * factor

    @property
    def effective_p0(self) -> float:
        return DIFFUSE_P0_PER_R * self.r if self.p0 == "diffuse" else float(self.p0)


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
# The names `estimator.name` takes: those of the union's configs.
EstimatorName = Literal["token", "sequence", "geometric", "kalman", "cumulative"]
ESTIMATOR_NAMES: tuple[str, ...] = get_args(EstimatorName)
# The most shadow estimators a run may list (`AlgorithmConfig.shadow`).
MAX_SHADOW_ESTIMATORS = 5
_ESTIMATOR_CONFIG: TypeAdapter[EstimatorConfig] = TypeAdapter(EstimatorConfig)


def default_estimator(name: str) -> EstimatorConfig:
    """The config of the estimator called `name` with every default (the papers')."""
    return _ESTIMATOR_CONFIG.validate_python({"name": name})


# What a run does with truncated training sampling (`OffPolicyCorrection.truncated_sampling`).
TruncatedSampling = Literal["refuse", "allow", "replay"]


class OffPolicyCorrection(StrictModel):
    """Decoupled PPO (AReaL): weight each token's loss by the detached w = pi_ref / pi_behaviour.

    `tis_cap` truncates w at C (TIS); `mis_low`/`mis_high` zero the weight outside [lo, hi]
    (IcePop/MIS). `level="sequence"` uses the product of a response's token weights, which
    collapses (or explodes) on long responses; `level="sequence-mean"` their geometric mean.
    """

    level: Literal["token", "sequence", "sequence-mean"] = "token"
    truncated_sampling: TruncatedSampling | None = Field(
        None,
        description="training rollouts sampled with top-p < 1, top-k > 0 or min-p > 0: replay "
        "(the sampler records each token's kept set and the learner takes its log-probs over "
        "it, so the ratios are unbiased), refuse (a learner over the full softmax would bias "
        "every ratio) or allow (the full softmax anyway: a declared choice, recorded with the "
        "run); null: replay where training sampling truncates (the run spec resolves it)",
    )
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
    shadow: tuple[EstimatorName, ...] = Field(
        (),
        max_length=MAX_SHADOW_ESTIMATORS,
        description="estimators computed beside the training one on every micro-batch, for the "
        "metrics only (`shadow_<name>_*` keys): the loss, clip fraction, ratio statistics and "
        "ratio diagnostics each would report on the same batch with its defaults, aggregated "
        "as a run training with it would be; no gradient, no second forward. Not the training "
        "estimator, each once, at most 5",
    )
    # `shadow`'s configs once `with_response_length` resolved them (None: not yet).
    _shadow_estimators: tuple[EstimatorConfig, ...] | None = PrivateAttr(None)

    @field_validator("shadow")
    @classmethod
    def _shadow_others_once(
        cls, shadow: tuple[EstimatorName, ...], info: ValidationInfo
    ) -> tuple[EstimatorName, ...]:
        repeated = sorted({name for name in shadow if shadow.count(name) > 1})
        if repeated:
            raise ValueError(
                f"lists {', '.join(map(repr, repeated))} more than once: each shadow estimator is "
                "computed once"
            )
        # Absent when the estimator itself failed validation (its own error says why).
        estimator = info.data.get("estimator")
        if estimator is not None and estimator.name in shadow:
            raise ValueError(
                f"lists the training estimator {estimator.name!r} (algorithm.estimator.name): "
                "its metrics are the record's own keys; list only other estimators"
            )
        return shadow

    @property
    def resolved_loss_agg_mode(self) -> LossAggMode:
        return self.loss_agg_mode or self.estimator.default_loss_agg_mode

    @property
    def shadow_estimators(self) -> tuple[EstimatorConfig, ...]:
        """The configs of `shadow`: each estimator's defaults, with KPO's `reference_length:
        auto` resolved as for the training estimator once `with_response_length` ran (left
        `auto` before: q and clip as given)."""
        if self._shadow_estimators is not None:
            return self._shadow_estimators
        return tuple(default_estimator(name) for name in self.shadow)

    def shadow_loss_agg_mode(self, shadow: EstimatorConfig) -> LossAggMode:
        """The aggregation of a shadow estimator's loss: the one a run of this config with
        `shadow` as its estimator would train with (`loss_agg_mode`, else its default)."""
        return self.loss_agg_mode or shadow.default_loss_agg_mode

    def with_response_length(self, max_new_tokens: int | None) -> AlgorithmConfig:
        """This config with settings that follow the response length (KPO's
        `reference_length: auto`, of the estimator and of a `kalman` shadow) resolved to a
        run's `generation.max_new_tokens` (`resolve_reference_length`)."""
        setting = "generation.max_new_tokens"
        estimator = resolve_reference_length(self.estimator, max_new_tokens, setting)
        shadows = self.shadow_estimators
        resolved = tuple(resolve_reference_length(s, max_new_tokens, setting) for s in shadows)
        unchanged = all(a is b for a, b in zip(resolved, shadows, strict=True))
        if estimator is self.estimator and unchanged:
            return self
        config = self.model_copy(update={"estimator": estimator})
        config._shadow_estimators = resolved
        return config


def resolve_reference_length(
    estimator: EstimatorConfig, max_response_tokens: int | None, setting: str
) -> EstimatorConfig:
    """The estimator with KPO's `reference_length: auto` resolved to the run's response limit:
    the one resolver of it, for the pipeline, `LearnerCore` and the framework integrations.

    `setting` names where the limit comes from (`generation.max_new_tokens`, verl's
    `response_length`, TRL's `max_completion_length`), for the error when it is not known: an
    unresolved `auto` would fall back to the paper's 4,096-token constants, which barely filter
    short responses, so it is refused rather than guessed (never from a batch's padded width,
    which would make the loss depend on padding).
    """
    if not isinstance(estimator, KalmanEstimator) or estimator.reference_length != "auto":
        return estimator
    if max_response_tokens is None:
        raise ValueError(
            f"reference_length: auto matches KPO's constants to the response limit, but "
            f"{setting} is not set: set it, or give reference_length a length (or null for "
            "the paper's 4,096-token constants)"
        )
    return estimator.with_response_length(max_response_tokens)


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
