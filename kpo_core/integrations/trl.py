"""kpo_core's estimators inside TRL's GRPO trainer (TRL >= 1.16; see docs/integrations.md).

`KpoGRPOTrainer` is TRL's `GRPOTrainer` with the importance ratio and its clipped surrogate
taken from a kpo_core estimator (`KpoGRPOConfig.ratio_estimator`): KPO's Kalman-filtered ratios
by default, or CTPO (`cumulative`), GSPO (`sequence`), GMPO (`geometric`) or the plain token
ratio (`token`, which reproduces TRL's own loss). Everything else is TRL's: generation, rewards,
advantages, the masks (completion and tool masks, `top_entropy_quantile`,
`off_policy_mask_threshold`), the vLLM importance-sampling correction, the `beta` KL term, and
the aggregation of `loss_type` grpo, bnpo, dr_grpo or dapo with gradient accumulation.

The clip window is TRL's `epsilon`/`epsilon_high`. Left unset, it is the estimator's own default
(KPO and GSPO 3e-4/4e-4, CTPO 0.025/0.05 in log space, GMPO 0.4, token 0.2), since TRL's 0.2
would disable the tight windows the sequence-level and filtered ratios are tuned for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, cast, get_args

import torch
from torch import Tensor
from trl.trainer.grpo_config import GRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer

from kpo_core.config import EstimatorConfig
from kpo_core.integrations.options import check_truncated_sampling, framework_estimator_config
from kpo_core.losses import NonFinitePolicy, token_policy_loss
from kpo_core.ratios import get_estimator

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
# Inputs TRL's log-prob pass takes besides the token ids (vision models, token types).
_MODEL_INPUT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


@dataclass
class KpoGRPOConfig(GRPOConfig):  # type: ignore[misc]
    """TRL's `GRPOConfig` plus the kpo_core estimator that computes the ratio.

    `epsilon` and `epsilon_high` default to the estimator's clip window (see the module
    docstring); set them to override it. Settings whose loss kpo_core does not compute are
    refused with a ValueError naming the setting: `loss_type` other than grpo, bnpo, dr_grpo
    and dapo; `importance_sampling_level` (the estimator decides: `sequence` is GSPO);
    `delta`; the entropy bonus (`entropy_coef`, `use_adaptive_entropy`).
    """

    ratio_estimator: str = field(
        default="kalman",
        metadata={
            "help": "kpo_core estimator: kalman (KPO), cumulative (CTPO), token, "
            "sequence (GSPO) or geometric (GMPO)."
        },
    )
    estimator_options: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Options of the estimator besides its clip window, e.g. "
            '{"q": 1e-5, "r": 1.0} for kalman. A JSON object on the command line.'
        },
    )
    nonfinite: str = field(
        default="raise",
        metadata={
            "help": "NaN/inf in a completion token's log-probs or advantage: 'raise' "
            "stops, 'mask' drops the token and counts it in kpo/nonfinite_tokens."
        },
    )
    truncated_sampling: str | None = field(
        default=None,
        metadata={
            "help": "Truncated training sampling (top_p < 1, top_k > 0, min_p > 0): 'allow' "
            "(or unset) trains on it as TRL does, 'refuse' refuses it. 'replay' is refused: "
            "TRL's generation does not record each token's kept set."
        },
    )
    epsilon: float | None = field(  # type: ignore[assignment]
        default=None,
        metadata={"help": "Lower clip (1 - epsilon). Unset: the estimator's own default."},
    )

    def __post_init__(self) -> None:
        self.estimator_options = _parse_options(self.estimator_options)
        self._refuse_unsupported()
        defaults = estimator_defaults(self.ratio_estimator)
        if self.epsilon is None:
            self.epsilon = defaults.clip_low
            if self.epsilon_high is None:  # type: ignore[has-type]
                self.epsilon_high = defaults.clip_high
        super().__post_init__()  # type: ignore[no-untyped-call]
        self.estimator_config()  # fail at configuration time, not at the first step

    def _refuse_unsupported(self) -> None:
        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            raise ValueError(
                f"loss_type={self.loss_type!r}: KpoGRPOConfig supports {SUPPORTED_LOSS_TYPES}, "
                "the loss types built on the clipped ratio surrogate"
            )
        if self.importance_sampling_level != "token":
            raise ValueError(
                f"importance_sampling_level={self.importance_sampling_level!r}: the ratio comes "
                "from ratio_estimator; use ratio_estimator='sequence' for GSPO's sequence ratio"
            )
        if self.delta is not None:
            raise ValueError("delta: two-sided clipping is not part of kpo_core's estimators")
        if self.nonfinite not in get_args(NonFinitePolicy):
            raise ValueError(
                f"nonfinite={self.nonfinite!r}: must be one of {get_args(NonFinitePolicy)}"
            )
        check_truncated_sampling(
            self.truncated_sampling, self._truncating_settings(), "truncated_sampling"
        )
        if self.entropy_coef != 0.0 or self.use_adaptive_entropy:
            raise ValueError(
                "entropy_coef/use_adaptive_entropy: KpoGRPOTrainer has no entropy bonus; "
                "leave entropy_coef=0 and use_adaptive_entropy=False"
            )

    def _truncating_settings(self) -> dict[str, Any]:
        """The sampling settings that truncate TRL's training generation, by name: its own
        fields, or the same keys in `generation_kwargs`, which override them."""
        overrides = _parse_options(self.generation_kwargs, "generation_kwargs")
        values = {
            name: overrides.get(name, getattr(self, name)) for name in ("top_p", "top_k", "min_p")
        }
        truncates = {
            "top_p": values["top_p"] is not None and values["top_p"] < 1.0,
            "top_k": values["top_k"] is not None and values["top_k"] > 0,
            "min_p": values["min_p"] is not None and values["min_p"] > 0.0,
        }
        return {name: values[name] for name, cut in truncates.items() if cut}

    def estimator_config(self) -> EstimatorConfig:
        """The kpo_core config: estimator_options, with the clip window from epsilon(_high) and
        KPO's `reference_length: auto` resolved to max_completion_length."""
        options = _parse_options(self.estimator_options)
        if self.ratio_estimator == "token":
            # TRL's PPO clip has no dual clip; it stays off unless asked for.
            options.setdefault("dual_clip_c", None)
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        from_trl = {"clip_low": ("epsilon", self.epsilon), "clip_high": ("epsilon_high", high)}
        # TRL's response limit: KPO's `reference_length: auto` matches its constants to it.
        length = ("max_completion_length", self.max_completion_length)
        return framework_estimator_config(
            self.ratio_estimator, options, from_trl, "estimator_options", length
        )


