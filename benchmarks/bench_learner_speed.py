"""The learner's speed: `LearnerCore.train_step` against a plain step on a GPU; on CPU, the
log-prob head against a plain head (benchmarks/bench_logprob_head.py) and the step's host reads.

`--device cuda` (one GPU): three cases on random-initialised models of Qwen2.5 shapes (saved
once each to a temporary directory with the tiny model's tokenizer; nothing is downloaded),
bfloat16 compute over float32 master weights:

  a. Qwen2.5-0.5B, 64 rows x (128 prompt + 1,024 response) tokens, micro_batch_tokens 16,384,
     logprob_chunk_tokens 2,048;
  b. Qwen2.5-1.5B, 32 rows x (128 + 4,096), gradient checkpointing;
  c. Qwen2.5-0.5B, 64 rows of long-tailed response lengths (128 to 4,096, mean ~1,091: the
     quantiles of an exponential, shuffled with the seed), as a.

Each case runs a PLAIN step first, the baseline a user would write by hand: the Hugging Face
model's forward under bfloat16 autocast, fp32 log-probs of the taken tokens in chunks of
positions (log_softmax + gather, no recomputation), a clipped policy-gradient loss on
group-relative advantages, backward, gradient clipping at 1, fused AdamW; then
`LearnerCore.train_step` ("ours", with `--compile` / `--pack-rows` as given) on the same tokens
and the same (padded) micro-batches. For each: seconds per step (median of `--steps` steps after
`--warmup` ones, between `torch.cuda.synchronize` calls), real tokens per second, MFU, peak
memory (`torch.cuda.max_memory_allocated` over the timed steps: weights, optimiser state and
activations), and the host reads of one more step: those `HostReads` counts (`.item()`,
`if tensor`, data-dependent shapes, copies to the host) and the synchronisations CUDA itself
reports (`torch.cuda.set_sync_debug_mode("warn")`); ratios against the plain step, and for c
its real-token rate against a's.

What keeps a run on a GPU of a given size and within a time budget, on a machine where a cut
short run must still leave figures:

  - the cases run in the order `--cases` gives, and the JSON (`--json`) is rewritten after every
    case (whole or not at all: a temporary file renamed over it) with the records so far, the
    settings, each case's status (pending, running, done, skipped with its reason, failed),
    the skips again by case ("skipped") and "complete": false until the end;
  - sizing: a case is skipped when the plain step's static memory alone (16 bytes a parameter:
    fp32 weights, gradients, AdamW's two moments; and 2 bytes of autocast's bfloat16 copies) is
    over 90% of the GPU's memory (the device's, or `--memory-gib` where less: the process is
    then held to it, so that an H200 runs as an H100 would);
  - the plain step runs first because it needs more memory than ours: when its first (warm-up)
    step runs out of memory, it is retried with micro_batch_tokens one (widest) row lower per
    micro-batch until it fits or one row fails, and ours then runs at the settings that fit
    ("micro_batch_tokens lowered from X to Y: the plain step did not fit in Z GiB"; case b's
    plain step peaked at 81.1 GiB on an H200, above an H100's ~79 GiB);
  - a variant that runs out of memory is recorded as {"error": "out of memory", "memory_gib"}
    and everything it held is freed before the run goes on;
  - `--budget-s S`: before each case after the first, its time is estimated from the cases run
    so far (each variant's wall seconds per model FLOP x this case's model FLOPs of warm-up +
    timed + counted steps, both variants, plus the time to save its model at the rate measured
    before), and the case is skipped ("budget: needs ~X s, Y s left") where that is more than
    what is left of S, counted from the process's start;
  - `--dry-run` prints the plan (cases, shapes, rows, micro_batch_tokens, parameters, model
    FLOPs, static memory against `--memory-gib`, default the device's or else 80, the cases
    skipped for memory and what measured peaks project) and exits: nothing runs on CUDA (it is
    only asked for its memory, where there is one), so it works on a CPU-only machine.

MFU = model FLOPs / seconds / `--peak-flops` (989e12: H100 / H200 dense bfloat16). Model FLOPs
of a step: 6 x the matmul parameters (attention and MLP projections of every layer, and the
head) x the real tokens, plus causal attention, 6 x L^2 x (heads x head_dim) per layer for a row
of L tokens (QK^T and AV, half the square, forward and backward). Padding and recomputation
(gradient checkpointing, the chunked head's backward) are work, not model FLOPs.

`--device cpu`: what runs without a GPU, in one run (~5-7 minutes on 2 cores):

  1. the log-prob head alone, as benchmarks/bench_logprob_head.py measures it (its
     `measure_heads` and `report`): the plain head (log_softmax + gather), the fused
     `vocab_chunked_logprobs` with and without entropy, and the head it replaced
     (benchmarks/_old_vocab_logprobs.py), forward + backward, each in its own forked process:
     seconds, peak RSS, matrix products and counted elementwise bytes per position x vocabulary
     element, ratios against the plain head, the goals (time <= 1.0x, memory <= 0.5x, bytes
     <= 1.2x, products <= plain + 1) met or missed, and the gaps of values and gradients;
  2. the host reads (`HostReads`) of one `train_step` of the repository's tiny model with one
     micro-batch and with eight: they should not grow with the micro-batches.

Runs as a script without the project installed (the repository goes on sys.path).

Usage: python benchmarks/bench_learner_speed.py --device cuda [--quick] [--compile]
           [--pack-rows auto|true|false] [--cases a,c,b] [--memory-gib G] [--budget-s S]
           [--dry-run] [--json PATH]
       python benchmarks/bench_learner_speed.py --device cpu [--positions 512] [--repeats 3]
           [--rounds 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

# The repository too: the bare GPU check runs this script where the project is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import print_table
from bench_learner import (
    QWEN25_05B,
    SIZING_SHAPES,
    ModelShape,
    param_counts,
    run_forked,
    save_model,
    synthetic_groups,
)
from bench_logprob_head import GOALS, PATHS, Shape, measure_heads
from bench_logprob_head import report as report_heads

from kpo_core.config import AlgorithmConfig
from services.learner.batch import TrainingBatch, collate
from services.learner.distributed import RankGroup
from services.learner.host_reads import HostReads
from services.learner.micro_batches import plan_minibatch
from services.learner.step import LearnerCore
from services.messages import ScoredGroup
from services.spec import LearnerConfig
from services.tasks.tiny_model import DEFAULT_MODEL_DIR

IMPORTED = time.monotonic()
GiB, MiB = 2**30, 2**20
QWEN25_15B = next(shape for shape in SIZING_SHAPES if shape.name == "Qwen2.5-1.5B")
GROUP_SIZE = 8  # rows per group: group-relative advantages need more than one
H100_BF16_DENSE_FLOPS = 989e12
CLIP = 0.2  # the plain step's PPO-style clip range
LR = 1e-6
VARIANTS = ("plain", "ours")  # in running order: plain needs more memory and sizes the case
# The plain step's memory before any activation: fp32 weights, their gradients and AdamW's two
# moments (16 bytes a parameter), and autocast's bfloat16 copies of the weights (2 bytes).
STATIC_BYTES_PER_PARAM = 16 + 2
MEMORY_SHARE = 0.9  # of the GPU's memory; the rest is for the activations at least
DEFAULT_MEMORY_GIB = 80.0  # what the dry run sizes to without a CUDA device to ask
# Plain-step peaks measured before, (GiB, at micro_batch_tokens, on): the dry run projects them.
KNOWN_PLAIN_PEAKS = {"b": (81.1, 16_384, "H200")}
T = TypeVar("T")
Step = Callable[[], object]


# --- Cases and their tokens ------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One GPU measurement: a model shape, the rows' lengths and the learner settings."""

    key: str
    name: str
    shape: ModelShape
    prompt: int
    responses: tuple[int, ...]  # one response length per row
    micro_batch_tokens: int
    chunk: int
    checkpointing: bool

    @property
    def real_tokens(self) -> int:
        return sum(self.prompt + length for length in self.responses)

    @property
    def row_width(self) -> int:
        """The widest row's padded tokens: a micro-batch of n such rows costs n of them."""
        return self.prompt + max(self.responses)

    @property
    def rows_per_micro_batch(self) -> int:
        """Rows of the first, widest micro-batch (`plan_minibatch` packs the longest first)."""
        return max(1, self.micro_batch_tokens // self.row_width)

    @property
    def flops(self) -> float:
        """Model FLOPs of one step (module doc)."""
        return model_flops(self.shape, [self.prompt + length for length in self.responses])

    @property
    def work(self) -> float:
        """The FLOPs one step executes, for time estimates: with checkpointing each layer's
        forward runs twice (forward + backward ~3 forwards' work, recomputed 4), which model
        FLOPs leave out."""
        return self.flops * (4 / 3 if self.checkpointing else 1.0)


def long_tailed_lengths(rows: int, low: int, high: int, mean: float, seed: int) -> list[int]:
    """`rows` lengths in [low, high] whose mean is about `mean`: low + the quantiles of an
    exponential (capped at high), its scale bisected to the mean, shuffled with `seed`.
    Quantiles, not samples: with 64 rows a sample's mean would wander by +-10%."""

    def lengths(scale: float) -> list[int]:
        span = high - low
        return [
            low + min(span, round(-scale * math.log(1 - (i + 0.5) / rows))) for i in range(rows)
        ]

    below, above = 1.0, float(high)
    for _ in range(60):
        scale = (below + above) / 2
        below, above = (scale, above) if statistics.mean(lengths(scale)) < mean else (below, scale)
    result = lengths((below + above) / 2)
    random.Random(seed).shuffle(result)
    return result


def gpu_cases(seed: int) -> dict[str, Case]:
    tailed = tuple(long_tailed_lengths(64, 128, 4096, 1091.0, seed))
    return {
        "a": Case("a", "0.5B 64 x (128+1024)", QWEN25_05B, 128, (1024,) * 64, 16_384, 2048, False),
        "b": Case("b", "1.5B 32 x (128+4096) ckpt", QWEN25_15B, 128, (4096,) * 32, 16_384, 2048,
                  True),
        "c": Case("c", "0.5B 64 long-tailed", QWEN25_05B, 128, tailed, 16_384, 2048, False),
    }  # fmt: skip


def case_groups(case: Case, seed: int) -> list[ScoredGroup]:
    """The case's rows as groups of GROUP_SIZE (random tokens; rewards 1, 0, 1, ... in each
    group, so every group carries a learning signal), from `synthetic_groups` row by row."""
    rows = []
    for index, length in enumerate(case.responses):
        [group] = synthetic_groups(1, length, case.prompt, case.shape.vocab, seed + index)
        reward = float(index % GROUP_SIZE % 2 == 0)
        rows.append((group.prompt, replace(group.responses[0], reward=reward)))
    return [
        ScoredGroup(rows[start][0], [response for _, response in rows[start : start + GROUP_SIZE]])
        for start in range(0, len(rows), GROUP_SIZE)
    ]


# --- Model FLOPs ------------------------------------------------------------------------------


def matmul_params(shape: ModelShape) -> int:
    """Parameters that enter a matrix product per token: q, k, v, o, gate, up, down of every
    layer, and the head (tied or not, it is a product)."""
    head_dim = shape.head_dim or shape.hidden // shape.heads
    queries, keys = shape.heads * head_dim, shape.kv_heads * head_dim
    attention = 2 * shape.hidden * queries + 2 * shape.hidden * keys
    mlp = 3 * shape.hidden * shape.intermediate
    return shape.layers * (attention + mlp) + shape.vocab * shape.hidden


def model_flops(shape: ModelShape, row_tokens: Sequence[int]) -> float:
    """FLOPs of one forward + backward over rows of `row_tokens` real tokens (module doc)."""
    head_dim = shape.head_dim or shape.hidden // shape.heads
    attention = 6 * shape.layers * shape.heads * head_dim * sum(t * t for t in row_tokens)
    return 6 * matmul_params(shape) * sum(row_tokens) + attention


# --- Sizing to the GPU's memory and to the time budget ------------------------------------------


def static_bytes(params: int) -> int:
    """The plain step's memory before any activation (STATIC_BYTES_PER_PARAM)."""
    return STATIC_BYTES_PER_PARAM * params


def memory_skip_reason(params: int, memory_bytes: float) -> str | None:
    """Why a case of `params` parameters cannot run in `memory_bytes`, or None if it may."""
    needed = static_bytes(params)
    if needed <= MEMORY_SHARE * memory_bytes:
        return None
    return (
        f"memory: the plain step's weights, gradients, optimiser state and bfloat16 copies "
        f"alone are {needed / GiB:.1f} GiB, over {MEMORY_SHARE:.0%} of {memory_bytes / GiB:.1f} GiB"
    )


def lowered(case: Case) -> Case | None:
    """The case with one row fewer in its widest micro-batch, or None at one row already."""
    rows = case.rows_per_micro_batch
    if rows <= 1:
        return None
    return replace(case, micro_batch_tokens=(rows - 1) * case.row_width)


def lowering_note(before: Case, after: Case, memory_bytes: float) -> str:
    return (
        f"micro_batch_tokens lowered from {before.micro_batch_tokens:,} to "
        f"{after.micro_batch_tokens:,}: the plain step did not fit in {memory_bytes / GiB:.1f} GiB"
    )


def projected_plain(case: Case, params: int, memory_bytes: float) -> tuple[Case, float] | None:
    """Where the plain step's peak was measured before (KNOWN_PLAIN_PEAKS): the settings the run
    is expected to settle on in `memory_bytes` and their projected peak, the static memory plus
    activations taken to grow with the rows of a micro-batch. None without a measurement."""
    known = KNOWN_PLAIN_PEAKS.get(case.key)
    if known is None:
        return None
    peak_gib, at_tokens, _ = known
    static = static_bytes(params)
    per_row = (peak_gib * GiB - static) / max(1, at_tokens // case.row_width)
    current = case
    while (peak := static + per_row * current.rows_per_micro_batch) > memory_bytes:
        smaller = lowered(current)
        if smaller is None:
            break
        current = smaller
    return current, peak


@dataclass(frozen=True)
class Timed:
    """One variant of a case already run: its wall seconds (model load, warm-up, timed and
    counted steps, any retries) and the model FLOPs of those steps."""

    variant: str
    seconds: float
    flops: float


def estimate_case_seconds(
    history: Sequence[Timed], flops: float, steps: int, save_s: float
) -> float | None:
    """A case's seconds from the cases run before it: for each variant, its seconds per model
    FLOP (all variants' where it has none yet) x `flops` per step x `steps`; plus `save_s`.
    None before any case: nothing to estimate from."""
    if not history:
        return None

    def rate(timed: Sequence[Timed]) -> float:
        return sum(t.seconds for t in timed) / sum(t.flops for t in timed)

    pooled = rate(history)
    seconds = save_s
    for variant in VARIANTS:
        own = [t for t in history if t.variant == variant]
        seconds += (rate(own) if own else pooled) * flops * steps
    return seconds


def estimate_save_seconds(saves: Sequence[tuple[float, int]], params: int) -> float:
    """Seconds to save a model of `params` parameters at the rate of the saves (seconds,
    parameters) before it; 0 before any."""
    if not saves:
        return 0.0
    return sum(s for s, _ in saves) / sum(p for _, p in saves) * params


def budget_skip_reason(needed: float | None, left: float) -> str | None:
    if needed is None or needed <= left:
        return None
    return f"budget: needs ~{needed:.0f} s, {max(left, 0.0):.0f} s left"


def skip_reason(
    params: int, memory_bytes: float, needed: float | None, left: float | None
) -> str | None:
    """Why a case is skipped (memory first, then the budget: `left` None when there is none),
    or None if it runs."""
    if (reason := memory_skip_reason(params, memory_bytes)) is not None:
        return reason
    return None if left is None else budget_skip_reason(needed, left)


def process_seconds() -> float:
    """Seconds since this process started (Linux: /proc/self/stat), so that a budget counts the
    imports too; elsewhere, since this module was imported."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, IndexError, ValueError, AttributeError):
        return time.monotonic() - IMPORTED


# --- Timing and counting on CUDA ---------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    seconds: list[float]
    peak_bytes: int
    host_reads: dict[str, int] | None  # None: not counted
    cuda_syncs: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def count_host_reads(
    step: Callable[[], object], with_host_reads: bool
) -> tuple[dict[str, int] | None, int]:
    """One step's `HostReads` counts (None unless `with_host_reads`), and the synchronisations
    CUDA's sync debug mode warns of.

    The debug mode is off again before anything here synchronises on purpose; the autograd
    engine replays its worker threads' warnings on the calling thread, so the backward's count.
    """
    reads = HostReads()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            if with_host_reads:
                with reads:
                    step()
            else:
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = sum("synchroniz" in str(warning.message) for warning in caught)
    return (dict(reads.by_name) if with_host_reads else None), syncs


def measure_cuda(
    step: Callable[[], object], warmup: int, steps: int, with_host_reads: bool = True
) -> Measured:
    """`warmup` untimed steps, `steps` timed ones (each between synchronisations; the peak
    memory is theirs), then one step with host reads counted (the counting slows it).
    `with_host_reads` False: CUDA's count only (compiled code would recompile under the
    `HostReads` mode, which dynamo traces)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated()
    reads, syncs = count_host_reads(step, with_host_reads)
    return Measured(seconds, peak, reads, syncs)


def free_cuda() -> None:
    """Drop what the last measurement left, so the next one's peak is its own."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


# --- The plain step ----------------------------------------------------------------------------


def group_advantages(batch: TrainingBatch) -> Tensor:
    """reward - its group's mean reward, per row (on the batch's device, no host read)."""
    groups = int(batch.group_ids.shape[0])  # an upper bound on the groups: no read needed
    sums = torch.zeros(groups, device=batch.device).index_add_(0, batch.group_ids, batch.rewards)
    counts = torch.zeros(groups, device=batch.device).index_add_(
        0, batch.group_ids, torch.ones_like(batch.rewards)
    )
    return batch.rewards - (sums / counts.clamp_min(1))[batch.group_ids]


class PlainStep:
    """The hand-written baseline step (module doc) on the same groups and padded micro-batches."""

    def __init__(
        self,
        model_dir: str,
        case: Case,
        groups: list[ScoredGroup],
        device: torch.device = torch.device("cuda"),  # noqa: B008 (a constant)
    ) -> None:
        self.device = device
        pretrained = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        )
        if case.checkpointing:
            pretrained.gradient_checkpointing_enable(  # type: ignore[no-untyped-call]
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        # As a plain module: transformers' typing of `to` on a PreTrainedModel confuses mypy.
        self.model = cast(nn.Module, pretrained).to(self.device)
        self.model.train()  # Hugging Face checkpoints only in training mode; dropout is 0
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, fused=True)
        self.case, self.groups = case, groups

    def logprobs(self, part: TrainingBatch) -> Tensor:
        """[b, T] fp32 log-probs of the response slots (pads included: a plain step masks)."""
        decoder = self.model.get_decoder()  # type: ignore[operator]
        head = self.model.get_output_embeddings()  # type: ignore[operator]
        hidden = decoder(
            input_ids=part.input_ids,
            attention_mask=part.attention_mask,
            position_ids=part.position_ids,
            use_cache=False,
        ).last_hidden_state
        width_p, width_t = part.prompt_width, part.response_width
        states = hidden[:, width_p - 1 : width_p + width_t - 1].reshape(-1, hidden.shape[-1])
        targets = part.response_ids.reshape(-1)
        chunks = []
        for start in range(0, int(targets.shape[0]), self.case.chunk):
            logits = head(states[start : start + self.case.chunk]).float()
            picked = targets[start : start + self.case.chunk].unsqueeze(-1)
            chunks.append(logits.log_softmax(-1).gather(-1, picked).squeeze(-1))
        return torch.cat(chunks).reshape(part.response_ids.shape)

    def __call__(self) -> None:
        batch = collate(self.groups, 0, 0).to(self.device)
        advantages = group_advantages(batch)
        tokens = batch.response_mask.sum().clamp_min(1)  # stays on the device
        plan = plan_minibatch(
            batch.prompt_lengths, batch.response_lengths, 1, self.case.micro_batch_tokens
        )[0]
        for micro in plan:
            part = batch.select(micro.rows).cropped()
            rows = torch.tensor(micro.rows).to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                logp = self.logprobs(part)
            ratio = torch.exp(logp - part.behaviour_logp)
            advantage = advantages[rows].unsqueeze(-1)
            clipped = torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * advantage
            objective = torch.minimum(ratio * advantage, clipped)
            loss = -(objective * part.response_mask).sum() / tokens
            torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


# --- One case on the GPU: out of memory, and lowering the plain step's micro-batches --------------


def pack_rows_setting(text: str) -> bool | str:
    return {"true": True, "false": False}.get(text, text)


def learner_config(case: Case, args: argparse.Namespace) -> LearnerConfig:
    return LearnerConfig(
        lr=LR,
        device="cuda",
        compute_dtype="bfloat16",
        micro_batch_tokens=case.micro_batch_tokens,
        logprob_chunk_tokens=case.chunk,
        gradient_checkpointing=case.checkpointing,
        compile=args.compile,
        pack_rows=pack_rows_setting(args.pack_rows),
    )


def guarded(measure: Callable[[], T]) -> T | None:
    """`measure()`, or None where it ran out of memory. The handler returns at once: leaving it
    drops the traceback, whose frames hold the measurement's tensors, so that the caller's
    `free_cuda` can give their memory back."""
    try:
        return measure()
    except torch.cuda.OutOfMemoryError:
        return None


def first_step(make_step: Callable[[Case], Step], case: Case) -> Step | None:
    """The step built for `case` once its first (warm-up) step ran, or None where building it or
    that step ran out of memory (`guarded`)."""

    def build_and_step() -> Step:
        step = make_step(case)
        step()
        return step

    return guarded(build_and_step)


def fit_plain(
    case: Case, make_step: Callable[[Case], Step], free: Callable[[], None]
) -> tuple[Case, Step | None]:
    """The plain step at the case's micro_batch_tokens, then at one row fewer per micro-batch
    each time its first step runs out of memory (`free` after each), down to one row: the
    settings it ran at and the warmed-up step, or the last settings tried and None."""
    current = case
    while (step := first_step(make_step, current)) is None:
        free()
        smaller = lowered(current)
        then = f"retrying at {smaller.micro_batch_tokens:,}" if smaller else "no row fewer left"
        print(
            f"[{case.key}] the plain step ran out of memory at micro_batch_tokens "
            f"{current.micro_batch_tokens:,}: {then}",
            flush=True,
        )
        if smaller is None:
            return current, None
        current = smaller
    return current, step


def summarise(case: Case, variant: str, measured: Measured, peak_flops: float) -> dict[str, Any]:
    seconds = measured.median_s
    return {
        "case": case.key,
        "name": case.name,
        "variant": variant,
        "micro_batch_tokens": case.micro_batch_tokens,
        "seconds": seconds,
        "all_seconds": measured.seconds,
        "tokens_per_s": case.real_tokens / seconds,
        "mfu": case.flops / seconds / peak_flops,
        "peak_bytes": measured.peak_bytes,
        "host_reads": None if measured.host_reads is None else sum(measured.host_reads.values()),
        "host_reads_by_name": measured.host_reads or {},
        "cuda_syncs": measured.cuda_syncs,
    }


def variant_record(
    case: Case, variant: str, measured: Measured | None, peak_flops: float, memory_bytes: float
) -> dict[str, Any]:
    """The variant's figures, or that it ran out of memory in `memory_bytes`."""
    if measured is not None:
        return summarise(case, variant, measured, peak_flops)
    return {
        "case": case.key,
        "name": case.name,
        "variant": variant,
        "micro_batch_tokens": case.micro_batch_tokens,
        "error": "out of memory",
        "memory_gib": memory_bytes / GiB,
    }


