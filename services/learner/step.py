"""The learner's step logic, without Ray: model, optimiser, and one step per batch of groups.

One step (`LearnerCore.train_step`), as in DESIGN.md's data flow:

1. collate the scored groups into padded tensors (staleness against the current version);
2. group-relative advantages (kpo_core.advantages);
3. the reference log-probs the ratios are taken against: the behaviour log-probs returned by
   generation, or proximal log-probs recomputed under the current weights (then the decoupled-PPO
   behaviour weights pi_prox / pi_behaviour of `algorithm.off_policy` apply, AReaL);
4. `ppo_epochs` passes of `minibatches` optimiser steps each, over a seeded permutation of the
   rows. Each minibatch is dealt to the ranks and packed into micro-batches under
   `learner.micro_batch_tokens` (`micro_batches.plan_minibatch`); per micro-batch: forward
   (chunked log-probs), `token_policy_loss` (the configured estimator: KPO by default),
   aggregation normalised by the whole minibatch's counts, backward. Then gradient clipping
   and one AdamW step. A minibatch whose loss or gradient norm is not finite is skipped (no
   update) and counted;
5. the learning-rate schedule advances once, the version increments, and one metrics record is
   returned (by rank 0); the caller publishes `weight_buckets(weights_manifest(...))`.

With `algorithm.shadow`, each micro-batch also computes the listed estimators' losses from the
same log-probs (detached, under no_grad: no gradient, no second forward), and the record gets
what each would have reported (`shadow_<name>_*`, `_shadow_losses`).

Every rank of a learner group runs this same code on the same batch (the plan tells each its
rows); a `single` learner is a group of one. Dropout stays off (the model is kept in eval
mode): with it, even on-policy ratios would not be 1.

Bad numbers never stop a run under `learner.nonfinite="mask"` (the default), and never reach the
parameters: NaN/inf rewards drop their response, NaN/inf log-probs (behaviour, proximal or the
learner's own logits) drop their token, extreme ratios saturate, and every case is counted in the
metrics record. The policy, case by case, is docs/numerics.md.
"""

from __future__ import annotations

import gc
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR
from transformers import AutoTokenizer

from kpo_core.advantages import group_advantages
from kpo_core.config import AlgorithmConfig, EstimatorConfig
from kpo_core.diagnostics import DIAGNOSTIC_SUMS, diagnostic_sums
from kpo_core.losses import (
    LossNormaliser,
    NonFiniteInputError,
    aggregate_loss,
    token_policy_loss,
)
from kpo_core.ratios import masked_mean_or
from services.learner import checkpoint
from services.learner.batch import TrainingBatch, collate
from services.learner.distributed import RankGroup
from services.learner.export import write_hf_files
from services.learner.logprobs import reference_logprobs, response_logprobs
from services.learner.lora import MergedWeights, base_model, is_adapted, write_adapter_config
from services.learner.metrics import (
    ONPOLICY_SUMS,
    PER_PASS,
    MinibatchAccumulator,
    batch_metric_tensors,
    diagnostic_sum_metrics,
    finite_mask,
    onpolicy_ratio_metrics,
    onpolicy_ratio_sums,
    raw_ratios,
    reduce_minibatches,
    shadow_key,
)
from services.learner.micro_batches import MicroBatch, plan_minibatch
from services.learner.publish import (
    Fence,
    WeightView,
    full_weights,
    iter_buckets,
    overlapped_buckets,
    weights_manifest,
)
from services.learner.sharding import build_policy, compute_context, compute_dtype
from services.messages import ScoredGroup
from services.spec import LearnerConfig
from services.weights.base import WeightsManifest


def linear_warmup(warmup_steps: int) -> Callable[[int], float]:
    """LambdaLR factor: (step + 1) / warmup_steps for the first steps, then 1; 0 steps = 1.

    Starting at 1 / warmup_steps rather than 0 makes the first step a real update.
    """

    def factor(step: int) -> float:
        return 1.0 if warmup_steps == 0 else min(1.0, (step + 1) / warmup_steps)

    return factor


def set_base_lr(scheduler: LambdaLR, lr: float) -> None:
    """Make `lr` the schedule's base rate, at the point of the schedule it has reached."""
    scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


class MicroBatchTooLarge(RuntimeError):
    """A micro-batch's forward or backward ran out of device memory (the message says which
    setting to change, and to what)."""


def micro_batch_tokens(batch: TrainingBatch, packed: bool) -> int:
    """The tokens one forward over `batch` costs, from the host lengths: its padded size
    (rows x widths), or with packed rows the sum of their lengths."""
    if packed and batch.num_rows > 1:
        return sum(batch.prompt_lengths) + sum(batch.response_lengths)
    return batch.num_rows * (batch.prompt_width + batch.response_width)