def _parse_options(
    options: dict[str, Any] | str | None, setting: str = "estimator_options"
) -> dict[str, Any]:
    """`setting`'s options as a dict; the command line passes a JSON object as a string."""
    if not isinstance(options, str):
        return dict(options or {})
    try:
        parsed = json.loads(options)
    except json.JSONDecodeError as error:
        raise ValueError(f"{setting}: not a JSON object: {error}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{setting}: not a JSON object: {options!r}")
    return parsed


def estimator_defaults(name: str) -> EstimatorConfig:
    """The estimator's config with every option at its default; ValueError naming the choices."""
    try:
        registered = get_estimator(name)
    except ValueError as error:
        raise ValueError(f"ratio_estimator: {error}") from None
    return registered.make_config()


class KpoGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
    """TRL's GRPOTrainer with the ratio and clipped surrogate of a kpo_core estimator.

    Logs TRL's entropy, kl and clip_ratio/* metrics (clip_ratio counts the tokens whose clipped
    term won, per kpo_core's definition) and kpo_core's ratio diagnostics under kpo/.
    """

    args: KpoGRPOConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, KpoGRPOConfig):
            raise TypeError(
                f"KpoGRPOTrainer needs args=KpoGRPOConfig(...), got {type(self.args).__name__}"
            )
        if self.aux_loss_enabled:
            raise ValueError(
                "router_aux_loss_coef: KpoGRPOTrainer does not add the MoE router loss; set "
                "router_aux_loss_coef=0"
            )
        self.kpo_estimator = self.args.estimator_config()

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        completion_ids = inputs["completion_ids"]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        per_token_logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            completion_ids.size(1),
            compute_entropy=True,
            **{key: inputs[key] for key in _MODEL_INPUT_KEYS if key in inputs},
        )
        advantages = inputs["advantages"]
        if advantages.dim() == 1:  # one per completion; TRL's subclasses may give [B, T]
            advantages = advantages.unsqueeze(1).expand_as(per_token_logps)
        # TRL skips old_per_token_logps when the batch is on-policy (one iteration).
        old_per_token_logps = inputs.get("old_per_token_logps")
        if old_per_token_logps is None:
            old_per_token_logps = per_token_logps.detach()

        token_loss = token_policy_loss(
            self.kpo_estimator,
            per_token_logps,
            old_per_token_logps,
            advantages,
            mask,
            nonfinite=cast(NonFinitePolicy, self.args.nonfinite),
        )
        per_token = token_loss.per_token * self._trl_token_weights(
            inputs, advantages, per_token_logps, old_per_token_logps, entropies, mask
        )
        per_token_kl = None
        if self.beta != 0.0:
            per_token_kl = self._kl(inputs, per_token_logps, old_per_token_logps)
            per_token = per_token + self.beta * per_token_kl
        loss_mask = token_loss.mask
        loss = self._aggregate(torch.where(loss_mask, per_token, 0.0), loss_mask, inputs)
        self._log_metrics(
            entropies, per_token_kl, token_loss.clipped, advantages, loss_mask, token_loss.metrics
        )
        return loss

    def _trl_token_weights(
        self,
        inputs: dict[str, Any],
        advantages: Tensor,
        per_token_logps: Tensor,
        old_per_token_logps: Tensor,
        entropies: Tensor,
        mask: Tensor,
    ) -> Tensor:
        """TRL's multiplicative masks and corrections of the per-token loss, in TRL's order."""
        weights = torch.ones_like(per_token_logps)
        if self.off_policy_mask_threshold is not None:
            weights = weights * self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=inputs.get(
                    "sampling_per_token_logps", old_per_token_logps
                ),
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
        if self.top_entropy_quantile < 1.0:
            weights = weights * self.get_high_entropy_mask(
                entropies, mask, 1 - self.top_entropy_quantile
            )
        if self.use_vllm and self.vllm_importance_sampling_correction:
            weights = weights * inputs["importance_sampling_ratio"]
        return weights

    def _kl(
        self, inputs: dict[str, Any], per_token_logps: Tensor, old_per_token_logps: Tensor
    ) -> Tensor:
        """TRL's k3 estimate of KL(pi || pi_ref), with its optional importance correction."""
        log_ref_ratio = inputs["ref_per_token_logps"] - per_token_logps
        per_token_kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        if self.args.use_bias_correction_kl:
            per_token_kl = per_token_kl * torch.exp(per_token_logps - old_per_token_logps)
        kl: Tensor = per_token_kl
        return kl

    def _aggregate(self, per_token: Tensor, mask: Tensor, inputs: dict[str, Any]) -> Tensor:
        """TRL's aggregation of `loss_type`, scaled for gradient accumulation as TRL does."""
        training = self._training()
        accumulation = self.current_gradient_accumulation_steps if training else 1
        mask = mask.to(per_token.dtype)
        loss: Tensor
        if self.loss_type == "grpo":
            loss = (per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
        elif self.loss_type == "bnpo":
            loss = per_token.sum() / mask.sum().clamp(min=1.0) / accumulation
        elif self.loss_type == "dr_grpo":
            length = self.max_completion_length
            if length is None:
                raise ValueError("max_completion_length: loss_type='dr_grpo' normalises by it")
            normalizer = per_token.size(0) * length
            loss = per_token.sum() / normalizer / accumulation
        else:
            # dapo: num_items_in_batch spans the generation batch; rescale it to one window.
            items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if training:
                steps = self.args.steps_per_generation or self.args.gradient_accumulation_steps
                items = items * accumulation / steps
            loss = per_token.sum() / items
        return loss

    def _training(self) -> bool:
        return self.model is not None and self.model.training

    def _log_metrics(
        self,
        entropies: Tensor,
        per_token_kl: Tensor | None,
        clipped: Tensor,
        advantages: Tensor,
        mask: Tensor,
        kpo_metrics: dict[str, float],
    ) -> None:
        mode = "train" if self._training() else "eval"
        means = {
            "entropy": entropies,
            "clip_ratio/low_mean": clipped & (advantages < 0),
            "clip_ratio/high_mean": clipped & (advantages > 0),
            "clip_ratio/region_mean": clipped,
        }
        if per_token_kl is not None:
            means["kl"] = per_token_kl
        with torch.no_grad():
            weight = mask.to(entropies.dtype)
            local = torch.stack(
                [(values.to(weight.dtype) * weight).sum() for values in means.values()]
                + [weight.sum()]
            )
            totals = self.accelerator.reduce(local, reduction="sum")
            for key, total in zip(means, totals[:-1], strict=True):
                self._metrics[mode][key].append((total / totals[-1].clamp(min=1.0)).item())
            # kpo_core's diagnostics are per-process figures; log their mean over processes.
            values = torch.tensor(list(kpo_metrics.values()), device=entropies.device)
            gathered = self.accelerator.gather(values).view(-1, len(kpo_metrics)).nanmean(0)
            for key, value in zip(kpo_metrics, gathered.tolist(), strict=True):
                self._metrics[mode][f"kpo/{key}"].append(value)