def measure_plain(
    case: Case, model_dir: str, groups: list[ScoredGroup], warmup: int, steps: int
) -> tuple[Case, bool, Measured | None]:
    """The plain step fitted to the GPU (`fit_plain`; its first step is the first warm-up one),
    then measured: the settings it ran at (the last tried where none fitted), whether one
    fitted, and its figures or None (out of memory, in the first step or a later one)."""
    fitted, step = fit_plain(case, lambda c: PlainStep(model_dir, c, groups), free_cuda)
    if step is None:
        return fitted, False, None
    return fitted, True, guarded(lambda: measure_cuda(step, warmup - 1, steps))


def measure_ours(
    case: Case, model_dir: str, groups: list[ScoredGroup], args: argparse.Namespace,
    warmup: int, steps: int,
) -> Measured | None:  # fmt: skip
    """`LearnerCore.train_step`'s figures, or None (out of memory)."""

    def measure() -> Measured:
        longest = max(len(s.response.response_token_ids) for g in groups for s in g.responses)
        core = LearnerCore(
            model_dir, learner_config(case, args), AlgorithmConfig(), 1.0, response_length=longest
        )
        # Compiled layers compile in their first steps (forward, then backward shapes); compiled
        # code would recompile under the `HostReads` mode (dynamo traces it): CUDA's count only.
        return measure_cuda(
            lambda: core.train_step(groups), warmup + 2 * args.compile, steps, not args.compile
        )

    return guarded(measure)