def too_large(batch: TrainingBatch, packed: bool, budget: int) -> MicroBatchTooLarge:
    """The error for a micro-batch of `batch` that did not fit: a `learner.micro_batch_tokens`
    that would (half its tokens, in multiples of 256, at least its longest row), or, for a
    single row, the settings that shrink one row's memory."""
    tokens = micro_batch_tokens(batch, packed)
    longest = max(p + t for p, t in zip(batch.prompt_lengths, batch.response_lengths, strict=True))
    setting = f"learner.micro_batch_tokens={budget}" + (" (no limit)" if budget == 0 else "")
    if batch.num_rows == 1:
        return MicroBatchTooLarge(
            f"a micro-batch of one row ({tokens} tokens) ran out of device memory with "
            f"{setting}: even one row cannot fit; set learner.gradient_checkpointing=true or "
            "lower learner.logprob_chunk_tokens (or use shorter responses)"
        )
    fit = max(longest, tokens // 2 // 256 * 256)
    return MicroBatchTooLarge(
        f"a micro-batch of {batch.num_rows} rows ({tokens} tokens) ran out of device memory "
        f"with {setting}; set learner.micro_batch_tokens={fit} (or lower)"
    )


def free_device_memory(device: torch.device) -> None:
    """Release what an interrupted forward or backward left behind (its tensors are garbage
    once the exception is dropped) back to the device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Minibatch:
    """The rows of one optimiser step (or one micro-batch of it) and what their loss needs.

    rows [b]: the rows' indices in the step's batch; advantages [b]; ref_logp [b, T] (behaviour
    or proximal); behaviour_logp [b, T] when the reference is proximal (decoupled-PPO weights),
    else None.
    """

    batch: TrainingBatch
    rows: Tensor
    advantages: Tensor
    ref_logp: Tensor
    behaviour_logp: Tensor | None

    def valid(self) -> Tensor:
        """[b, T] bool: the tokens the loss can use, as far as known before the forward."""
        advantages = self.advantages.unsqueeze(-1).expand(self.ref_logp.shape)
        extra = () if self.behaviour_logp is None else (self.behaviour_logp,)
        return finite_mask(self.batch.response_mask, self.ref_logp, advantages, *extra)

    def part(self, micro: MicroBatch) -> Minibatch:
        """The micro-batch's rows, cropped to their own widths (a filler carries no loss)."""
        # The rows are host data: the crop reads host lengths, the index is copied without a wait.
        index = torch.tensor(micro.rows, dtype=torch.long).to(self.rows.device, non_blocking=True)
        batch = self.batch.select(micro.rows).cropped()
        width = batch.response_width
        if micro.filler:
            batch = replace(batch, response_mask=torch.zeros_like(batch.response_mask))
        behaviour = self.behaviour_logp
        return Minibatch(
            batch,
            self.rows[index],
            self.advantages[index],
            self.ref_logp[index, :width],
            None if behaviour is None else behaviour[index, :width],
        )


# What a micro-batch logs for the ratio diagnostics: its raw ratio, estimator ratio and mask
# [b, t], and each shadow estimator's ratio [b, t].
RatioViews = tuple[Tensor, Tensor, Tensor, tuple[Tensor, ...]]
# Record keys of a shadow estimator's `token_policy_loss` metrics that do not depend on the
# estimator: the training estimator's, in the record already.
NOT_SHADOWED = frozenset(
    {
        "approx_kl",
        "nonfinite_tokens",
        "extreme_ratio_tokens",
        "behaviour_weight_mean",
        "behaviour_weight_max",
        "tis_truncated_fraction",
        "mis_masked_fraction",
    }
)


@dataclass
class RatioLog:
    """Detached raw and estimator ratios of every micro-batch of a step with their masks, padded
    to the batch's response width (every epoch: the step's diagnostics), and what `save`
    writes of the first epoch's rows. Kept on the device: the diagnostics are summed there
    (`diagnostic_sums`) and read back with the step's other metrics. Their shapes depend on
    the rows' valid token counts, which each optimiser step's decision reads (`unread_lengths`,
    `read_lengths`): the host knows them by the step's end. `shadows`: the number of shadow
    estimators, whose ratios are logged too (`shadow`, one tuple per micro-batch)."""

    width: int
    shadows: int = 0
    raw: list[Tensor] = field(default_factory=list)
    filtered: list[Tensor] = field(default_factory=list)
    shadow: list[tuple[Tensor, ...]] = field(default_factory=list)
    masks: list[Tensor] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    parts_read: int = 0  # the logged micro-batches whose rows' `lengths` the host knows
    first_epoch: list[dict[str, Tensor]] = field(default_factory=list)

    def _pad(self, values: Tensor, fill: float | bool) -> Tensor:
        return torch.nn.functional.pad(values, (0, self.width - values.shape[-1]), value=fill)

    def add(
        self,
        raw: Tensor,
        filtered: Tensor,
        mask: Tensor,
        shadows: tuple[Tensor, ...],
        part: Minibatch,
        minibatch: int | None,
    ) -> None:
        """Log one micro-batch; `minibatch` (its index) is given in the first epoch only."""
        raw, filtered = self._pad(raw.float(), 1.0), self._pad(filtered.float(), 1.0)
        mask = self._pad(mask, False)
        self.raw.append(raw)
        self.filtered.append(filtered)
        self.shadow.append(tuple(self._pad(ratio.float(), 1.0) for ratio in shadows))
        self.masks.append(mask)
        if minibatch is not None:
            self.first_epoch.append(
                {
                    "log_ratio": raw.log(),
                    "mask": mask,
                    "row": part.rows,
                    "staleness": part.batch.staleness,
                    "token_versions": self._pad(part.batch.token_versions, 0),
                    "advantage": part.advantages.detach().float(),
                    "minibatch": torch.full((part.batch.num_rows,), minibatch, device=mask.device),
                }
            )

    def unread_lengths(self) -> Tensor:
        """[rows] float64: the valid tokens of each row logged since the last `read_lengths`,
        on the device (on the host when there is none)."""
        unread = self.masks[self.parts_read :]
        if not unread:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([mask.sum(dim=-1) for mask in unread]).to(torch.float64)

    def read_lengths(self, values: Sequence[float]) -> None:
        """The host values of the last `unread_lengths`."""
        self.lengths += [int(value) for value in values]
        self.parts_read = len(self.masks)
        assert len(self.lengths) == sum(m.shape[0] for m in self.masks), "lengths of other rows"

    def diagnostic_sums(self, device: torch.device) -> Tensor:
        """[raw sums, estimator sums, each shadow estimator's sums] ([(2 + shadows) *
        DIAGNOSTIC_SUMS] float64, `diagnostic_sums`) of every logged row on the device, nothing
        read back: the sums of the ranks' logs add up to those of all their rows."""
        if not self.masks:
            size = (2 + self.shadows) * DIAGNOSTIC_SUMS
            return torch.zeros(size, dtype=torch.float64, device=device)
        assert self.parts_read == len(self.masks), "lengths not read"
        mask = torch.cat(self.masks)
        shadows = [torch.cat([part[i] for part in self.shadow]) for i in range(self.shadows)]
        ratios = [torch.cat(self.raw), torch.cat(self.filtered), *shadows]
        return torch.cat([diagnostic_sums(r, mask, self.lengths) for r in ratios]).to(device)

    def rows_on_host(self) -> list[dict[str, Tensor]]:
        """The first epoch's rows (what `save` writes), copied to the host."""
        return [{key: value.cpu() for key, value in row.items()} for row in self.first_epoch]

    @staticmethod
    def save(rows: Sequence[dict[str, Tensor]], path: Path, version: int) -> None:
        """Write the first epoch's log-ratios (`rows_on_host` of every rank) for offline
        analysis (format: `ratio_file`)."""
        keys = (*RATIO_FILE_ROWS, "minibatch")
        columns = {key: torch.cat([m[key] for m in rows]) for key in keys}
        order = torch.argsort(columns["minibatch"] * (columns["row"].max() + 1) + columns["row"])
        record = {key: value[order] for key, value in columns.items()}
        record["version"] = torch.tensor(version)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save(record, partial)
        partial.replace(path)


RATIO_FILE_ROWS = ("log_ratio", "mask", "row", "staleness", "advantage", "token_versions")


def _nothing() -> None:
    """No publish reads the weights beside a step (a learner without a publisher)."""


def ratio_file(ratio_dir: Path, version: int) -> Path:
    """Where the log-ratios of the step that started from version `version` are saved.

    The file (named after the step, version + 1) is a torch dict of the first epoch's rows in
    minibatch order, rows ascending within a minibatch: log_ratio [N, T] float32 (log of the raw
    ratio, z clamped to +-20, 0 off the mask), mask [N, T] bool, row [N] (the row's index in the
    step's batch), staleness [N], advantage [N], minibatch [N], token_versions [N, T] int64 (the
    policy version that sampled each token, 0 off the mask: where in-flight updates switched
    the sampler); and version (the weights the step started from).
    """
    return ratio_dir / f"step-{version + 1:06d}.pt"


def trained_tokens(batch: TrainingBatch) -> TrainingBatch:
    """`batch` with the tokens no loss may use off its response mask: those of responses
    without a finite reward, and those whose kept set was over the replay limit (a set not
    recorded: their log-prob over it cannot be taken). Both are counted in the batch
    statistics, which read the mask before this."""
    valid = batch.response_mask & torch.isfinite(batch.rewards).unsqueeze(-1)
    if batch.replay_dropped is not None:
        valid = valid & ~batch.replay_dropped
    return replace(batch, response_mask=valid)


def resolve_device(name: str) -> torch.device:
    """The learner's device: `cuda` means the (first) GPU Ray assigned to this rank."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class LearnerCore:
    """Model, AdamW optimiser, warm-up schedule and version of one learner rank (module doc)."""

    def __init__(
        self,
        model_path: str | Path,
        learner: LearnerConfig,
        algorithm: AlgorithmConfig,
        temperature: float,
        seed: int = 0,
        num_threads: int | None = None,
        ratio_dir: str | Path | None = None,
        group: RankGroup | None = None,
        *,
        response_length: int | None = None,
        before_update: Callable[[], None] | None = None,
    ) -> None:
        """Load the model and tokenizer from `model_path`; version 0 is those weights.

        `temperature` is the generation temperature (the learner divides logits by it);
        `seed` seeds the minibatch permutations; `num_threads`, when given, is passed to
        torch.set_num_threads (a process-wide setting); `ratio_dir` receives the log-ratio
        files of `learner.record_ratios_every` (`ratio_file`). `group`: this rank's place in a
        learner group whose process group is joined already (default: a group of one).
        `response_length`: the run's response limit (generation.max_new_tokens), which KPO's
        `reference_length: auto` resolves to; it may be None only when `algorithm` needs no
        length (resolved already, as the learner group hands it, or another setting).
        `before_update`: called before every change of the weights (an optimiser update, a
        checkpoint load), on the training thread: the publisher's fences, so that a publish
        reading the weights beside the next step has read them first.
        """
        if not temperature > 0:
            raise ValueError(
                f"temperature must be > 0 (the generation temperature), got {temperature}"
            )
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        algorithm = algorithm.with_response_length(response_length)
        self.learner, self.algorithm, self.temperature = learner, algorithm, temperature
        self.shadows: tuple[EstimatorConfig, ...] = algorithm.shadow_estimators
        self.group = group or RankGroup()
        self.model_path = str(model_path)
        self.ratio_dir = None if ratio_dir is None else Path(ratio_dir)
        self.device = resolve_device(learner.device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        pad_id = self.tokenizer.pad_token_id
        self.pad_id = int(pad_id if pad_id is not None else (self.tokenizer.eos_token_id or 0))
        self.model = build_policy(self.model_path, learner, self.group, self.device)
        # Every parameter, or with learner.lora the adapters' alone (AdamW state adapter-sized).
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            trainable,
            lr=learner.lr,
            betas=learner.betas,
            weight_decay=learner.weight_decay,
            # Fused: the step counts live on the parameters' device, so a step reads nothing
            # back (the default keeps them on the host and reads each one per parameter).
            fused=True,
        )
        self.scheduler = LambdaLR(self.optimizer, linear_warmup(learner.warmup_steps))
        self.generator = torch.Generator().manual_seed(seed)
        self.before_update = before_update or _nothing
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
        tokens_trained; replay_* with kept sets) are over the batch, once. Loss metrics are
        per minibatch (its micro-batches and ranks merged by `merge_micro_batches`), then
        reduced over the minibatches (`reduce_minibatches`): `*_max` max, `*_min` min,
        skipped_minibatches and empty_minibatches summed, nonfinite_tokens and
        extreme_ratio_tokens summed and divided by the epochs, the rest averaged over
        minibatches where finite (so grad_norm is absent when no minibatch was trained).
        entropy is from the first epoch (each row once).
        raw_* / filtered_* are `ratio_diagnostics` of the raw ratios exp(z) and of the
        estimator's ratios over all minibatches of the step; shadow_<name>_* the same for each
        shadow estimator (`_shadow_losses`). lr is the rate this step used;
        policy_version the version after it; micro_batches the forward passes of each rank;
        learner_world_size the ranks.

        A response whose reward is NaN/inf is left out of its group's advantages and of the
        loss (its tokens are masked). With `nonfinite="raise"` a NaN/inf reward raises
        NonFiniteInputError before any update, and a NaN/inf log-prob raises it in the
        minibatch that meets it: minibatches already applied in this step keep their updates,
        and the version does not advance.
        """
        rewards = [scored.reward for group in groups for scored in group.responses]
        # Checked on the host, where the rewards are: no wait on the device.
        bad_rewards = sum(not math.isfinite(reward) for reward in rewards)
        if self.learner.nonfinite == "raise" and bad_rewards:
            raise NonFiniteInputError(
                f"{bad_rewards} of {len(rewards)} rewards are NaN/inf; learner.nonfinite='mask' "
                "drops those responses instead"
            )
        batch = collate(groups, self.pad_id, self._version).to(self.device)
        advantages = self._advantages(batch, len(groups))
        batch_stats = batch_metric_tensors(batch, num_groups=len(groups))
        batch = trained_tokens(batch)
        ref_logp, behaviour_logp = self._references(batch)
        lr = float(self.scheduler.get_last_lr()[0])
        steps: list[tuple[MinibatchAccumulator, dict[str, float]]] = []
        ratios = RatioLog(batch.response_width, len(self.shadows))
        passes = 0
        for epoch in range(self.learner.ppo_epochs):
            for index, rows in enumerate(self._minibatch_rows(batch.num_rows)):
                # Host rows select the batch; their copy on the device indexes the references.
                index_t = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
                behaviour = None if behaviour_logp is None else behaviour_logp[index_t]
                part = Minibatch(
                    batch.select(rows),
                    index_t,
                    advantages[index_t],
                    ref_logp[index_t],
                    behaviour,
                )
                accumulator, outcome, count = self._train_minibatch(
                    part, index if epoch == 0 else None, ratios
                )
                steps.append((accumulator, outcome))
                passes += count
        onpolicy = self._onpolicy_sums(batch, ref_logp, behaviour_logp, ratios)
        self.scheduler.step()
        self._version += 1
        self._steps += 1
        records, diagnostics = self._minibatch_records(steps, batch_stats, ratios, onpolicy)
        self._save_ratios(ratios)
        if self.group.rank != 0:
            return {}  # the group's record is rank 0's
        metrics, records = records[0], records[1:]
        metrics.update(reduce_minibatches(records))
        metrics.update(diagnostics)
        for key in PER_PASS:
            # A count per pass over the batch, like tokens_trained (not multiplied by the epochs).
            metrics[key] /= self.learner.ppo_epochs
        metrics.update(
            lr=lr,
            policy_version=float(self._version),
            micro_batches=float(passes),
            learner_world_size=float(self.group.world_size),
        )
        return metrics

    def _save_ratios(self, ratios: RatioLog) -> None:
        """Every `learner.record_ratios_every` steps, the first epoch's log-ratios of every
        rank to the step's ratio file (`ratio_file`): every rank's rows are gathered to rank 0
        (a collective: every rank calls this), which writes them."""
        every = self.learner.record_ratios_every
        if self.ratio_dir is None or not every or self._version % every:
            return
        saved_rows = self.group.gather(ratios.rows_on_host())
        if self.group.rank == 0 and saved_rows is not None:
            every_rank = [row for rank_rows in saved_rows for row in rank_rows]
            version = self._version - 1
            RatioLog.save(every_rank, ratio_file(self.ratio_dir, version), version)

    def _minibatch_records(
        self,
        steps: Sequence[tuple[MinibatchAccumulator, dict[str, float]]],
        batch_stats: dict[str, Tensor],
        ratios: RatioLog,
        onpolicy: Tensor,
    ) -> tuple[list[dict[str, float]], dict[str, float]]:
        """([the batch statistics, then each minibatch's record], the ratio diagnostics of
        every rank's rows, prefixed raw_ and filtered_, and the on-policy ratio's statistics
        of `onpolicy`'s sums), read back in one transfer.

        The minibatches' device sums of every rank, and the sums behind the diagnostics, are
        reduced in two collectives for the whole step (a sum and a max), not one per
        minibatch; each record then adds the loss, gradient norm and skip counts its optimiser
        step already read.
        """
        sums = [accumulator.sum_part() for accumulator, _ in steps]
        maxes = [accumulator.max_part() for accumulator, _ in steps]
        diagnostic = torch.cat([ratios.diagnostic_sums(self.device), onpolicy.to(self.device)])
        summed = self.group.sum(torch.cat([diagnostic, *sums]))
        maxed = self.group.max(torch.cat(maxes))
        stats = torch.stack(list(batch_stats.values())).to(summed)
        # The step's one read of its metrics: everything it counted, on the device until now.
        values = torch.cat([stats, summed, maxed.to(summed)]).tolist()
        records = [dict(zip(batch_stats, values[: len(stats)], strict=True))]
        at_sum, at_max = len(stats), len(stats) + len(summed)
        at_onpolicy = at_sum + len(diagnostic) - ONPOLICY_SUMS
        diagnostics = self._diagnostics(values[at_sum:at_onpolicy])
        diagnostics.update(onpolicy_ratio_metrics(values[at_onpolicy : at_sum + len(diagnostic)]))
        at_sum += len(diagnostic)
        for (accumulator, outcome), sum_part, max_part in zip(steps, sums, maxes, strict=True):
            record = accumulator.merged(
                values[at_sum : at_sum + len(sum_part)], values[at_max : at_max + len(max_part)]
            )
            at_sum, at_max = at_sum + len(sum_part), at_max + len(max_part)
            records.append({**record, **outcome})
        return records, diagnostics

    def _onpolicy_sums(
        self,
        batch: TrainingBatch,
        ref_logp: Tensor,
        behaviour_logp: Tensor | None,
        ratios: RatioLog,
    ) -> Tensor:
        """`onpolicy_ratio_sums` of the step's tokens that its starting weights sampled (token
        version = the learner's) against those weights, before any update moved them: with
        proximal log-probs (those weights computed them) every row; otherwise the first
        minibatch's rows, whose ratios come before the step's first optimiser step. The ranks'
        sums add up (`_minibatch_records`): every rank holds every row's proximal log-probs, so
        rank 0 alone counts them; the first minibatch's ratios are each rank's own rows."""
        if behaviour_logp is not None:
            fresh = batch.response_mask & (batch.token_versions == self._version)
            every_row = onpolicy_ratio_sums(ref_logp - behaviour_logp, fresh)
            return every_row if self.group.rank == 0 else torch.zeros_like(every_row)
        sums = [
            onpolicy_ratio_sums(
                row["log_ratio"],
                row["mask"]
                & (row["token_versions"] == self._version)
                & (row["minibatch"] == 0)[:, None],
            )
            for row in ratios.first_epoch
        ]
        if not sums:
            return torch.zeros(ONPOLICY_SUMS, dtype=torch.float64, device=self.device)
        return torch.stack(sums).sum(0)

    def _diagnostics(self, sums: Sequence[float]) -> dict[str, float]:
        """The ratio diagnostics of `RatioLog.diagnostic_sums` values: raw_*, filtered_* and
        each shadow estimator's shadow_<name>_*."""
        prefixes = ["raw_", "filtered_", *(shadow_key(s.name, "") for s in self.shadows)]
        return {
            key: value
            for i, prefix in enumerate(prefixes)
            for key, value in diagnostic_sum_metrics(
                prefix, sums[i * DIAGNOSTIC_SUMS : (i + 1) * DIAGNOSTIC_SUMS]
            ).items()
        }

    def _advantages(self, batch: TrainingBatch, num_groups: int) -> Tensor:
        """Group-relative advantages [B] of the batch's rewards (NaN/inf ones dropped: A = 0);
        the rows' group_ids index the step's `num_groups` groups."""
        cfg = self.algorithm.advantages
        return group_advantages(
            batch.rewards,
            batch.group_ids,
            cfg.mode,
            cfg.eps,
            cfg.std_unbiased,
            nonfinite="drop",
            num_groups=num_groups,
        ).float()

    def _plan(self, batch: TrainingBatch) -> list[MicroBatch]:
        """This rank's passes over `batch` (every rank computes every rank's plan alike), from
        the rows' host lengths: planning never waits on the device."""
        world, budget = self.group.world_size, self.learner.micro_batch_tokens
        plan = plan_minibatch(
            batch.prompt_lengths, batch.response_lengths, world, budget, self.model.packed
        )
        return plan[self.group.rank]

    def _references(self, batch: TrainingBatch) -> tuple[Tensor, Tensor | None]:
        """(ref_logp [B, T], behaviour_logp [B, T] or None) for `algorithm.reference`.

        Proximal log-probs: each rank computes its share of the rows under the step's starting
        weights, and the shares are summed over the ranks (each row is 0 on the other ranks).
        """
        if self.algorithm.reference == "behaviour":
            return batch.behaviour_logp, None
        plan = self._plan(batch)
        rows = [micro.rows for micro in plan if not micro.filler]
        fillers = [micro.rows for micro in plan if micro.filler]
        try:
            with compute_context(self.learner, self.device):
                proximal = reference_logprobs(self.model, batch, self.temperature, rows)
                # Filler passes keep the ranks' collectives in step; their values are dropped.
                reference_logprobs(self.model, batch, self.temperature, fillers)
        except torch.OutOfMemoryError:
            pass  # raised below, outside the handler, once the failed pass's tensors are freed
        else:
            return self.group.sum(proximal), batch.behaviour_logp
        free_device_memory(self.device)
        # The largest of this rank's micro-batches names the size.
        parts = [batch.select(micro.rows).cropped() for micro in plan]
        failed = max(parts, key=lambda part: micro_batch_tokens(part, self.model.packed))
        raise too_large(failed, self.model.packed, self.learner.micro_batch_tokens)

    def _minibatch_rows(self, num_rows: int) -> list[list[int]]:
        """Row indices of each minibatch, on the host: `minibatches` slices of a fresh seeded
        permutation (drawn on the CPU generator; its one `tolist` waits on no device)."""
        order = torch.randperm(num_rows, generator=self.generator).tolist()
        size, extra = divmod(num_rows, self.learner.minibatches)
        # tensor_split's slices: the first `extra` get one row more.
        bounds = [i * size + min(i, extra) for i in range(self.learner.minibatches + 1)]
        slices = [order[a:b] for a, b in itertools.pairwise(bounds)]
        return [rows for rows in slices if rows]

    def _train_minibatch(
        self, minibatch: Minibatch, index: int | None, ratios: RatioLog
    ) -> tuple[MinibatchAccumulator, dict[str, float], int]:
        """This rank's micro-batches of one minibatch, then (if everything is finite) one
        optimiser step. Returns the minibatch's metrics, still on the device (`_minibatch_records`
        reads them at the step's end), what its optimiser step decided, and this rank's passes.

        `index` (the minibatch's) is given in the first epoch, which also measures entropy.
        No step when no valid token is left: counted as skipped_minibatches if the minibatch
        had tokens (all NaN/inf), else as empty_minibatches (nothing to train).

        The one read of the minibatch: its loss, valid tokens and gradient norm (summed over
        the ranks), which decide whether AdamW steps; a skipped step must leave AdamW's moments
        and step count as they were, which only a decision on the host can do for torch's AdamW.
        The same read brings the valid tokens of this rank's rows (`RatioLog.read_lengths`).
        """
        self.optimizer.zero_grad(set_to_none=True)
        # The minibatch's own padded width, as its unsplit forward would be padded.
        normaliser = LossNormaliser.of(minibatch.valid(), minibatch.batch.longest_response)
        plan = self._plan(minibatch.batch)
        accumulator = MinibatchAccumulator()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for micro in plan:
            part = minibatch.part(micro)
            metrics, tokens, views, loss = self._train_micro_batch(
                part, normaliser, index is not None
            )
            loss_sum = loss_sum + loss.to(torch.float64)
            accumulator.add(metrics, tokens, real=not micro.filler)
            if not micro.filler:
                ratios.add(*views, part, index)
        had_tokens = minibatch.batch.response_mask.any().to(torch.float64)
        totals = self.group.sum(torch.stack([loss_sum, accumulator.tokens, had_tokens]))
        grad_norm = self._clip_gradients()
        # With the decision: this rank's logged rows' valid tokens, the diagnostics' shapes.
        lengths = ratios.unread_lengths().to(totals)
        decision = torch.cat([totals, grad_norm.reshape(1), lengths]).tolist()
        loss_value, valid, had, norm = decision[:4]
        ratios.read_lengths(decision[4:])
        if valid == 0:
            self.optimizer.zero_grad(set_to_none=True)
            outcome = {
                "policy_loss": loss_value,
                "skipped_minibatches": float(had > 0),
                "empty_minibatches": float(had == 0),
            }
            return accumulator, outcome, len(plan)
        applied = math.isfinite(loss_value) and math.isfinite(norm)
        if applied:
            self.before_update()  # an overlapped publish of the last version may read them
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        outcome = {
            "policy_loss": loss_value,
            "grad_norm": norm,
            "skipped_minibatches": float(not applied),
            "empty_minibatches": 0.0,
        }
        return accumulator, outcome, len(plan)

    def _train_micro_batch(
        self, part: Minibatch, normaliser: LossNormaliser, with_entropy: bool
    ) -> tuple[dict[str, Tensor], Tensor, RatioViews, Tensor]:
        """Forward, loss (normalised by the whole minibatch), backward of one micro-batch; a
        forward or backward that runs out of device memory raises `MicroBatchTooLarge`.

        Returns its loss metrics (the shadow estimators' too) and valid token count (0-dim
        tensors, not read back), its (raw ratio, estimator ratio, mask, shadow ratios) [b, t]
        for the ratio diagnostics, and its share of the minibatch's loss (detached).
        """
        try:
            return self._forward_backward(part, normaliser, with_entropy)
        except torch.OutOfMemoryError:
            pass  # raised below, outside the handler, once the failed pass's tensors are freed
        self.optimizer.zero_grad(set_to_none=True)
        free_device_memory(self.device)
        raise too_large(part.batch, self.model.packed, self.learner.micro_batch_tokens)

    def _forward_backward(
        self, part: Minibatch, normaliser: LossNormaliser, with_entropy: bool
    ) -> tuple[dict[str, Tensor], Tensor, RatioViews, Tensor]:
        algorithm = self.algorithm
        with compute_context(self.learner, self.device):
            logp, entropy = response_logprobs(
                self.model, part.batch, self.temperature, with_entropy
            )
        token_loss = token_policy_loss(
            algorithm.estimator,
            logp,
            part.ref_logp,
            part.advantages,
            part.batch.response_mask,
            behaviour_logp=part.behaviour_logp,
            correction=algorithm.off_policy,
            nonfinite=self.learner.nonfinite,
            token_versions=part.batch.token_versions,
        )
        mode = algorithm.resolved_loss_agg_mode
        loss = aggregate_loss(
            token_loss.per_token, token_loss.mask, mode, algorithm.norm_length, normaliser
        )
        # Every rank runs every backward (FSDP's gradient reductions are collectives); where()
        # in the loss keeps masked and non-finite tokens' gradients exactly 0.
        torch.autograd.backward(loss)
        valid = token_loss.mask
        metrics = dict(token_loss.metric_tensors)
        if entropy is not None:
            metrics["entropy"] = masked_mean_or(entropy, valid, 0.0)
        shadow_metrics, shadow_ratios = self._shadow_losses(part, logp, normaliser)
        metrics.update(shadow_metrics)
        views = (raw_ratios(logp, part.ref_logp, valid), token_loss.ratio, valid, shadow_ratios)
        return metrics, valid.sum(), views, loss.detach()

    @torch.no_grad()
    def _shadow_losses(
        self, part: Minibatch, logp: Tensor, normaliser: LossNormaliser
    ) -> tuple[dict[str, Tensor], tuple[Tensor, ...]]:
        """Each shadow estimator's loss on the micro-batch's log-probs (detached: no gradient,
        no second forward), as a run training with it would compute and aggregate it (the same
        reference, behaviour weights and minibatch counts; `shadow_loss_agg_mode`), and its
        metrics (those that depend on the estimator) under `shadow_<name>_`; with its ratios
        [b, t] for the ratio diagnostics. 0-dim tensors on the device, nothing read back.

        The inputs are the training loss's, which has checked or masked their NaN/inf: masking
        here drops the same tokens, and never reads a count back as "raise" would.
        """
        metrics: dict[str, Tensor] = {}
        ratios: list[Tensor] = []
        for shadow in self.shadows:
            token_loss = token_policy_loss(
                shadow,
                logp.detach(),
                part.ref_logp,
                part.advantages,
                part.batch.response_mask,
                behaviour_logp=part.behaviour_logp,
                correction=self.algorithm.off_policy,
                nonfinite="mask",
                token_versions=part.batch.token_versions,
            )
            mode = self.algorithm.shadow_loss_agg_mode(shadow)
            loss = aggregate_loss(
                token_loss.per_token, token_loss.mask, mode, self.algorithm.norm_length, normaliser
            )
            metrics[shadow_key(shadow.name, "policy_loss")] = loss.to(torch.float64)
            for key, value in token_loss.metric_tensors.items():
                if key not in NOT_SHADOWED:
                    metrics[shadow_key(shadow.name, key)] = value
            ratios.append(token_loss.ratio)
        return metrics, tuple(ratios)

    def _clip_gradients(self) -> Tensor:
        """Total gradient 2-norm before clipping (over every rank's shard), a 0-dim float64
        tensor on the device; clipped to `max_grad_norm` unless it is None."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        if self.learner.max_grad_norm is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, self.learner.max_grad_norm)
        full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2
        total: Tensor = full() if full is not None else norm
        return total.to(device=self.device, dtype=torch.float64)

    def _published(self) -> torch.nn.Module | WeightView:
        """What generation receives: the policy's weights, or with LoRA the base model's with
        the adapters merged, under the base model's names (services.learner.lora)."""
        policy = self.model.policy
        return MergedWeights(policy) if is_adapted(policy) else policy

    def weights_manifest(self, bucket_bytes: int) -> WeightsManifest:
        """The manifest of the current version's published weights (the same on every rank,
        no communication): compute dtype, buckets of at most `bucket_bytes`."""
        published = self._published()
        return weights_manifest(published, compute_dtype(self.learner), self._version, bucket_bytes)

    def weight_buckets(
        self, manifest: WeightsManifest, device: torch.device | str = "cpu", pinned: bool = False
    ) -> Iterator[dict[str, Tensor]]:
        """The buckets of `manifest` gathered from the model (services.learner.publish): every
        rank must walk them together; rank 0 gets them, on `device`, the others nothing.
        `pinned`: into pinned host buckets, by copies the host does not wait for."""
        return iter_buckets(self._published(), manifest, self.group, device, pinned=pinned)

    def overlapped_weight_buckets(
        self,
        manifest: WeightsManifest,
        fence: Fence,
        after: torch.cuda.Event | None,
        device: torch.device | str = "cpu",
    ) -> Iterator[dict[str, Tensor]]:
        """The buckets of `manifest`, on `device`, read on another thread while the next step
        trains (an unsharded learner; services.learner.publish): the step's first update waits
        until they are read. `fence`: the publication's, armed on the training thread (in
        the fences `before_update` waits on) before the step."""
        return overlapped_buckets(self._published(), manifest, fence, after, device)

    def state_dict_for_publish(self) -> dict[str, Tensor]:
        """The full weights in the compute dtype on CPU, as a generation worker ends up with
        them (every rank takes part; rank 0 gets them, the others an empty dict). Tied tensors
        (e.g. input embedding and lm_head) are one shared tensor. Publishing streams
        `weight_buckets` instead; this whole dict is for checks."""
        return full_weights(
            self._published(), compute_dtype(self.learner), self.group, self._version
        )

    def _training_state(self) -> checkpoint.TrainingState:
        return checkpoint.TrainingState(self.optimizer, self.scheduler, self.generator)

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write this rank's part of a checkpoint directory at `path` (see checkpoint). With
        LoRA it holds the adapters' weights and the adapter config, not the base weights."""
        state = checkpoint.LearnerState(
            self._version, self._steps, self.group.world_size, self.learner.compute_dtype
        )
        policy = self.model.policy

        def hf_files(directory: Path) -> None:
            write_hf_files(base_model(policy), self.tokenizer, directory)  # type: ignore[arg-type]
            if is_adapted(policy):
                # Beside hf/, not in it: an export copies hf/'s files into the model directory.
                write_adapter_config(policy, directory.parent)

        adapters = is_adapted(policy)
        return checkpoint.save_checkpoint(
            path, policy, hf_files, self._training_state(), state, adapters_only=adapters
        )

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore weights (in place; with LoRA the adapters', onto the base model read from
        `model`), optimiser, schedule, RNGs and version; return the version."""
        adapters = is_adapted(self.model.policy)
        self.before_update()
        state = checkpoint.load_checkpoint(
            path, self.model.policy, self._training_state(), adapters_only=adapters
        )
        # The schedule's base rate comes back from the checkpoint; the run's spec says what it
        # is now (the same, unless a rollback's remedy or a resume's patch changed learner.lr).
        set_base_lr(self.scheduler, self.learner.lr)
        self._version, self._steps = state.version, state.steps
        return self._version
