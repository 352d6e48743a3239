"""The learner on a CUDA device: NCCL, bfloat16 compute over float32 masters, chunked log-probs.

These run only where a GPU exists (the CPU suite covers the same code with gloo and float32);
elsewhere they are skipped, and say so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from services.learner.batch import TrainingBatch
from services.learner.logprobs import ResponseLogProbs
from services.messages import ScoredGroup
from tests.services.learner.conftest import make_core
from tests.services.learner.ranks import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_bfloat16_step(group: object, model_dir: Path, groups: list[ScoredGroup]) -> dict:
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
    result = run_ranks(cuda_bfloat16_step, 1, tiny_model_dir, groups)[0]
    assert result["masters"] == {torch.float32} and result["device"] == {"cuda"}
    assert result["published"] == {torch.bfloat16}
    assert result["metrics"]["grad_norm"] > 0


def random_batch(rows: int, prompt: int, response: int, vocab: int) -> TrainingBatch:
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
        staleness=torch.zeros(rows, dtype=torch.long, device="cuda"),
        truncated=torch.zeros(rows, dtype=torch.bool, device="cuda"),
    )


def peak_bytes(chunk_tokens: int, batch: TrainingBatch, config: Qwen2Config) -> int:
    torch.manual_seed(0)
    model = ResponseLogProbs(Qwen2ForCausalLM(config).cuda().bfloat16(), chunk_tokens)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    logp, _ = model(batch, 1.0, with_entropy=True)
    logp.sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def test_chunked_log_probs_need_a_fraction_of_the_memory_at_4096_tokens() -> None:
    config = Qwen2Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=151_936,
        max_position_embeddings=8192,
    )
    batch = random_batch(1, 64, 4096, config.vocab_size)
    unchunked = peak_bytes(1 << 20, batch, config)
    chunked = peak_bytes(1024, batch, config)
    print(
        f"peak over the model: unchunked {unchunked / 2**30:.2f} GiB, chunked "
        f"{chunked / 2**30:.2f} GiB ({unchunked / chunked:.1f}x)"
    )
    assert unchunked >= 4 * chunked