@dataclass(frozen=True)
class CaseOutcome:
    """A case's records (plain, ours), its status for the JSON, and its variants' wall times
    (for the budget: only the variants that ran to the end)."""

    records: list[dict[str, Any]]
    status: dict[str, Any]
    timed: list[Timed]


def case_status(case: Case, fitted: Case, plain_fits: bool, memory_bytes: float) -> dict[str, Any]:
    """The case's status: done, the micro_batch_tokens ours ran at and, where the plain step's
    were lowered, why (the report prints it)."""
    ours_tokens = (fitted if plain_fits else case).micro_batch_tokens
    status: dict[str, Any] = {"status": "done", "micro_batch_tokens": ours_tokens}
    if fitted != case:
        status["note"] = lowering_note(case, fitted, memory_bytes)
        if not plain_fits:
            status["note"] += f" at one row per micro-batch either; ours ran at {ours_tokens:,}"
    return status


def outcome_text(records: list[dict[str, Any]]) -> str:
    """Each variant's seconds per step ("plain 1.23 s, ours 0.98 s"), or its error."""
    return ", ".join(
        f"{r['variant']} " + (f"{r['seconds']:.2f} s" if "seconds" in r else r["error"])
        for r in records
    )


def run_case(
    case: Case, model_dir: str, args: argparse.Namespace, warmup: int, steps: int,
    memory_bytes: float,
) -> CaseOutcome:  # fmt: skip
    """plain, then ours at the settings the plain step fitted (its original ones where none
    fitted: ours needs less memory); each variant's objects freed before the next."""
    groups = case_groups(case, args.seed)
    flops = case.work * (warmup + steps + 1)
    start = time.perf_counter()
    fitted, plain_fits, plain = measure_plain(case, model_dir, groups, warmup, steps)
    free_cuda()
    middle = time.perf_counter()
    ours_case = fitted if plain_fits else case
    ours = measure_ours(ours_case, model_dir, groups, args, warmup, steps)
    free_cuda()
    end = time.perf_counter()
    records = [
        variant_record(fitted, "plain", plain, args.peak_flops, memory_bytes),
        variant_record(ours_case, "ours", ours, args.peak_flops, memory_bytes),
    ]
    if plain is not None and ours is not None:
        records[1]["vs_plain_time"] = ours.median_s / plain.median_s
    ran = (("plain", middle - start, plain), ("ours", end - middle, ours))
    timed = [Timed(variant, seconds, flops) for variant, seconds, measured in ran if measured]
    print(f"[{case.key}] {case.name}: {outcome_text(records)} ({end - start:.0f} s)", flush=True)
    status = case_status(case, fitted, plain_fits, memory_bytes)
    return CaseOutcome(records, status, timed)


