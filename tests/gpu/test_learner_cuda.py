"""The learner on a CUDA device: NCCL, bfloat16 compute over float32 masters, the log-prob path's
memory, packed rows through the variable-length attention kernel, compiled decoder layers.

These run only where a GPU exists (the CPU suite covers the same code with gloo and float32, and
packed rows through the per-row reference attention); elsewhere they are skipped, and say so.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

from services.learner.batch import TrainingBatch, collate
from services.learner.distributed import RankGroup
from services.learner.packed_attention import varlen_takes_window
from services.learner.sharding import build_policy, compute_context
from services.learner.toolchain import compile_problem
from services.messages import Prompt, Response, ScoredGroup, ScoredResponse
from services.spec import LearnerConfig
from tests.services.learner.conftest import make_core
from tests.services.learner.ranks import run_ranks
from tests.services.model_families import save_family_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
FLOAT32_BYTES = 4
# The float32 [positions, vocabulary] blocks the vocabulary-chunked path may hold at once, forward
# or backward (the logits, their exponentials, the gradient of the logits and the temporaries of
# the elementwise steps between them): the memory bound below allows this many, with margin.
BLOCK_COPIES = 8


def cuda_bfloat16_step(group: RankGroup, model_dir: Path, groups: list[ScoredGroup]) -> dict:
    core = make_core(model_dir, group=group, device="cuda", compute_dtype="bfloat16")
    metrics = core.train_step(groups)
    return {
        "metrics": metrics,
        "masters": {p.dtype for p in core.model.parameters()},
        "device": {p.device.type for p in core.model.parameters()},
        "published": {t.dtype for t in core.state_dict_for_publish().values()},
    }


def test_an_fsdp2_rank_trains_on_cuda_with_nccl_in_bfloat16(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    result = run_ranks(cuda_bfloat16_step, 1, tiny_model_dir, groups, device="cuda")[0]
    assert result["masters"] == {torch.float32} and result["device"] == {"cuda"}
    assert result["published"] == {torch.bfloat16}
    assert result["metrics"]["grad_norm"] > 0


# --- Models and batches ------------------------------------------------------------------------


def save_model(directory: Path, config: Qwen2Config, seed: int = 0) -> Path:
    """A random-initialised Qwen2 of `config`, saved where `build_policy` loads it from."""
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def small_config(vocab: int, max_positions: int = 8192) -> Qwen2Config:
    """2 layers, hidden 256, 4 query heads over 2 KV heads (head_dim 64: every attention kernel
    takes it); initializer_range 0.2 so next-token distributions are far from uniform."""
    return Qwen2Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        initializer_range=0.2,
    )


def random_batch(rows: int, prompt: int, response: int, vocab: int) -> TrainingBatch:
    """`rows` rows of `prompt` + `response` random tokens, none padded, on CUDA."""
    total = prompt + response
    ids = torch.randint(0, vocab, (rows, total), device="cuda")
    ones = torch.ones((rows, total), dtype=torch.long, device="cuda")
    return TrainingBatch(
        input_ids=ids,
        attention_mask=ones,
        position_ids=torch.arange(total, device="cuda").expand(rows, total),
        response_ids=ids[:, prompt:],
        response_mask=ones[:, prompt:].bool(),
        behaviour_logp=torch.zeros((rows, response), device="cuda"),
        rewards=torch.zeros(rows, device="cuda"),
        group_ids=torch.zeros(rows, dtype=torch.long, device="cuda"),
        correct=torch.zeros(rows, dtype=torch.bool, device="cuda"),
        versions=torch.zeros(rows, dtype=torch.long, device="cuda"),
        token_versions=torch.zeros((rows, response), dtype=torch.long, device="cuda"),
        staleness=torch.zeros(rows, dtype=torch.long, device="cuda"),
        truncated=torch.zeros(rows, dtype=torch.bool, device="cuda"),
        prompt_lengths=(prompt,) * rows,
        response_lengths=(response,) * rows,
    )


def varied_batch(lengths: Sequence[tuple[int, int]], vocab: int, seed: int = 0) -> TrainingBatch:
    """One row per (prompt, response) length, random tokens, collated (left-padded prompts,
    right-padded responses) as the learner collates them, on CUDA."""
    rng = random.Random(seed)
    responses = []
    for prompt, response in lengths:
        ids = [rng.randrange(vocab) for _ in range(response)]
        behaviour = [-math.log(vocab)] * response
        sampled = Response("p", [rng.randrange(vocab) for _ in range(prompt)], ids, behaviour,
                           "length", 0, "")  # fmt: skip
        responses.append(ScoredResponse(sampled, float(len(responses) % 2), verified=True))
    return collate([ScoredGroup(Prompt("p", "", ""), responses)], 0, 0).to(CUDA)


def learner_config(**overrides: object) -> LearnerConfig:
    """A `single` learner on CUDA with bfloat16 compute unless `overrides` say otherwise."""
    return LearnerConfig(**{"device": "cuda", "compute_dtype": "bfloat16", **overrides})


def forward_backward(
    model_dir: Path, learner: LearnerConfig, batch: TrainingBatch
) -> tuple[Tensor, dict[str, Tensor]]:
    """The learner's model on `model_dir` (`build_policy`, the entry point `LearnerCore` uses):
    its response log-probs [B, T] (0 off the mask) and every parameter's gradient of a loss that
    weighs each token differently (so that a token scored against the wrong row shows)."""
    model = build_policy(str(model_dir), learner, RankGroup(), CUDA)
    with compute_context(learner, CUDA):
        logp, _ = model(batch, 1.0, True)
    weights = torch.linspace(0.5, 1.5, logp.numel(), device=CUDA).reshape(logp.shape)
    (logp * weights)[batch.response_mask].sum().backward()
    grads = {
        name: param.grad.detach()
        for name, param in model.named_parameters()
        if param.grad is not None
    }
    return logp.detach(), grads


def relative_error(got: Tensor, want: Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


# --- The log-prob path's memory ------------------------------------------------------------------


def peak_bytes(model_dir: Path, batch: TrainingBatch, chunk: int, vocab_chunk: int) -> int:
    """Peak CUDA memory of one forward + backward of the log-probs over `batch`, above what the
    model holds before it (weights; the gradients it allocates count)."""
    learner = learner_config(logprob_chunk_tokens=chunk, logprob_vocab_chunk=vocab_chunk)
    model = build_policy(str(model_dir), learner, RankGroup(), CUDA)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with compute_context(learner, CUDA):
        logp, _ = model(batch, 1.0, True)
    logp[batch.response_mask].sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    del model, logp
    torch.cuda.empty_cache()
    return peak


def test_the_log_prob_path_holds_blocks_of_logits_not_the_whole_matrix(tmp_path: Path) -> None:
    """Three runs differ only in the log-prob settings, so the decoder's activations and the
    gradients cancel in their differences, which are then the logits' own memory:

    - unchunked (all N positions x all V words at once) holds at least one float32 [N, V];
    - chunked (C positions x Vc words) at most BLOCK_COPIES float32 [C, Vc] blocks more than
      with tiny blocks (which hold next to nothing).

    N = 4,096, V = 151,936: [N, V] is 2.32 GiB; C = 1,024, Vc = 32,768: a block is 128 MiB.
    """
    config = small_config(vocab=151_936)
    model_dir = save_model(tmp_path / "model", config)
    positions, vocab = 4096, config.vocab_size
    torch.manual_seed(0)
    batch = random_batch(1, 64, positions, vocab)
    chunk, vocab_chunk = 1024, 32_768
    unchunked = peak_bytes(model_dir, batch, positions, vocab)
    chunked = peak_bytes(model_dir, batch, chunk, vocab_chunk)
    tiny = peak_bytes(model_dir, batch, 128, 2048)
    gib = 2**30
    print(
        f"peak over the model: unchunked {unchunked / gib:.2f} GiB, chunked {chunked / gib:.2f} "
        f"GiB, tiny blocks {tiny / gib:.2f} GiB ({unchunked / chunked:.1f}x unchunked/chunked)"
    )
    whole = positions * vocab * FLOAT32_BYTES
    block = chunk * vocab_chunk * FLOAT32_BYTES
    # The measurement sees the logits at all: otherwise the bound below would prove nothing.
    assert unchunked - tiny >= whole, "the unchunked path should hold a float32 [N, V]"
    assert chunked - tiny <= BLOCK_COPIES * block, (
        f"chunked logits took {(chunked - tiny) / gib:.2f} GiB, above {BLOCK_COPIES} float32 "
        f"[{chunk}, {vocab_chunk}] blocks ({BLOCK_COPIES * block / gib:.2f} GiB)"
    )


# --- Packed rows ---------------------------------------------------------------------------------

# Rows of very different lengths (prompt, response): a token attending across a row boundary,
# or scored against another row's position, changes the result far beyond bfloat16's noise.
ROW_LENGTHS = [(5, 300), (40, 7), (1, 1), (17, 120), (60, 33), (3, 250)]
# bfloat16's noise is measured, not assumed: both paths are compared with the padded path in
# float32, and the packed path may be off by this multiple of the padded bfloat16 path's own
# error. Both round the same projections and MLPs in bfloat16 and differ only in the attention
# kernel (variable-length flash vs masked SDPA) and its summation order, so their errors are of
# one size; a wrong mask or row boundary costs whole nats, far beyond twice the noise (on CPU,
# this check with bfloat16 autocast measured 0.74 nats padded, 0.70 packed on the small Qwen2;
# with packed rows made to attend across rows, 15 nats).
BF16_ERROR_MULTIPLE = 2.0
# Plus one bfloat16 rounding of a unit-scale value (2**-8 ~ 3.9e-3, rounded up): below that, a
# difference between the two errors is a rounding landing either way, not a defect, and a
# padded error that happens to come out small would otherwise hold the packed one to its luck.
BF16_ERROR_FLOOR = 5e-3


@dataclass(frozen=True)
class PathError:
    """How far one path's results are from the float32 reference: the largest log-prob
    difference and the worst relative gradient error (and whose it is)."""

    logp: float
    grad: float
    worst: str

    def __str__(self) -> str:
        return f"log-prob {self.logp:.3e}, gradient {self.grad:.3e} ({self.worst})"


def path_error(
    got: tuple[Tensor, dict[str, Tensor]], reference: tuple[Tensor, dict[str, Tensor]], mask: Tensor
) -> PathError:
    (logp, grads), (reference_logp, reference_grads) = got, reference
    assert torch.isfinite(logp[mask]).all()
    assert (logp[~mask] == 0).all()
    assert grads.keys() == reference_grads.keys()
    errors = {name: relative_error(grads[name], want) for name, want in reference_grads.items()}
    worst = max(errors, key=errors.__getitem__)
    return PathError(float((logp - reference_logp)[mask].abs().max()), errors[worst], worst)


def check_packed_within_bfloat16_noise(label: str, model_dir: Path, batch: TrainingBatch) -> None:
    """The packed bfloat16 path is within `BF16_ERROR_MULTIPLE` of the padded bfloat16 path's
    error (plus `BF16_ERROR_FLOOR`), both against the padded path in float32."""
    reference = forward_backward(
        model_dir, learner_config(compute_dtype="float32", pack_rows=False), batch
    )
    mask = batch.response_mask
    padded = path_error(
        forward_backward(model_dir, learner_config(pack_rows=False), batch), reference, mask
    )
    packed = path_error(
        forward_backward(model_dir, learner_config(pack_rows=True), batch), reference, mask
    )
    print(f"{label} against float32: padded bfloat16 {padded}; packed bfloat16 {packed}")
    logp_bound = BF16_ERROR_MULTIPLE * padded.logp + BF16_ERROR_FLOOR
    grad_bound = BF16_ERROR_MULTIPLE * padded.grad + BF16_ERROR_FLOOR
    assert packed.logp <= logp_bound, (
        f"packed log-probs off by {packed.logp:.3e} > {logp_bound:.3e}"
    )
    assert packed.grad <= grad_bound, f"packed gradients {packed} beyond {grad_bound:.3e}"


def test_packed_rows_give_the_log_probs_and_gradients_of_padded_rows(tmp_path: Path) -> None:
    vocab = 1024
    model_dir = save_model(tmp_path / "model", small_config(vocab))
    check_packed_within_bfloat16_noise("qwen2", model_dir, varied_batch(ROW_LENGTHS, vocab))


@pytest.mark.skipif(not varlen_takes_window(), reason="torch's varlen_attn takes no window here")
@pytest.mark.parametrize("family", ["mistral-window", "qwen2-window", "gemma3"])
def test_packed_rows_keep_each_layer_s_window_through_the_variable_length_kernel(
    tmp_path: Path, family: str
) -> None:
    """Windows of 8 tokens (`tests/services/model_families.py`) on rows of up to 305: the
    varlen kernel's `window_size` against the padded path's masks, per layer type."""
    model_dir = save_family_model(family, tmp_path / family)
    vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    check_packed_within_bfloat16_noise(family, model_dir, varied_batch(ROW_LENGTHS, vocab))


# --- Compiled decoder layers ---------------------------------------------------------------------

# float32 compute: compiled kernels fuse and reorder float32 sums, nothing more.
COMPILE_RTOL = 1e-4


@pytest.mark.skipif(compile_problem("cuda") is not None, reason=str(compile_problem("cuda")))
def test_compiled_decoder_layers_give_the_log_probs_and_gradients_of_eager_ones(
    tmp_path: Path,
) -> None:
    vocab = 1024
    model_dir = save_model(tmp_path / "model", small_config(vocab))
    batch = varied_batch(ROW_LENGTHS, vocab)
    # Padded rows: varlen attention takes half precision only, and packing has its own test.
    eager = learner_config(compute_dtype="float32", compile=False, pack_rows=False)
    compiled = learner_config(compute_dtype="float32", compile=True, pack_rows=False)
    eager_logp, eager_grads = forward_backward(model_dir, eager, batch)
    compiled_logp, compiled_grads = forward_backward(model_dir, compiled, batch)
    mask = batch.response_mask
    torch.testing.assert_close(compiled_logp[mask], eager_logp[mask], rtol=COMPILE_RTOL, atol=1e-5)
    assert compiled_grads.keys() == eager_grads.keys()
    errors = {name: relative_error(compiled_grads[name], g) for name, g in eager_grads.items()}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= COMPILE_RTOL, f"{worst}: relative gradient error {errors[worst]:.3g}"
