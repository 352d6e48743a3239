"""The learner's step logic, without Ray: model, optimiser, and one step per batch of groups.

One step (`LearnerCore.train_step`), as in DESIGN.md's data flow:

1. collate the scored groups into padded tensors (staleness against the current version);
2. group-relative advantages (kpo_core.advantages);
3. the reference log-probs the ratios are taken against: the behaviour log-probs returned by
   generation, or proximal log-probs recomputed under the current weights (then the decoupled-PPO
   behaviour weights pi_prox / pi_behaviour of `algorithm.off_policy` apply, AReaL);
4. `ppo_epochs` passes of `minibatches` optimiser steps each, over a seeded permutation of the
   rows: forward, `compute_policy_loss` (the configured estimator: KPO by default), backward,
   gradient clipping, AdamW step. A minibatch whose loss or gradient norm is not finite is
   skipped (no update) and counted;
5. the learning-rate schedule advances once, the version increments, and one metrics record is
   returned; the caller publishes `state_dict_for_publish()`.

Dropout stays off (the model is kept in eval mode): with it, even on-policy ratios would not be 1.

Bad numbers never stop a run under `learner.nonfinite="mask"` (the default), and never reach the
parameters: NaN/inf rewards drop their response, NaN/inf log-probs (behaviour, proximal or the
learner's own logits) drop their token, extreme ratios saturate, and every case is counted in the
metrics record. The policy, case by case, is docs/numerics.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from kpo_core.advantages import group_advantages
from kpo_core.config import AlgorithmConfig, LearnerConfig
from kpo_core.losses import NonFiniteInputError, compute_policy_loss
from services.learner import checkpoint
from services.learner.batch import TrainingBatch, collate
from services.learner.logprobs import reference_logprobs, response_logprobs
from services.learner.metrics import (
    PER_PASS,
    batch_metrics,
    diagnostic_metrics,
    finite_mask,
    masked_mean,
    ratio_views,
    reduce_minibatches,
)
from services.messages import ScoredGroup


def linear_warmup(warmup_steps: int) -> Callable[[int], float]:
    """LambdaLR factor: (step + 1) / warmup_steps for the first steps, then 1; 0 steps = 1.

    Starting at 1 / warmup_steps rather than 0 makes the first step a real update.
    """

    def factor(step: int) -> float:
        return 1.0 if warmup_steps == 0 else min(1.0, (step + 1) / warmup_steps)

    return factor


@dataclass(frozen=True)
class Minibatch:
    """The rows of one optimiser step and what their loss needs.

    rows [b]: the rows' indices in the step's batch; advantages [b]; ref_logp [b, T] (behaviour
    or proximal); behaviour_logp [b, T] when the reference is proximal (decoupled-PPO weights),
    else None.
    """

    batch: TrainingBatch
    rows: Tensor
    advantages: Tensor
    ref_logp: Tensor
    behaviour_logp: Tensor | None


@dataclass
class RatioLog:
    """Detached raw and estimator ratios [b, T] of every minibatch of a step, with their masks
    (every epoch: the step's diagnostics), and what `save` writes of the first epoch's rows."""

    raw: list[Tensor] = field(default_factory=list)
    filtered: list[Tensor] = field(default_factory=list)
    masks: list[Tensor] = field(default_factory=list)
    first_epoch: list[dict[str, Tensor]] = field(default_factory=list)

    def add(self, raw: Tensor, filtered: Tensor, mask: Tensor, part: Minibatch | None) -> None:
        """Log one minibatch; `part` is given for first-epoch minibatches only."""
        self.raw.append(raw)
        self.filtered.append(filtered)
        self.masks.append(mask)
        if part is not None:
            self.first_epoch.append(
                {
                    "log_ratio": raw.log().cpu(),
                    "mask": mask.cpu(),
                    "row": part.rows.cpu(),
                    "staleness": part.batch.staleness.cpu(),
                    "advantage": part.advantages.detach().float().cpu(),
                }
            )

    def save(self, path: Path, version: int) -> None:
        """Write the first epoch's log-ratios for offline analysis (format: `ratio_file`)."""
        record = {key: torch.cat([m[key] for m in self.first_epoch]) for key in RATIO_FILE_ROWS}
        sizes = torch.tensor([len(m["row"]) for m in self.first_epoch])
        record["minibatch"] = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
        record["version"] = torch.tensor(version)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save(record, partial)
        partial.replace(path)

    def metrics(self) -> dict[str, float]:
        """ratio_diagnostics of all rows at once, prefixed `raw_` and `filtered_`."""
        mask = torch.cat(self.masks)
        return {
            **diagnostic_metrics("raw_", torch.cat(self.raw), mask),
            **diagnostic_metrics("filtered_", torch.cat(self.filtered), mask),
        }


RATIO_FILE_ROWS = ("log_ratio", "mask", "row", "staleness", "advantage")


def ratio_file(ratio_dir: Path, version: int) -> Path:
    """Where the log-ratios of the step that started from version `version` are saved.

    The file (named after the step, version + 1) is a torch dict of the first epoch's rows in
    minibatch order: log_ratio [N, T] float32 (log of the raw ratio, z clamped to +-20, 0 off
    the mask), mask [N, T] bool, row [N] (the row's index in the step's batch), staleness [N],
    advantage [N], minibatch [N]; and version (the weights the step started from).
    """
    return ratio_dir / f"step-{version + 1:06d}.pt"


class LearnerCore:
    """Model, AdamW optimiser, warm-up schedule and version of one learner (see module doc)."""

    def __init__(
        self,
        model_path: str | Path,
        learner: LearnerConfig,
        algorithm: AlgorithmConfig,
        temperature: float,
        seed: int = 0,
        num_threads: int | None = None,
        ratio_dir: str | Path | None = None,
    ) -> None:
        """Load the model and tokenizer from `model_path`; version 0 is those weights.

        `temperature` is the generation temperature (the learner divides logits by it);
        `seed` seeds the minibatch permutations; `num_threads`, when given, is passed to
        torch.set_num_threads (a process-wide setting); `ratio_dir` receives the log-ratio
        files of `learner.record_ratios_every` (`ratio_file`).
        """
        if not temperature > 0:
            raise ValueError(
                f"temperature must be > 0 (the generation temperature), got {temperature}"
            )
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.learner, self.algorithm, self.temperature = learner, algorithm, temperature
        self.model_path = str(model_path)
        self.ratio_dir = None if ratio_dir is None else Path(ratio_dir)
        self.device = torch.device(learner.device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        pad_id = self.tokenizer.pad_token_id
        self.pad_id = int(pad_id if pad_id is not None else (self.tokenizer.eos_token_id or 0))
        model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=getattr(torch, learner.dtype)
        )
        # transformers declares `to` through functools.wraps(nn.Module.to), which mypy reads as
        # the unbound function.
        self.model: PreTrainedModel = model.to(self.device).eval()  # type: ignore[arg-type]
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=learner.lr,
            betas=learner.betas,
            weight_decay=learner.weight_decay,
        )
        self.scheduler = LambdaLR(self.optimizer, linear_warmup(learner.warmup_steps))
        self.generator = torch.Generator().manual_seed(seed)
        self._version = 0
        self._steps = 0

    @property
    def version(self) -> int:
        """Policy version of the current weights: the number of completed steps."""
        return self._version

    def train_step(self, groups: Sequence[ScoredGroup]) -> dict[str, float]:
        """One learner step on `groups` (module docstring); returns its metrics record.

        Batch statistics (reward_*, accuracy, response_length_mean, truncated_fraction,
        zero_variance_group_fraction, nonfinite_rewards, empty_responses, staleness_*,
        tokens_trained) are over the batch, once. Loss metrics are per minibatch, then reduced
        (`reduce_minibatches`): `*_max` max, `*_min` min, skipped_minibatches and
        empty_minibatches summed, nonfinite_tokens and extreme_ratio_tokens summed and divided
        by the epochs, the rest averaged over minibatches where finite (so grad_norm is absent
        when no minibatch was trained). entropy is from the first epoch (each row once).
        raw_* / filtered_* are `ratio_diagnostics` of the raw ratios exp(z) and of the
        estimator's ratios over all minibatches of the step. lr is the rate this step used;
        policy_version the version after it.

        A response whose reward is NaN/inf is left out of its group's advantages and of the
        loss (its tokens are masked). With `nonfinite="raise"` a NaN/inf reward raises
        NonFiniteInputError before any update, and a NaN/inf log-prob raises it in the
        minibatch that meets it: minibatches already applied in this step keep their updates,
        and the version does not advance.
        """
        batch = collate(groups, self.pad_id, self._version).to(self.device)
        finite_rewards = torch.isfinite(batch.rewards)
        if self.learner.nonfinite == "raise" and not bool(finite_rewards.all()):
            count = int((~finite_rewards).sum())
            raise NonFiniteInputError(
                f"{count} of {batch.num_rows} rewards are NaN/inf; learner.nonfinite='mask' "
                "drops those responses instead"
            )
        advantages = self._advantages(batch)
        metrics = batch_metrics(batch)
        # Responses without a finite reward are not trained on: no token of theirs is valid.
        batch = replace(batch, response_mask=batch.response_mask & finite_rewards.unsqueeze(-1))
        ref_logp, behaviour_logp = self._references(batch)
        lr = float(self.scheduler.get_last_lr()[0])
        records: list[dict[str, float]] = []
        ratios = RatioLog()
        for epoch in range(self.learner.ppo_epochs):
            for rows in self._minibatch_rows(batch.num_rows):
                behaviour = None if behaviour_logp is None else behaviour_logp[rows]
                part = Minibatch(
                    batch.select(rows), rows, advantages[rows], ref_logp[rows], behaviour
                )
                records.append(self._train_minibatch(part, epoch == 0, ratios))
        self.scheduler.step()
        self._version += 1
        self._steps += 1
        every = self.learner.record_ratios_every
        if every and self.ratio_dir is not None and self._version % every == 0:
            ratios.save(ratio_file(self.ratio_dir, self._version - 1), self._version - 1)
        metrics.update(reduce_minibatches(records))
        metrics.update(ratios.metrics())
        for key in PER_PASS:
            # A count per pass over the batch, like tokens_trained (not multiplied by the epochs).
            metrics[key] /= self.learner.ppo_epochs
        metrics.update(lr=lr, policy_version=float(self._version))
        return metrics

    def _advantages(self, batch: TrainingBatch) -> Tensor:
        """Group-relative advantages [B] of the batch's rewards (NaN/inf ones dropped: A = 0)."""
        cfg = self.algorithm.advantages
        return group_advantages(
            batch.rewards, batch.group_ids, cfg.mode, cfg.eps, cfg.std_unbiased, nonfinite="drop"
        ).float()

    def _references(self, batch: TrainingBatch) -> tuple[Tensor, Tensor | None]:
        """(ref_logp [B, T], behaviour_logp [B, T] or None) for `algorithm.reference`."""
        if self.algorithm.reference == "behaviour":
            return batch.behaviour_logp, None
        chunks = self.learner.minibatches
        proximal = reference_logprobs(self.model, batch, self.temperature, chunks)
        return proximal, batch.behaviour_logp

    def _minibatch_rows(self, num_rows: int) -> list[Tensor]:
        """Row indices of each minibatch: `minibatches` slices of a fresh seeded permutation."""
        order = torch.randperm(num_rows, generator=self.generator)
        slices = torch.tensor_split(order, self.learner.minibatches)
        return [rows.to(self.device) for rows in slices if rows.numel()]

    def _train_minibatch(
        self, part: Minibatch, with_entropy: bool, ratios: RatioLog
    ) -> dict[str, float]:
        """Forward, loss, backward and (if everything is finite) one optimiser step.

        No backward and no step when no valid token is left: counted as skipped_minibatches if
        the minibatch had tokens (all NaN/inf), else as empty_minibatches (nothing to train).
        """
        self.optimizer.zero_grad(set_to_none=True)
        logp, entropy = response_logprobs(self.model, part.batch, self.temperature, with_entropy)
        mask = part.batch.response_mask
        algorithm = self.algorithm
        loss, metrics = compute_policy_loss(
            algorithm.estimator,
            logp,
            part.ref_logp,
            part.advantages,
            mask,
            behaviour_logp=part.behaviour_logp,
            correction=algorithm.off_policy,
            loss_agg_mode=algorithm.resolved_loss_agg_mode,
            norm_length=algorithm.norm_length,
            nonfinite=self.learner.nonfinite,
        )
        extra = () if part.behaviour_logp is None else (part.behaviour_logp,)
        advantages = part.advantages.unsqueeze(-1).expand(mask.shape)
        valid = finite_mask(mask, logp.detach(), part.ref_logp, advantages, *extra)
        views = ratio_views(algorithm.estimator, logp, part.ref_logp, part.advantages, valid)
        ratios.add(*views, valid, part if with_entropy else None)
        loss_value = float(loss.detach())
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy, valid)
        if not bool(valid.any()):
            # Nothing to learn from; a backward pass could only bring 0 * NaN into the gradient.
            had_tokens = bool(mask.any())
            metrics.update(
                policy_loss=loss_value,
                skipped_minibatches=float(had_tokens),
                empty_minibatches=float(not had_tokens),
            )
            return metrics
        torch.autograd.backward(loss)
        grad_norm = self._clip_gradients()
        applied = math.isfinite(loss_value) and math.isfinite(grad_norm)
        if applied:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        metrics.update(
            policy_loss=loss_value,
            grad_norm=grad_norm,
            skipped_minibatches=float(not applied),
            empty_minibatches=0.0,
        )
        return metrics

    def _clip_gradients(self) -> float:
        """Total gradient 2-norm before clipping; clipped to `max_grad_norm` unless it is None."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        if self.learner.max_grad_norm is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, self.learner.max_grad_norm)
        return float(norm)

    def state_dict_for_publish(self) -> dict[str, Tensor]:
        """Detached CPU copies of the model's state dict, for generation workers' `load_weights`.

        Tied tensors (e.g. input embedding and lm_head) are copied once and shared.
        """
        copies: dict[tuple[int, tuple[int, ...]], Tensor] = {}
        out: dict[str, Tensor] = {}
        for key, tensor in self.model.state_dict().items():
            ident = (tensor.data_ptr(), tuple(tensor.shape))
            if ident not in copies:
                copies[ident] = tensor.detach().to("cpu", copy=True)
            out[key] = copies[ident]
        return out

    def _training_state(self) -> checkpoint.TrainingState:
        return checkpoint.TrainingState(self.optimizer, self.scheduler, self.generator)

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write a loadable model directory plus training state into `path` (see checkpoint)."""
        return checkpoint.save_checkpoint(
            path, self.model, self.tokenizer, self._training_state(), self._version, self._steps
        )

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore weights (in place), optimiser, schedule, RNGs and version; return the version."""
        state = checkpoint.load_checkpoint(path, self.model, self._training_state())
        self._version, self._steps = state["version"], state["steps"]
        return self._version