# --- The GPU run: cases in order, the JSON after every one ----------------------------------------


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """`payload` to `path`, whole or not at all: a temporary file beside it, renamed over it, so
    that a run cut short (the check's timeout) leaves the last complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(temporary, path)


@dataclass
class RunLog:
    """What the GPU run has so far: written to `path` (if any) after every case."""

    path: Path | None
    settings: dict[str, Any]
    cases: dict[str, dict[str, Any]]  # each case's status, in running order
    records: list[dict[str, Any]] = field(default_factory=list)

    def result(self, complete: bool) -> dict[str, Any]:
        return {
            "device": "cuda",
            "complete": complete,
            "settings": self.settings,
            "cases": self.cases,
            # The skips again, by case: what a reader of the figures looks for first.
            "skipped": {
                key: status["reason"]
                for key, status in self.cases.items()
                if status["status"] == "skipped"
            },
            "records": self.records,
        }

    def save(self, complete: bool = False) -> None:
        if self.path is not None:
            write_json(self.path, self.result(complete))


def run_cases(
    keys: Sequence[str],
    decide: Callable[[str], str | None],
    run_one: Callable[[str], CaseOutcome],
    log: RunLog,
) -> None:
    """Each case in order, skipped for `decide`'s reason or run; the log saved before each case
    runs and after each. A case that raises is recorded as failed, and its error goes on up."""
    for key in keys:
        reason = decide(key)
        if reason is not None:
            log.cases[key] = {"status": "skipped", "reason": reason}
            print(f"[{key}] skipped: {reason}", flush=True)
            log.save()
            continue
        log.cases[key] = {"status": "running"}
        log.save()
        try:
            outcome = run_one(key)
        except BaseException as error:
            log.cases[key] = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
            log.save()
            raise
        log.records += outcome.records
        log.cases[key] = outcome.status
        log.save()


class GpuRun:
    """The GPU run's state between cases: the models saved so far, the measured times the budget
    estimates from, and the memory the cases are sized to."""

    def __init__(
        self, args: argparse.Namespace, cases: dict[str, Case], memory_bytes: float, root: Path,
        warmup: int, steps: int,
    ) -> None:  # fmt: skip
        self.args, self.cases, self.memory_bytes, self.root = args, cases, memory_bytes, root
        self.warmup, self.steps = warmup, steps
        self.saved: dict[ModelShape, str] = {}
        self.saves: list[tuple[float, int]] = []  # (seconds, parameters)
        self.history: list[Timed] = []

    def decide(self, key: str) -> str | None:
        case = self.cases[key]
        params = param_counts(case.shape).total
        left = self.args.budget_s - process_seconds() if self.args.budget_s > 0 else None
        save_s = 0.0 if case.shape in self.saved else estimate_save_seconds(self.saves, params)
        steps = self.warmup + self.steps + 1
        needed = estimate_case_seconds(self.history, case.work, steps, save_s)
        return skip_reason(params, self.memory_bytes, needed, left)

    def model_dir(self, shape: ModelShape) -> str:
        """The shape's random model, saved on first use."""
        if shape not in self.saved:
            start = time.perf_counter()
            out = str(self.root / f"model-{len(self.saved)}")
            params = save_model(RankGroup(), shape, out, self.args.seed)["params"]
            self.saves.append((time.perf_counter() - start, params))
            self.saved[shape] = out
            print(f"[model] {shape.name} saved ({self.saves[-1][0]:.0f} s)", flush=True)
        return self.saved[shape]

    def run(self, key: str) -> CaseOutcome:
        case = self.cases[key]
        model_dir = self.model_dir(case.shape)
        outcome = run_case(case, model_dir, self.args, self.warmup, self.steps, self.memory_bytes)
        self.history += outcome.timed
        return outcome


