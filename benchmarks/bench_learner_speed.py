"""The learner's speed: `LearnerCore.train_step` against a plain step on a GPU; the log-prob
path and the step's host reads on CPU.

`--device cuda` (one GPU): three cases on random-initialised models of Qwen2.5 shapes (saved
once each to a temporary directory with the tiny model's tokenizer; nothing is downloaded),
bfloat16 compute over float32 master weights:

  a. Qwen2.5-0.5B, 64 rows x (128 prompt + 1,024 response) tokens, micro_batch_tokens 16,384,
     logprob_chunk_tokens 2,048;
  b. Qwen2.5-1.5B, 32 rows x (128 + 4,096), gradient checkpointing;
  c. Qwen2.5-0.5B, 64 rows of long-tailed response lengths (128 to 4,096, mean ~1,091: the
     quantiles of an exponential, shuffled with the seed), as a.

Each case runs `LearnerCore.train_step` ("ours", with `--compile` / `--pack-rows` as given) and,
in the same run, a PLAIN step on the same tokens and the same (padded) micro-batches, the
baseline a user would write by hand: the Hugging Face model's forward under bfloat16 autocast,
fp32 log-probs of the taken tokens in chunks of positions (log_softmax + gather, no
recomputation), a clipped policy-gradient loss on group-relative advantages, backward, gradient
clipping at 1, fused AdamW. For each: seconds per step (median of `--steps` steps after
`--warmup` ones, between `torch.cuda.synchronize` calls), real tokens per second, MFU, peak
memory (`torch.cuda.max_memory_allocated` over the timed steps: weights, optimiser state and
activations), and the host reads of one more step: those `HostReads` counts (`.item()`,
`if tensor`, data-dependent shapes, copies to the host) and the synchronisations CUDA itself
reports (`torch.cuda.set_sync_debug_mode("warn")`); ratios against the plain step, and for c
its real-token rate against a's.

MFU = model FLOPs / seconds / `--peak-flops` (989e12: H100 / H200 dense bfloat16). Model FLOPs
of a step: 6 x the matmul parameters (attention and MLP projections of every layer, and the
head) x the real tokens, plus causal attention, 6 x L^2 x (heads x head_dim) per layer for a row
of L tokens (QK^T and AV, half the square, forward and backward). Padding and recomputation
(gradient checkpointing, the chunked head's backward) are work, not model FLOPs.

`--device cpu`: what runs without a GPU, small enough for 2 cores (~1-2 minutes):

  1. the log-prob path alone (forward + backward over N positions of one head, float32), each
     in its own forked process: `vocab_chunked_logprobs` (positions x vocabulary blocks, online
     log-sum-exp) against the reference per-position-chunk path (`chunk_logprobs` under
     activation checkpointing, chunk by chunk: the learner's path before it); seconds and the
     peak RSS above the inputs (as benchmarks/bench_learner.py measures it), and how far the
     results differ;
  2. the host reads (`HostReads`) of one `train_step` of the repository's tiny model with one
     micro-batch and with eight: they should not grow with the micro-batches.

Usage: python benchmarks/bench_learner_speed.py --device cuda [--quick] [--compile]
           [--pack-rows auto|true|false] [--cases a,b,c] [--json PATH]
       python benchmarks/bench_learner_speed.py --device cpu [--positions 512] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import print_table
from bench_learner import (
    QWEN25_05B,
    SIZING_SHAPES,
    ModelShape,
    mmap_large_allocations,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    run_forked,
    save_model,
    synthetic_groups,
)

from kpo_core.config import AlgorithmConfig
from services.learner.batch import TrainingBatch, collate
from services.learner.distributed import RankGroup
from services.learner.host_reads import HostReads
from services.learner.logprobs import chunk_logprobs
from services.learner.micro_batches import plan_minibatch
from services.learner.step import LearnerCore
from services.learner.vocab_logprobs import vocab_chunked_logprobs
from services.messages import ScoredGroup
from services.spec import LearnerConfig
from services.tasks.tiny_model import DEFAULT_MODEL_DIR

GiB, MiB = 2**30, 2**20
QWEN25_15B = next(shape for shape in SIZING_SHAPES if shape.name == "Qwen2.5-1.5B")
GROUP_SIZE = 8  # rows per group: group-relative advantages need more than one
H100_BF16_DENSE_FLOPS = 989e12
CLIP = 0.2  # the plain step's PPO-style clip range
LR = 1e-6


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


# --- The GPU run ---------------------------------------------------------------------------------


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


def summarise(case: Case, variant: str, measured: Measured, peak_flops: float) -> dict[str, Any]:
    seconds = measured.median_s
    flops = model_flops(case.shape, [case.prompt + t for t in case.responses])
    return {
        "case": case.key,
        "name": case.name,
        "variant": variant,
        "seconds": seconds,
        "all_seconds": measured.seconds,
        "tokens_per_s": case.real_tokens / seconds,
        "mfu": flops / seconds / peak_flops,
        "peak_bytes": measured.peak_bytes,
        "host_reads": None if measured.host_reads is None else sum(measured.host_reads.values()),
        "host_reads_by_name": measured.host_reads or {},
        "cuda_syncs": measured.cuda_syncs,
    }


def measure_ours(
    case: Case, model_dir: str, groups: list[ScoredGroup], args: argparse.Namespace,
    warmup: int, steps: int,
) -> Measured:  # fmt: skip
    longest = max(len(s.response.response_token_ids) for g in groups for s in g.responses)
    core = LearnerCore(
        model_dir, learner_config(case, args), AlgorithmConfig(), 1.0, response_length=longest
    )
    # Compiled layers compile in their first steps (forward, then backward shapes).
    return measure_cuda(
        lambda: core.train_step(groups), warmup + 2 * args.compile, steps, not args.compile
    )


def measure_plain(
    case: Case, model_dir: str, groups: list[ScoredGroup], warmup: int, steps: int
) -> Measured:
    return measure_cuda(PlainStep(model_dir, case, groups), warmup, steps)


def run_case(
    case: Case, model_dir: str, args: argparse.Namespace, warmup: int, steps: int
) -> list[dict[str, Any]]:
    """ours, then plain, on the same groups; each variant's objects freed before the next."""
    groups = case_groups(case, args.seed)
    start = time.perf_counter()
    ours = summarise(
        case, "ours", measure_ours(case, model_dir, groups, args, warmup, steps), args.peak_flops
    )
    free_cuda()
    plain = summarise(
        case, "plain", measure_plain(case, model_dir, groups, warmup, steps), args.peak_flops
    )
    free_cuda()
    ours["vs_plain_time"] = ours["seconds"] / plain["seconds"]
    print(
        f"[{case.key}] {case.name}: ours {ours['seconds']:.2f} s, plain {plain['seconds']:.2f} s "
        f"({time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    return [ours, plain]


def print_gpu_report(records: list[dict[str, Any]], settings: dict[str, Any]) -> None:
    print(
        f"\nOne learner step on {torch.cuda.get_device_name(0)}, bfloat16 compute; compile "
        f"{settings['compile']}, pack_rows {settings['pack_rows']}; MFU against "
        f"{settings['peak_flops'] / 1e12:.0f} TFLOP/s"
    )
    headers = [
        "case", "step", "s/step", "tokens/s", "MFU", "peak GiB", "host reads", "CUDA syncs",
        "vs plain time",
    ]  # fmt: skip
    rows = [
        [
            r["name"],
            r["variant"],
            f"{r['seconds']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{100 * r['mfu']:.1f}%",
            f"{r['peak_bytes'] / GiB:.1f}",
            "n/a" if r["host_reads"] is None else str(r["host_reads"]),
            str(r["cuda_syncs"]),
            f"{r['vs_plain_time']:.2f}x" if "vs_plain_time" in r else "1.00x (baseline)",
        ]
        for r in records
    ]
    print_table(headers, rows)
    ours = {r["case"]: r for r in records if r["variant"] == "ours"}
    if "a" in ours and "c" in ours:
        rate = ours["c"]["tokens_per_s"] / ours["a"]["tokens_per_s"]
        print(f"long-tailed (c) real-token rate vs fixed-length (a): {rate:.2f}x")
    for r in records:
        if r["host_reads_by_name"]:
            print(f"host reads, {r['case']} {r['variant']}: {r['host_reads_by_name']}")


def main_cuda(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        sys.exit("bench_learner_speed: --device cuda needs a CUDA device")
    warmup, steps = (1, 2) if args.quick else (args.warmup, args.steps)
    cases = gpu_cases(args.seed)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-learner-speed-") as root:
        saved: dict[ModelShape, str] = {}
        for key in args.cases:
            case = cases[key]
            if case.shape not in saved:
                start = time.perf_counter()
                saved[case.shape] = str(Path(root) / f"model-{len(saved)}")
                save_model(RankGroup(), case.shape, saved[case.shape], args.seed)
                print(f"[model] {case.shape.name} saved ({time.perf_counter() - start:.0f} s)",
                      flush=True)  # fmt: skip
            records += run_case(case, saved[case.shape], args, warmup, steps)
    settings = {
        "compile": args.compile,
        "pack_rows": args.pack_rows,
        "peak_flops": args.peak_flops,
        "warmup": warmup,
        "steps": steps,
        "device_name": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cases": {key: asdict(cases[key]) for key in args.cases},
    }
    print_gpu_report(records, settings)
    return {"device": "cuda", "settings": settings, "records": records}


# --- The CPU run: the log-prob path --------------------------------------------------------------


@dataclass(frozen=True)
class HeadSettings:
    positions: int
    hidden: int
    vocab: int
    chunk: int
    vocab_chunk: int
    seed: int


def head_inputs(settings: HeadSettings, positions: int) -> tuple[Tensor, nn.Linear, Tensor]:
    """Hidden states [n, H] (requiring grad), a bias-free head H -> V, targets [n]."""
    generator = torch.Generator().manual_seed(settings.seed)
    hidden = torch.randn(positions, settings.hidden, generator=generator).requires_grad_()
    head = nn.Linear(settings.hidden, settings.vocab, bias=False)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.05, generator=generator)
    targets = torch.randint(0, settings.vocab, (positions,), generator=generator)
    return hidden, head, targets


def new_path(settings: HeadSettings, hidden: Tensor, head: nn.Linear, targets: Tensor) -> Tensor:
    logp, _ = vocab_chunked_logprobs(
        hidden, head.weight, None, targets, 1.0, settings.chunk, settings.vocab_chunk, True
    )
    return logp


def reference_path(
    settings: HeadSettings, hidden: Tensor, head: nn.Linear, targets: Tensor
) -> Tensor:
    """The learner's path before the vocabulary blocks: chunks of positions, each [chunk, V]
    in float32 at once, recomputed in the backward (activation checkpointing)."""
    parts = []
    for start in range(0, int(targets.shape[0]), settings.chunk):
        end = start + settings.chunk
        args = (hidden[start:end], head, targets[start:end], 1.0, True)
        logp, _ = checkpoint(chunk_logprobs, *args, use_reentrant=False)
        parts.append(logp)
    return torch.cat(parts)


PATHS: dict[str, Callable[[HeadSettings, Tensor, nn.Linear, Tensor], Tensor]] = {
    "reference (position chunks)": reference_path,
    "vocab_chunked_logprobs": new_path,
}


def measure_head(group: RankGroup, settings: HeadSettings, path: str) -> dict[str, Any]:
    """One path's forward + backward in this (forked) process, after a short pass: seconds,
    peak RSS above the RSS once the inputs and gradient buffers exist, and result summaries."""
    del group
    mmap_large_allocations()
    run = PATHS[path]
    warm = head_inputs(settings, 8)
    torch.autograd.backward(run(settings, *warm).sum())
    hidden, head, targets = head_inputs(settings, settings.positions)
    head.weight.grad = torch.zeros_like(head.weight)  # gradients accumulate into these
    hidden.grad = torch.zeros_like(hidden)
    base = rss_bytes()
    reset_peak_rss()
    start = time.perf_counter()
    logp = run(settings, hidden, head, targets)
    torch.autograd.backward(logp.sum())
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes() - base
    assert hidden.grad is not None and head.weight.grad is not None
    return {
        "path": path,
        "seconds": seconds,
        "peak_bytes": peak,
        "logp": logp.detach().tolist(),
        "grad_hidden_norm": float(hidden.grad.norm()),
        "grad_weight_norm": float(head.weight.grad.norm()),
    }


def compare_heads(records: list[dict[str, Any]]) -> None:
    """Each record's ratios against the reference (the first) and its largest log-prob gap."""
    reference = records[0]
    for record in records:
        record["vs_reference_time"] = record["seconds"] / reference["seconds"]
        record["vs_reference_peak"] = record["peak_bytes"] / max(reference["peak_bytes"], 1)
        gaps = zip(record["logp"], reference["logp"], strict=True)
        record["max_logp_gap"] = max(abs(a - b) for a, b in gaps)
        for key in ("grad_hidden_norm", "grad_weight_norm"):
            record[f"{key}_relative_gap"] = abs(record[key] / reference[key] - 1)
    for record in records:
        del record["logp"]  # thousands of floats: the gap above is what the report keeps


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


def main_cpu(args: argparse.Namespace) -> dict[str, Any]:
    settings = HeadSettings(
        args.positions, args.hidden, args.vocab, args.chunk, args.vocab_chunk, args.seed
    )
    heads = []
    for path in PATHS:
        start = time.perf_counter()
        [record] = run_forked(measure_head, 1, args.threads, args.timeout_s, settings, path)
        heads.append(record)
        print(f"[log-probs] {path}: {record['seconds']:.2f} s, peak "
              f"{record['peak_bytes'] / MiB:.0f} MiB ({time.perf_counter() - start:.0f} s)",
              flush=True)  # fmt: skip
    compare_heads(heads)
    steps = []
    for micro_batches in (1, 8):
        [record] = run_forked(step_host_reads, 1, 1, args.timeout_s, micro_batches, args.seed)
        steps.append(record)
    print(
        f"\nLog-probs forward + backward, {settings.positions} positions, hidden "
        f"{settings.hidden}, vocabulary {settings.vocab}, float32, {args.threads} thread(s); "
        f"position chunk {settings.chunk}, vocabulary chunk {settings.vocab_chunk}"
    )
    headers = ["path", "s", "vs reference", "peak MiB", "vs reference", "max |logp gap|",
               "grad gap (hidden, head)"]  # fmt: skip
    rows = [
        [
            r["path"],
            f"{r['seconds']:.2f}",
            f"{r['vs_reference_time']:.2f}x",
            f"{r['peak_bytes'] / MiB:.0f}",
            f"{r['vs_reference_peak']:.2f}x",
            f"{r['max_logp_gap']:.1e}",
            f"{r['grad_hidden_norm_relative_gap']:.1e}, {r['grad_weight_norm_relative_gap']:.1e}",
        ]
        for r in heads
    ]
    print_table(headers, rows)
    print("peak: peak RSS above the RSS with the inputs and gradient buffers allocated")
    print("\nHost reads of one train_step (tiny model, 16 rows)")
    print_table(
        ["micro-batches", "host reads", "vs 1 micro-batch", "by name"],
        [
            [str(s["micro_batches"]), str(s["host_reads"]),
             f"{s['host_reads'] / max(steps[0]['host_reads'], 1):.2f}x", str(s["by_name"])]
            for s in steps
        ],
    )  # fmt: skip
    return {"device": "cpu", "settings": asdict(settings), "logprobs": heads, "steps": steps}


# --- Flags ---------------------------------------------------------------------------------------


def parse_cases(text: str) -> list[str]:
    keys = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(keys) - {"a", "b", "c"})
    if not keys or unknown:
        raise argparse.ArgumentTypeError(f"cases are a, b, c (comma-separated), got {text!r}")
    return keys


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per CPU measurement")
    gpu = parser.add_argument_group("--device cuda")
    gpu.add_argument("--cases", type=parse_cases, default=["a", "b", "c"])
    gpu.add_argument("--quick", action="store_true", help="1 warm-up step, 2 timed (gpu_check)")
    gpu.add_argument("--warmup", type=int, default=2)
    gpu.add_argument("--steps", type=int, default=3)
    gpu.add_argument("--compile", action="store_true", help="learner.compile: true")
    gpu.add_argument("--pack-rows", choices=["auto", "true", "false"], default="auto")
    gpu.add_argument("--peak-flops", type=float, default=H100_BF16_DENSE_FLOPS,
                     help="the GPU's dense bfloat16 FLOP/s, for MFU")  # fmt: skip
    cpu = parser.add_argument_group("--device cpu")
    cpu.add_argument("--positions", type=int, default=512)
    cpu.add_argument("--hidden", type=int, default=QWEN25_05B.hidden)
    cpu.add_argument("--vocab", type=int, default=QWEN25_05B.vocab)
    cpu.add_argument("--chunk", type=int, default=256, help="positions per chunk")
    cpu.add_argument("--vocab-chunk", type=int, default=32_768)
    cpu.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)
    if min(args.warmup, args.steps - 1, args.positions - 1) < 0:
        parser.error("--steps and --positions must be >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    result = main_cuda(args) if args.device == "cuda" else main_cpu(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
