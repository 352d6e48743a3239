"""The learner's memory and speed: `single` vs `fsdp2`, chunked vs unchunked log-probs.

A random-initialised Qwen2 model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV
heads, intermediate 4864, vocabulary 151936, tied embeddings; the flags shrink it) is saved once
to a temporary directory with the tiny model's tokenizer. Every measurement then runs in its own
forked process (an `fsdp2` measurement in its own group of forked gloo ranks), whose peak RSS
(VmHWM, reset at its start) is its own; allocations of 128 KiB and more are mmapped there, so
RSS follows the live tensors (`mmap_large_allocations`):

1. one `LearnerCore.train_step` on one synthetic group (random token ids; behaviour log-probs of
   a uniform policy, -log V, near what a random model gives) per response length of `--tokens`,
   after a warm-up step of a few tokens (AdamW's state exists from the first optimiser step on,
   so the peak is that of any later step), under `single` and under `fsdp2` at `--world-size`
   ranks: the bytes of the local parameter shards plus the AdamW state after the optimiser step
   (the per-rank parameter + optimiser memory), peak RSS per rank, and trained tokens/s
   (response tokens over the slowest rank's step time). Each rank gets `--threads` torch threads
   (default 1: a core per rank, as a GPU per rank). A row is never split over ranks: with fewer
   rows than ranks, the idle ranks run filler passes (services/learner/micro_batches.py), so they
   add memory but no throughput;
2. `ResponseLogProbs` forward + backward over one response of `--logprob-tokens` tokens, with
   `logprob_chunk_tokens` = `--chunk` and unchunked (the whole response at once), after a short
   pass and with the gradient buffers allocated: the activation peak (peak RSS minus the RSS
   after the model load) and the logits' own peak (the head's forward and backward, above what
   the decoder holds then: `PhasePeaks`). Chunks of C instead of N positions shrink the logits
   N / C times, but not the head weight's gradient (V x H, in every chunk's backward) nor the
   decoder's activations, so both measured ratios stay below N / C.

Every ratio is against a baseline measured in the same run: `single` at the same response
length, and the unchunked log-probs. `estimate_rank_memory` is the formula behind the sizing
table of docs/pipeline.md (`--sizing` prints that table); the benchmark prints it beside what
it measured.

Left out: GPU memory (the CUDA caching allocator, NCCL buffers, the CUDA context); on CPU the
RSS also holds the interpreter and libraries, given as the RSS before the model load. Linux only
(reads /proc/self/status).

Usage: python benchmarks/bench_learner.py [--tokens 1024,4096] [--rows 2,1] [--json PATH]
       python benchmarks/bench_learner.py --sizing
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import math
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.spawn import start_processes
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen2Config, Qwen3Config
from transformers.utils import logging as hf_logging

# The repository too: run as a script on a machine where the project is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import print_table

from kpo_core.config import AlgorithmConfig
from services.learner.batch import collate
from services.learner.distributed import RankGroup
from services.learner.logprobs import response_logprobs
from services.learner.micro_batches import plan_minibatch
from services.learner.sharding import build_policy, compute_context
from services.learner.step import LearnerCore
from services.messages import Prompt, Response, ScoredGroup, ScoredResponse
from services.spec import LearnerConfig
from services.tasks.tiny_model import DEFAULT_MODEL_DIR

GiB, MiB = 2**30, 2**20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PROMPT_ID = "bench"
WARMUP_TOKENS = 8


# --- Model shapes and the memory formula ---------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The shape of a Qwen2 / Qwen3 causal LM (what the memory formula and the model need)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    head_dim: int | None = None  # None: hidden // heads (Qwen2); Qwen3 sets it
    qwen3: bool = False

    def hf_config(self) -> PretrainedConfig:
        common: dict[str, Any] = {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": self.tied,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
        }
        if self.qwen3:
            return Qwen3Config(head_dim=self.head_dim or self.hidden // self.heads, **common)
        return Qwen2Config(**common)


@dataclass(frozen=True)
class ParamCounts:
    """total (tied tensors once), per decoder layer, and root = total - layers x per layer (the
    embedding, the final norm and an untied head: what FSDP2's root module holds)."""

    total: int
    layer: int
    root: int


@functools.cache
def param_counts(shape: ModelShape) -> ParamCounts:
    """Counted on the meta device: exact, and nothing allocated."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape.hf_config())  # type: ignore[no-untyped-call]
    total = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.get_decoder().layers[0].parameters())
    return ParamCounts(total, layer, total - shape.layers * layer)


QWEN25_05B = ModelShape("Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, tied=True)
SIZING_SHAPES = (
    ModelShape("Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151936, tied=True),
    ModelShape("Qwen3-4B", 2560, 36, 32, 8, 9728, 151936, tied=True, head_dim=128, qwen3=True),
    ModelShape("Qwen3-8B", 4096, 36, 32, 8, 12288, 151936, tied=False, head_dim=128, qwen3=True),
)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank (`estimate_rank_memory`): what holds them, and the peak."""

    states: float
    gathered: float
    saved: float
    working: float
    total: float


# learner.logprob_vocab_chunk's default: the head's logits are float32 blocks of C x this.
VOCAB_CHUNK = 32_768


def logits_bytes(
    shape: ModelShape, positions: int, dtype_bytes: int, vocab_chunk: int = VOCAB_CHUNK
) -> float:
    """5 C Vc 4 + b V H: the head's working memory for a block of C positions x Vc
    vocabulary entries (below)."""
    block = positions * min(vocab_chunk, shape.vocab)
    return 5 * block * 4 + dtype_bytes * shape.vocab * shape.hidden


def estimate_rank_memory(
    shape: ModelShape,
    world_size: int,
    tokens: int,
    chunk: int,
    dtype_bytes: int,
    checkpointing: bool,
    accumulating: bool = True,
) -> MemoryEstimate:
    """Peak memory of one learner rank. P parameters (P_root: embedding, final norm, untied
    head; P_layer: one decoder layer; `param_counts`), W ranks, N padded tokens per micro-batch,
    H hidden, I intermediate, L layers, V vocabulary, b bytes of the compute dtype,
    C = min(logprob_chunk_tokens, N), Vc = min(logprob_vocab_chunk, V):

        states   = 16 P / W      float32 weights, gradients, AdamW m and v, each 1/W per rank
        gathered = b (P_root + 2 P_layer) + 4 P_root                         (W > 1)
                   the root stays gathered from the forward through the backward (FSDP2 does
                   not reshard the root), a layer and the prefetched next one are gathered, and
                   the root's gradient is whole, in float32, until its reduce-scatter;
                   W = 1: b P when b < 4 (autocast's cast copies of the weights), else 0
        layer    = N (12 H + 4 I) b       one decoder layer's activations (norms, q/k/v,
                   attention output, residuals: ~12 H; gate, up, their product: 4 I)
        saved    = L N H b                kept through the backward with gradient
                   checkpointing (each layer's input); L x layer without
        logits   = 5 C Vc 4 + b V H       one float32 block of logits, recomputed in the
                   backward, with its exponentials, their products (forward) or the softmax,
                   its gradient and the gradient's cast (backward): about 5 copies; and the
                   head weight's gradient
        working  = max(logits, layer)     the largest transient (logits alone without
                   checkpointing)
        total    = gathered + saved + max(states + logits, states + layer)

    `accumulating` (the default, and every micro-batch of a minibatch but the first): the
    gradients of earlier micro-batches are live while the head runs. False: a minibatch of one
    micro-batch per rank (as in this benchmark's steps), whose weight gradients (4 P / W) only
    appear as its backward goes, after the head's peak: the head's phase then holds 12 P / W.

    Attention is assumed memory-efficient (SDPA / flash: no N^2 term). An estimate, not a bound:
    `main` prints it beside what the benchmark measured.
    """
    counts = param_counts(shape)
    states = 16 * counts.total / world_size
    if world_size > 1:
        gathered = dtype_bytes * (counts.root + 2 * counts.layer) + 4 * counts.root
    else:
        gathered = dtype_bytes * counts.total if dtype_bytes < 4 else 0
    layer = tokens * (12 * shape.hidden + 4 * shape.intermediate) * dtype_bytes
    saved = shape.layers * (tokens * shape.hidden * dtype_bytes if checkpointing else layer)
    logits = logits_bytes(shape, min(chunk, tokens), dtype_bytes)
    head_phase = states - (0 if accumulating else 4 * counts.total / world_size) + logits
    decoder_phase = states + (layer if checkpointing else 0)
    working = max(logits, layer) if checkpointing else logits
    total = gathered + saved + max(head_phase, decoder_phase)
    return MemoryEstimate(states, gathered, saved, working, total)


def sizing_table(chunk: int = 1024, world_size: int = 8) -> str:
    """docs/pipeline.md's sizing table (markdown): `estimate_rank_memory` in GiB per rank for
    bfloat16 compute with gradient checkpointing, fsdp2 on `world_size` GPUs and single on 1."""
    lines = [
        f"| model | parameters | tokens per micro-batch | fsdp2 x{world_size}: states | gathered "
        f"| saved | working | **total per rank** | single (1 GPU) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for shape in SIZING_SHAPES:
        for tokens in (4096, 8192):
            sharded = estimate_rank_memory(shape, world_size, tokens, chunk, 2, True)
            alone = estimate_rank_memory(shape, 1, tokens, chunk, 2, True)
            parts = (sharded.states, sharded.gathered, sharded.saved, sharded.working)
            cells = " | ".join(f"{part / GiB:.1f}" for part in parts)
            lines.append(
                f"| {shape.name} | {param_counts(shape).total / 1e9:.2f}B | {tokens:,} | {cells} "
                f"| **{sharded.total / GiB:.1f}** | {alone.total / GiB:.1f} |"
            )
    return "\n".join(lines)


# --- Memory of this process ------------------------------------------------------------------


def _status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    status = Path("/proc/self/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB$", status, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"no {field} in /proc/self/status: this benchmark needs Linux")
    return int(found.group(1)) * 1024


def rss_bytes() -> int:
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    return _status_bytes("VmHWM")


def reset_peak_rss() -> None:
    """Start VmHWM afresh from the current RSS (Linux >= 4.0: `5` to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def mmap_large_allocations(threshold: int = 128 * 1024) -> None:
    """Serve allocations of `threshold` bytes and more by mmap, returned to the system when
    freed, so RSS follows the live tensors. glibc otherwise raises that threshold up to 32 MiB
    as large blocks are freed, and freed heap blocks below it stay in RSS: at small sizes the
    peaks were then noise. Setting it explicitly turns the dynamic threshold off (no-op off
    glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(M_MMAP_THRESHOLD, threshold)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of `tensor` (its local shard for a DTensor)."""
    to_local = getattr(tensor, "to_local", None)
    local: torch.Tensor = to_local() if to_local is not None else tensor
    return local.numel() * local.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimiser state (tied tensors once)."""
    params = list(model.parameters())
    optimizer_state = [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    return {
        "param_bytes": sum(local_bytes(p) for p in params),
        "grad_bytes": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": sum(local_bytes(v) for v in optimizer_state),
    }


# --- Forked ranks ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    out: str,
    threads: int,
    timeout_s: float,
    fn: Callable[..., dict[str, Any]],
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(threads)  # first: a forked child must not use the parent's pool
    mmap_large_allocations()
    reset_peak_rss()
    group = RankGroup(rank, world_size)
    group.join(f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s)
    try:
        result = fn(group, *args)
        (Path(out) / f"rank-{rank}.json").write_text(json.dumps(result))
    finally:
        group.leave()


def run_forked(
    fn: Callable[..., dict[str, Any]],
    world_size: int,
    threads: int,
    timeout_s: float,
    *args: Any,
) -> list[dict[str, Any]]:
    """`fn(group, *args)` in `world_size` fresh forked processes (a gloo group when more than
    one); their JSON results in rank order. Raises with a failing rank's traceback, and kills
    them all after `timeout_s`.

    Forked, not spawned: a spawned process imports torch and transformers afresh (10 to 30 s on
    a busy machine). The parent runs no torch kernel before forking, so no thread pool is copied.
    """
    with tempfile.TemporaryDirectory() as out:
        ranks = start_processes(  # type: ignore[no-untyped-call]
            _rank_main,
            args=(world_size, free_port(), out, threads, timeout_s, fn, args),
            nprocs=world_size,
            join=False,
            start_method="fork",
        )
        deadline = time.monotonic() + timeout_s
        while not ranks.join(timeout=1):  # raises if a rank failed
            if time.monotonic() > deadline:
                for process in ranks.processes:
                    process.kill()
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout_s} s")
        return [json.loads((Path(out) / f"rank-{r}.json").read_text()) for r in range(world_size)]


# --- What each process does ------------------------------------------------------------------


def save_model(group: RankGroup, shape: ModelShape, out_dir: str, seed: int) -> dict[str, Any]:
    """A random-initialised model of `shape` and the tiny model's tokenizer, saved to `out_dir`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(shape.hf_config(), dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, Path(out_dir) / name)
    return {"params": sum(p.numel() for p in model.parameters())}


def synthetic_groups(
    rows: int, tokens: int, prompt_tokens: int, vocab: int, seed: int
) -> list[ScoredGroup]:
    """One group of `rows` responses of `tokens` random token ids each, rewards 1, 0, 1, ...,
    behaviour log-probs -log V (+ small noise): a uniform policy, close to a random model's."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
    uniform = -math.log(vocab)
    responses = []
    for row in range(rows):
        ids = [rng.randrange(3, vocab) for _ in range(tokens)]
        logprobs = [uniform + rng.gauss(0.0, 0.05) for _ in range(tokens)]
        response = Response(PROMPT_ID, prompt, ids, logprobs, "length", 0, "")
        responses.append(ScoredResponse(response, float(row % 2 == 0), verified=True))
    return [ScoredGroup(Prompt(PROMPT_ID, "", ""), responses)]


@dataclass(frozen=True)
class Settings:
    """What every measurement shares (from the flags)."""

    model_dir: str
    vocab: int
    prompt_tokens: int
    micro_batch_tokens: int
    chunk: int
    checkpointing: bool
    compute_dtype: str
    seed: int

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.compute_dtype == "bfloat16" else 4

    def learner(self, **overrides: Any) -> LearnerConfig:
        return LearnerConfig(
            **{
                "lr": 1e-6,
                "micro_batch_tokens": self.micro_batch_tokens,
                "logprob_chunk_tokens": self.chunk,
                "gradient_checkpointing": self.checkpointing,
                "compute_dtype": self.compute_dtype,
                **overrides,
            }
        )


def measure_step(group: RankGroup, settings: Settings, tokens: int, rows: int) -> dict[str, Any]:
    """One learner step on this rank after a short warm-up step: the state bytes after it,
    the process's peak RSS, and the step's seconds."""
    before_load = rss_bytes()
    strategy = "fsdp2" if group.distributed else "single"
    learner = settings.learner(strategy=strategy, world_size=group.world_size)
    core = LearnerCore(
        settings.model_dir, learner, AlgorithmConfig(), 1.0, group=group, response_length=tokens
    )
    after_load = rss_bytes()
    # A short step first: AdamW allocates its state in the first optimiser step, after that
    # step's activations are freed, so only from the second step on is the peak that of every
    # step (weights, gradients, AdamW state and activations at once); nor is first-call set-up
    # timed.
    core.train_step(synthetic_groups(2, WARMUP_TOKENS, 1, settings.vocab, settings.seed))
    groups = synthetic_groups(rows, tokens, settings.prompt_tokens, settings.vocab, settings.seed)
    group.barrier()
    start = time.perf_counter()
    metrics = core.train_step(groups)
    seconds = time.perf_counter() - start
    return {
        "rank": group.rank,
        "rss_before_load_bytes": before_load,
        "rss_after_load_bytes": after_load,
        "peak_rss_bytes": peak_rss_bytes(),
        "seconds": seconds,
        # The step's record is rank 0's (the other ranks return an empty one).
        **{
            key: metrics[key] for key in ("tokens_trained", "skipped_minibatches") if key in metrics
        },
        **state_bytes(core.model, core.optimizer),
    }


class PhasePeaks:
    """Peak RSS of each phase of one `ResponseLogProbs` forward + backward, split where the
    decoder's output appears (forward) and where its gradient arrives (backward):

    decoder: the decoder's forward; head: the chunked head's forward and backward, above the
    RSS the decoder's forward left (the logits' own peak); decoder_backward: the rest.
    """

    def __init__(self, decoder: nn.Module) -> None:
        self.peaks: dict[str, int] = {}
        self.starts: dict[str, int] = {}
        self._handle = decoder.register_forward_hook(self._decoder_done)

    def _mark(self, phase: str, next_phase: str) -> None:
        self.peaks[phase] = peak_rss_bytes()
        self.starts[next_phase] = rss_bytes()
        reset_peak_rss()

    def _decoder_done(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self._mark("decoder", "head")
        output.last_hidden_state.register_hook(lambda _: self._mark("head", "decoder_backward"))

    def finish(self) -> None:
        self.peaks["decoder_backward"] = peak_rss_bytes()
        self._handle.remove()


def measure_logprobs(
    group: RankGroup, settings: Settings, tokens: int, chunk: int
) -> dict[str, Any]:
    """`ResponseLogProbs` forward + backward over one response of `tokens` tokens, with the
    gradient buffers allocated and a short warm-up pass run before it: the activation peak
    (peak RSS minus the RSS after the model load), and the logits' own peak (`PhasePeaks`)."""
    learner = settings.learner(logprob_chunk_tokens=chunk)
    device = torch.device("cpu")
    model = build_policy(settings.model_dir, learner, group, device)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)  # gradients accumulate into these, in place

    def forward_backward(tokens: int) -> None:
        groups = synthetic_groups(1, tokens, settings.prompt_tokens, settings.vocab, settings.seed)
        batch = collate(groups, 0, 0)
        with compute_context(learner, device):
            logp, _ = response_logprobs(model, batch, 1.0, False)
        torch.autograd.backward(logp[batch.response_mask].sum())

    # A short pass first: the libraries' code and one-off buffers are then resident already.
    forward_backward(WARMUP_TOKENS)
    after_load = rss_bytes()
    phases = PhasePeaks(model.policy.get_decoder())  # type: ignore[operator]
    reset_peak_rss()
    start = time.perf_counter()
    forward_backward(tokens)
    seconds = time.perf_counter() - start
    phases.finish()
    peak = max(phases.peaks.values())
    return {
        "rss_after_load_bytes": after_load,
        "peak_rss_bytes": peak,
        "activation_peak_bytes": peak - after_load,
        "logits_peak_bytes": phases.peaks["head"] - phases.starts["head"],
        "phase_peak_bytes": {name: value - after_load for name, value in phases.peaks.items()},
        "seconds": seconds,
    }


# --- The run -----------------------------------------------------------------------------------


def rank_plan(settings: Settings, tokens: int, rows: int, world_size: int) -> tuple[int, int]:
    """(padded tokens of the largest micro-batch any rank runs, passes per rank) of a step."""
    prompts, responses = [settings.prompt_tokens] * rows, [tokens] * rows
    plan = plan_minibatch(prompts, responses, world_size, settings.micro_batch_tokens)
    largest = max(len(micro.rows) for rank in plan for micro in rank)
    return largest * (settings.prompt_tokens + tokens), len(plan[0])


def summarise_step(
    shape: ModelShape,
    settings: Settings,
    strategy: str,
    tokens: int,
    rows: int,
    ranks: list[dict[str, Any]],
) -> dict[str, Any]:
    """One step's record: the per-rank maxima, throughput and the formula's estimate."""
    world_size = len(ranks)
    batch_tokens, passes = rank_plan(settings, tokens, rows, world_size)
    estimate = estimate_rank_memory(
        shape,
        world_size,
        batch_tokens,
        settings.chunk,
        settings.dtype_bytes,
        settings.checkpointing,
        accumulating=passes > 1,
    )
    seconds = max(r["seconds"] for r in ranks)
    return {
        "strategy": strategy,
        "world_size": world_size,
        "tokens": tokens,
        "rows": rows,
        "micro_batch_tokens": batch_tokens,
        "micro_batches": passes,
        "param_optim_bytes": max(r["param_bytes"] + r["optimizer_bytes"] for r in ranks),
        "grad_bytes": max(r["grad_bytes"] for r in ranks),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "training_rss_bytes": max(r["peak_rss_bytes"] - r["rss_before_load_bytes"] for r in ranks),
        "seconds": seconds,
        "tokens_trained": ranks[0]["tokens_trained"],
        "tokens_per_s": ranks[0]["tokens_trained"] / seconds,
        "estimate_bytes": estimate.total,
        "estimate": asdict(estimate),
        "ranks": ranks,
    }


def ratio(value: float, baseline: float) -> float:
    return value / baseline if baseline > 0 else math.nan


def add_ratios(steps: list[dict[str, Any]], logprobs: list[dict[str, Any]]) -> dict[str, float]:
    """Ratios of each record against its baseline in the same run (in place); the headline ones."""
    singles = {s["tokens"]: s for s in steps if s["strategy"] == "single"}
    for step in steps:
        base = singles[step["tokens"]]
        step["vs_single"] = {
            key: ratio(step[key], base[key])
            for key in ("param_optim_bytes", "peak_rss_bytes", "tokens_per_s")
        }
    unchunked, chunked = logprobs[-1], logprobs[0]
    for record in logprobs:
        for key in ("activation_peak_bytes", "logits_peak_bytes"):
            record.setdefault("vs_unchunked", {})[key] = ratio(record[key], unchunked[key])
    sharded = [s for s in steps if s["strategy"] == "fsdp2"]
    return {
        "fsdp2_param_optim_vs_single": max(s["vs_single"]["param_optim_bytes"] for s in sharded),
        **{
            f"unchunked_vs_chunked_{key.removesuffix('_bytes')}": ratio(
                unchunked[key], chunked[key]
            )
            for key in ("activation_peak_bytes", "logits_peak_bytes")
        },
    }


def print_steps(result: dict[str, Any]) -> None:
    settings = result["settings"]
    print(
        f"\n{result['model']['name']}: {result['model']['params'] / 1e6:.1f}M parameters, "
        f"compute {settings['compute_dtype']}, gradient checkpointing {settings['checkpointing']}, "
        f"{settings['threads']} thread(s) per rank; one learner step"
    )
    headers = [
        "strategy", "tokens x rows", "param+optim MiB/rank", "vs single", "peak RSS MiB/rank",
        "vs single", "tokens/s", "vs single", "training MiB", "estimate MiB",
    ]  # fmt: skip
    rows = [
        [
            f"{s['strategy']} x{s['world_size']}",
            f"{s['tokens']} x {s['rows']}",
            f"{s['param_optim_bytes'] / MiB:.0f}",
            f"{s['vs_single']['param_optim_bytes']:.2f}x",
            f"{s['peak_rss_bytes'] / MiB:.0f}",
            f"{s['vs_single']['peak_rss_bytes']:.2f}x",
            f"{s['tokens_per_s']:.1f}",
            f"{s['vs_single']['tokens_per_s']:.2f}x",
            f"{s['training_rss_bytes'] / MiB:.0f}",
            f"{s['estimate_bytes'] / MiB:.0f}",
        ]
        for s in result["steps"]
    ]
    print_table(headers, rows)
    print(
        "training MiB: peak RSS minus the RSS before the model load (max over ranks); "
        "estimate: estimate_rank_memory"
    )


def print_logprobs(result: dict[str, Any]) -> None:
    tokens = result["settings"]["logprob_tokens"]
    print(f"\nResponseLogProbs forward+backward, one response of {tokens} tokens")
    headers = [
        "logprob_chunk_tokens", "activation peak MiB", "vs unchunked", "logits peak MiB",
        "vs unchunked", "logits estimate MiB", "s",
    ]  # fmt: skip
    rows = [
        [
            f"{r['chunk']}" + (" (unchunked)" if r["chunk"] >= tokens else ""),
            f"{r['activation_peak_bytes'] / MiB:.0f}",
            f"{r['vs_unchunked']['activation_peak_bytes']:.2f}x",
            f"{r['logits_peak_bytes'] / MiB:.0f}",
            f"{r['vs_unchunked']['logits_peak_bytes']:.2f}x",
            f"{r['logits_estimate_bytes'] / MiB:.0f}",
            f"{r['seconds']:.1f}",
        ]
        for r in result["logprobs"]
    ]
    print_table(headers, rows)
    print(
        "activation peak: peak RSS minus the RSS after the model load; logits peak: that of "
        "the head's forward and backward above what the decoder holds"
    )


def print_report(result: dict[str, Any]) -> None:
    print_steps(result)
    print_logprobs(result)
    ratios = result["ratios"]
    print(
        f"\nfsdp2 per-rank param+optimiser memory vs single: "
        f"{ratios['fsdp2_param_optim_vs_single']:.3f}x\n"
        f"unchunked vs chunked log-probs: activation peak "
        f"{ratios['unchunked_vs_chunked_activation_peak']:.2f}x, logits peak "
        f"{ratios['unchunked_vs_chunked_logits_peak']:.2f}x"
    )


def parse_ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    base = QWEN25_05B
    model = parser.add_argument_group("model (default: Qwen2.5-0.5B's shape)")
    model.add_argument("--layers", type=int, default=base.layers)
    model.add_argument("--hidden", type=int, default=base.hidden)
    model.add_argument("--heads", type=int, default=base.heads)
    model.add_argument("--kv-heads", type=int, default=base.kv_heads)
    model.add_argument("--intermediate", type=int, default=base.intermediate)
    model.add_argument("--vocab", type=int, default=base.vocab)
    parser.add_argument("--tokens", type=parse_ints, default=[1024, 4096], help="response lengths")
    parser.add_argument("--rows", type=parse_ints, default=[2, 1], help="responses per length")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--world-size", type=int, default=2, help="fsdp2 ranks")
    parser.add_argument(
        "--micro-batch-tokens", type=int, default=0,
        help="learner.micro_batch_tokens; 0: the longest row (prompt + response)",
    )  # fmt: skip
    parser.add_argument("--chunk", type=int, default=1024, help="learner.logprob_chunk_tokens")
    parser.add_argument("--logprob-tokens", type=int, default=4096)
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--logprob-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument(
        "--sizing", action="store_true", help="print the sizing table, measure nothing"
    )
    args = parser.parse_args(argv)
    if len(args.rows) == 1:
        args.rows = args.rows * len(args.tokens)
    if len(args.rows) != len(args.tokens):
        parser.error(f"--rows needs one count per --tokens length ({len(args.tokens)})")
    if args.world_size < 2:
        parser.error("--world-size must be at least 2 (fsdp2 against single)")
    return args


def measure_all(args: argparse.Namespace, shape: ModelShape, model_dir: str) -> dict[str, Any]:
    """Every measurement, one fresh process (group) each, printing a line as each finishes."""
    budget = args.micro_batch_tokens or args.prompt_tokens + max(args.tokens)
    settings = Settings(
        model_dir, shape.vocab, args.prompt_tokens, budget, args.chunk,
        not args.no_checkpointing, args.compute_dtype, args.seed,
    )  # fmt: skip
    total = 2 * len(args.tokens) + 2
    done = 0
    partial = None if args.json is None else args.json.with_suffix(".partial.jsonl")
    if partial is not None:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text("")

    def progress(line: str, start: float, record: dict[str, Any]) -> None:
        """One line per measurement; with --json, its record too, so a cut run keeps them."""
        nonlocal done
        done += 1
        print(f"[{done}/{total}] {line} ({time.perf_counter() - start:.0f} s)", flush=True)
        if partial is not None:
            with partial.open("a") as out:
                out.write(json.dumps(record) + "\n")

    steps = []
    for tokens, rows in zip(args.tokens, args.rows, strict=True):
        for strategy, world in (("single", 1), ("fsdp2", args.world_size)):
            start = time.perf_counter()
            ranks = run_forked(
                measure_step, world, args.threads, args.timeout_s, settings, tokens, rows
            )
            step = summarise_step(shape, settings, strategy, tokens, rows, ranks)
            steps.append(step)
            progress(
                f"{strategy} x{world}, {tokens} tokens x {rows}: {step['tokens_per_s']:.1f} "
                f"tokens/s, param+optim {step['param_optim_bytes'] / MiB:.0f} MiB/rank, peak RSS "
                f"{step['peak_rss_bytes'] / MiB:.0f} MiB/rank",
                start,
                step,
            )
    logprobs = []
    for chunk in (args.chunk, max(args.chunk, args.logprob_tokens)):
        start = time.perf_counter()
        [record] = run_forked(
            measure_logprobs, 1, args.logprob_threads, args.timeout_s, settings,
            args.logprob_tokens, chunk,
        )  # fmt: skip
        positions = min(chunk, args.logprob_tokens)
        estimate = logits_bytes(shape, positions, settings.dtype_bytes)
        logprobs.append(
            {
                "chunk": chunk,
                "tokens": args.logprob_tokens,
                "logits_estimate_bytes": estimate,
                **record,
            }
        )
        peak, logits = record["activation_peak_bytes"] / MiB, record["logits_peak_bytes"] / MiB
        progress(
            f"log-probs, chunk {chunk}: activation peak {peak:.0f} MiB, logits {logits:.0f} MiB",
            start,
            logprobs[-1],
        )
    return {"steps": steps, "logprobs": logprobs}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # one line a measurement
    if args.sizing:
        print(sizing_table(args.chunk))
        return {}
    shape = ModelShape(
        QWEN25_05B.name, args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate,
        args.vocab, tied=True,
    )  # fmt: skip
    if shape != QWEN25_05B:
        shape = replace(shape, name=f"Qwen2 {args.layers}L/{args.hidden}H/V{args.vocab}")
    with tempfile.TemporaryDirectory(prefix="bench-learner-") as model_dir:
        start = time.perf_counter()
        [saved] = run_forked(
            save_model, 1, args.logprob_threads, args.timeout_s, shape, model_dir, args.seed
        )
        print(f"[model] {shape.name}, {saved['params'] / 1e6:.1f}M parameters saved "
              f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
        measured = measure_all(args, shape, model_dir)
    ratios = add_ratios(measured["steps"], measured["logprobs"])
    settings = {key: value for key, value in vars(args).items() if key not in ("json", "sizing")}
    settings["checkpointing"] = not args.no_checkpointing
    result = {
        "model": {**asdict(shape), "params": saved["params"]},
        "settings": settings,
        **measured,
        "ratios": ratios,
    }
    print_report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        args.json.with_suffix(".partial.jsonl").unlink()
    return result


if __name__ == "__main__":
    main()