def record_row(r: dict[str, Any]) -> list[str]:
    """One record as a row of the GPU report: its figures, or that it ran out of memory."""
    head = [r["name"], r["variant"], f"{r['micro_batch_tokens']:,}"]
    if "error" in r:
        return [*head, r["error"], *["-"] * 6]
    return [
        *head,
        f"{r['seconds']:.3f}",
        f"{r['tokens_per_s']:,.0f}",
        f"{100 * r['mfu']:.1f}%",
        f"{r['peak_bytes'] / GiB:.1f}",
        "n/a" if r["host_reads"] is None else str(r["host_reads"]),
        str(r["cuda_syncs"]),
        f"{r['vs_plain_time']:.2f}x" if "vs_plain_time" in r else
        ("1.00x (baseline)" if r["variant"] == "plain" else "-"),
    ]  # fmt: skip


def print_gpu_report(log: RunLog) -> None:
    settings = log.settings
    print(
        f"\nOne learner step on {settings['device_name']} ({settings['memory_gib']:.1f} GiB), "
        f"bfloat16 compute; compile {settings['compile']}, pack_rows {settings['pack_rows']}; "
        f"MFU against {settings['peak_flops'] / 1e12:.0f} TFLOP/s"
    )
    headers = [
        "case", "step", "micro-batch tokens", "s/step", "tokens/s", "MFU", "peak GiB",
        "host reads", "CUDA syncs", "vs plain time",
    ]  # fmt: skip
    if log.records:
        print_table(headers, [record_row(r) for r in log.records])
    for key, status in log.cases.items():
        if status["status"] != "done" or "note" in status:
            detail = status.get("reason") or status.get("error") or status.get("note", "")
            print(f"case {key}: {status['status']}{': ' if detail else ''}{detail}")
    ours = {r["case"]: r for r in log.records if r["variant"] == "ours" and "error" not in r}
    if "a" in ours and "c" in ours:
        rate = ours["c"]["tokens_per_s"] / ours["a"]["tokens_per_s"]
        print(f"long-tailed (c) real-token rate vs fixed-length (a): {rate:.2f}x")
    for r in log.records:
        if r.get("host_reads_by_name"):
            print(f"host reads, {r['case']} {r['variant']}: {r['host_reads_by_name']}")


def cuda_memory_bytes(memory_gib: float | None) -> float:
    """The memory the cases are sized to: the device's, or `memory_gib` where that is less, the
    process then held to it (`set_per_process_memory_fraction`: an H200 runs as an H100)."""
    total = torch.cuda.get_device_properties(0).total_memory
    if memory_gib is None or memory_gib * GiB >= total:
        return float(total)
    torch.cuda.set_per_process_memory_fraction(memory_gib * GiB / total)
    return memory_gib * GiB


def gpu_settings(
    args: argparse.Namespace, cases: dict[str, Case], warmup: int, steps: int, memory: float
) -> dict[str, Any]:
    return {
        "compile": args.compile,
        "pack_rows": args.pack_rows,
        "peak_flops": args.peak_flops,
        "warmup": warmup,
        "steps": steps,
        "memory_gib": memory / GiB,
        "budget_s": args.budget_s,
        "order": list(args.cases),
        "device_name": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cases": {key: asdict(cases[key]) for key in args.cases},
    }


def step_counts(args: argparse.Namespace) -> tuple[int, int]:
    """(warm-up, timed) steps: `--quick` is the check's 1 and 2."""
    return (1, 2) if args.quick else (args.warmup, args.steps)


def main_cuda(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        sys.exit("bench_learner_speed: --device cuda needs a CUDA device (--dry-run does not)")
    memory_bytes = cuda_memory_bytes(args.memory_gib)
    warmup, steps = step_counts(args)
    cases = gpu_cases(args.seed)
    settings = gpu_settings(args, cases, warmup, steps, memory_bytes)
    log = RunLog(args.json, settings, {key: {"status": "pending"} for key in args.cases})
    log.save()
    with tempfile.TemporaryDirectory(prefix="bench-learner-speed-") as root:
        run = GpuRun(args, cases, memory_bytes, Path(root), warmup, steps)
        run_cases(args.cases, run.decide, run.run, log)
    log.save(complete=True)
    print_gpu_report(log)
    return log.result(complete=True)


# --- The plan, without CUDA (--dry-run) ----------------------------------------------------------


def plan_case(case: Case, memory_bytes: float) -> dict[str, Any]:
    """What the run would do with a case, from its shape and settings alone."""
    params = param_counts(case.shape).total
    prompts = [case.prompt] * len(case.responses)
    micro = plan_minibatch(prompts, list(case.responses), 1, case.micro_batch_tokens)[0]
    plan: dict[str, Any] = {
        "case": case.key,
        "name": case.name,
        "model": case.shape.name,
        "params": params,
        "rows": len(case.responses),
        "prompt": case.prompt,
        "responses": [min(case.responses), max(case.responses)],
        "micro_batch_tokens": case.micro_batch_tokens,
        "rows_per_micro_batch": case.rows_per_micro_batch,
        "micro_batches": len(micro),
        "model_tflops": case.flops / 1e12,
        "static_gib": static_bytes(params) / GiB,
        "limit_gib": MEMORY_SHARE * memory_bytes / GiB,
        "skip": memory_skip_reason(params, memory_bytes),
    }
    projected = projected_plain(case, params, memory_bytes)
    if projected is not None:
        plan["known_plain_peak"] = KNOWN_PLAIN_PEAKS[case.key]
        plan["projected_micro_batch_tokens"] = projected[0].micro_batch_tokens
        plan["projected_rows_per_micro_batch"] = projected[0].rows_per_micro_batch
        plan["projected_peak_gib"] = projected[1] / GiB
    return plan


def projection_text(plan: dict[str, Any], memory_gib: float) -> str:
    """What the measured peak of a case's plain step says about `memory_gib`."""
    peak, at_tokens, on = plan["known_plain_peak"]
    head = f"case {plan['case']}: the plain step peaked at {peak} GiB on an {on} at " \
           f"micro_batch_tokens {at_tokens:,}"  # fmt: skip
    if plan["projected_micro_batch_tokens"] == plan["micro_batch_tokens"]:
        return f"{head}: fits in {memory_gib:.1f} GiB"
    return (
        f"{head}, over {memory_gib:.1f} GiB: expect its warm-up to run out of memory and "
        f"micro_batch_tokens lowered to {plan['projected_micro_batch_tokens']:,} "
        f"({plan['projected_rows_per_micro_batch']} rows per micro-batch, ~"
        f"{plan['projected_peak_gib']:.1f} GiB projected: activations taken as growing with rows)"
    )


def default_memory_gib() -> float:
    """The device's memory where CUDA is there to ask, else DEFAULT_MEMORY_GIB."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GiB
    return DEFAULT_MEMORY_GIB


def print_plan(plans: list[dict[str, Any]], args: argparse.Namespace, memory_gib: float) -> None:
    warmup, steps = step_counts(args)
    print(
        f"Plan (dry run, nothing measured): cases {', '.join(args.cases)} in this order; per "
        f"case the plain step, then ours, each {warmup} warm-up + {steps} timed + 1 counted "
        f"steps; sized to {memory_gib:.1f} GiB (a case is skipped where the plain step's static "
        f"memory, {STATIC_BYTES_PER_PARAM} bytes a parameter, is over {MEMORY_SHARE:.0%})"
    )
    headers = ["case", "model", "params", "rows", "prompt+response", "micro_batch_tokens",
               "rows/micro-batch", "micro-batches", "model TFLOP/step", "static GiB",
               "limit GiB", "memory"]  # fmt: skip
    rows = [
        [f"{p['case']}. {p['name']}", p["model"], f"{p['params']:,}", str(p["rows"]),
         f"{p['prompt']}+" + "..".join(dict.fromkeys(map(str, p["responses"]))),
         f"{p['micro_batch_tokens']:,}", str(p["rows_per_micro_batch"]), str(p["micro_batches"]),
         f"{p['model_tflops']:.0f}", f"{p['static_gib']:.1f}", f"{p['limit_gib']:.1f}",
         "skip" if p["skip"] else "runs"]
        for p in plans
    ]  # fmt: skip
    print_table(headers, rows)
    for p in plans:
        if p["skip"]:
            print(f"case {p['case']}: skipped, {p['skip']}")
        if "known_plain_peak" in p:
            print(projection_text(p, memory_gib))
    budget = f"{args.budget_s:.0f} s from the process's start" if args.budget_s else "none"
    print(f"budget: {budget}; each case after the first is estimated from those before it, "
          "and skipped where it would not fit")  # fmt: skip


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    memory_gib = args.memory_gib if args.memory_gib is not None else default_memory_gib()
    cases = gpu_cases(args.seed)
    plans = [plan_case(cases[key], memory_gib * GiB) for key in args.cases]
    print_plan(plans, args, memory_gib)
    return {"device": "cuda", "dry_run": True, "memory_gib": memory_gib, "plan": plans}


# --- The CPU run: host reads of a step -----------------------------------------------------------


def step_host_reads(group: RankGroup, micro_batches: int, seed: int) -> dict[str, Any]:
    """`HostReads` of one `train_step` of the tiny model (after one uncounted step) over 16
    rows split into `micro_batches` micro-batches of equal padded size."""
    del group
    rows, prompt, response = 16, 8, 24
    config = LearnerConfig(
        lr=LR, micro_batch_tokens=0 if micro_batches == 1 else rows // micro_batches * 32
    )
    core = LearnerCore(
        DEFAULT_MODEL_DIR, config, AlgorithmConfig(), 1.0, seed=seed, response_length=response
    )
    vocab = int(json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["vocab_size"])
    groups = [
        group
        for index in range(rows // GROUP_SIZE)
        for group in synthetic_groups(GROUP_SIZE, response, prompt, vocab, seed + index)
    ]
    core.train_step(groups)
    with HostReads() as reads:
        metrics = core.train_step(groups)
    return {
        "micro_batches": int(metrics.get("micro_batches", micro_batches)),
        "host_reads": reads.total,
        "by_name": dict(reads.by_name),
    }


def print_step_host_reads(steps: list[dict[str, Any]]) -> None:
    print("\nHost reads of one train_step (tiny model, 16 rows)")
    print_table(
        ["micro-batches", "host reads", "vs 1 micro-batch", "by name"],
        [
            [str(s["micro_batches"]), str(s["host_reads"]),
             f"{s['host_reads'] / max(steps[0]['host_reads'], 1):.2f}x", str(s["by_name"])]
            for s in steps
        ],
    )  # fmt: skip


def main_cpu(args: argparse.Namespace) -> dict[str, Any]:
    """The log-prob heads (bench_logprob_head's `measure_heads`, all of its heads), then the
    step's host reads at 1 and 8 micro-batches, each in forked processes; both reported."""
    shape = Shape(args.positions, args.hidden, args.vocab, args.chunk, args.vocab_chunk, args.seed)
    heads = measure_heads(
        shape, PATHS, args.kernel, args.threads, args.repeats, args.rounds, args.timeout_s
    )
    steps = []
    for micro_batches in (1, 8):
        [record] = run_forked(step_host_reads, 1, 1, args.timeout_s, micro_batches, args.seed)
        steps.append(record)
    report_heads(shape, heads, args.threads, args.kernel)
    print_step_host_reads(steps)
    return {
        "device": "cpu",
        "shape": asdict(shape),
        "kernel": args.kernel,
        "threads": args.threads,
        "goals": GOALS,
        "heads": heads,
        "steps": steps,
    }


# --- Flags ---------------------------------------------------------------------------------------


def parse_cases(text: str) -> list[str]:
    """Case keys in the order given (the run's order), each once."""
    keys = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = sorted(set(keys) - {"a", "b", "c"})
    if not keys or unknown:
        raise argparse.ArgumentTypeError(f"cases are a, b, c (comma-separated), got {text!r}")
    return keys


def add_gpu_flags(parser: argparse.ArgumentParser) -> None:
    gpu = parser.add_argument_group("--device cuda")
    gpu.add_argument("--cases", type=parse_cases, default=["a", "b", "c"],
                     help="which, in running order (the check: a,c,b)")  # fmt: skip
    gpu.add_argument("--quick", action="store_true", help="1 warm-up step, 2 timed (gpu_check)")
    gpu.add_argument("--warmup", type=int, default=2, help="warm-up steps, >= 1")
    gpu.add_argument("--steps", type=int, default=3)
    gpu.add_argument("--compile", action="store_true", help="learner.compile: true")
    gpu.add_argument("--pack-rows", choices=["auto", "true", "false"], default="auto")
    gpu.add_argument("--peak-flops", type=float, default=H100_BF16_DENSE_FLOPS,
                     help="the GPU's dense bfloat16 FLOP/s, for MFU")  # fmt: skip
    gpu.add_argument("--memory-gib", type=float, default=None,
                     help="size the cases to this memory (default: the device's; without "
                     f"CUDA, {DEFAULT_MEMORY_GIB:.0f}); below the device's, the run is held "
                     "to it")  # fmt: skip
    gpu.add_argument("--budget-s", type=float, default=0.0,
                     help="seconds from the process's start; a case that would not fit is "
                     "skipped (0: no budget)")  # fmt: skip
    gpu.add_argument("--dry-run", action="store_true",
                     help="print the plan without CUDA and exit")  # fmt: skip


def add_cpu_flags(parser: argparse.ArgumentParser) -> None:
    cpu = parser.add_argument_group("--device cpu")
    cpu.add_argument("--positions", type=int, default=512)
    cpu.add_argument("--hidden", type=int, default=QWEN25_05B.hidden)
    cpu.add_argument("--vocab", type=int, default=QWEN25_05B.vocab)
    cpu.add_argument("--chunk", type=int, default=256, help="positions per chunk")
    cpu.add_argument("--vocab-chunk", type=int, default=32_768)
    cpu.add_argument("--threads", type=int, default=2, help="torch threads")
    cpu.add_argument("--repeats", type=int, default=3, help="timed passes per head and round")
    cpu.add_argument("--rounds", type=int, default=2, help="rounds over the heads")
    cpu.add_argument("--kernel", choices=["torch", "compiled"], default="torch")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per CPU measurement")
    add_gpu_flags(parser)
    add_cpu_flags(parser)
    args = parser.parse_args(argv)
    if min(args.warmup - 1, args.steps - 1, args.positions - 1, args.repeats - 1,
           args.rounds - 1) < 0:  # fmt: skip
        parser.error("--warmup, --steps, --positions, --repeats and --rounds must be >= 1")
    if args.dry_run and args.device != "cuda":
        parser.error("--dry-run plans the --device cuda run")
    if (args.memory_gib is not None and args.memory_gib <= 0) or args.budget_s < 0:
        parser.error("--memory-gib must be > 0, --budget-s >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    if args.device == "cuda" and not args.dry_run:
        return main_cuda(args)  # writes its JSON itself, after every case
    result = dry_run(args) if args.dry_run else main_cpu(args)
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
