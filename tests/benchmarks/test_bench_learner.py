"""The learner benchmark at a tiny size, and its memory formula worked out by hand.

What must hold at any size: fsdp2 at 2 ranks holds half the parameter + AdamW bytes per rank
(<= 0.55x of single's), the bytes are exactly what the parameter count says, and a chunked
log-prob pass peaks below an unchunked one (measurable here: the tiny model keeps a vocabulary
of 32,000, so unchunked logits of 512 tokens are 65 MB a copy).
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import bench_learner
import pytest
from bench_learner import (
    SIZING_SHAPES,
    ModelShape,
    estimate_rank_memory,
    param_counts,
    sizing_table,
)

TINY = ModelShape(
    "tiny", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=32000, tied=True
)
# fmt: off
TINY_FLAGS = [
    "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
    "--vocab", "32000", "--tokens", "32,64", "--rows", "2,1", "--prompt-tokens", "8",
    "--logprob-tokens", "512", "--chunk", "64", "--logprob-threads", "1", "--timeout-s", "120",
]
# fmt: on


def test_tiny_parameter_count_worked_out_by_hand() -> None:
    # Qwen2, H 64, 4 heads of 16, 2 KV heads (32 wide), I 128, V 32000, tied:
    # q 64*64+64 = 4160, k and v 64*32+32 = 2080 each, o 64*64 = 4096, MLP 3*64*128 = 24576,
    # two norms 128: a layer is 37120. Root: embedding 32000*64 = 2,048,000 + final norm 64.
    counts = param_counts(TINY)
    assert counts.layer == 37120
    assert counts.root == 2_048_064
    assert counts.total == 2_048_064 + 2 * 37120


def test_estimate_follows_its_formula() -> None:
    counts = param_counts(TINY)
    P, L, H, V, inter = counts.total, 2, 64, 32000, 128  # inter: I, the MLP width
    sharded = estimate_rank_memory(TINY, 4, tokens=512, chunk=64, dtype_bytes=2, checkpointing=True)
    assert sharded.states == 16 * P / 4
    assert sharded.gathered == 2 * (counts.root + 2 * counts.layer) + 4 * counts.root
    assert sharded.saved == L * 512 * H * 2
    logits = 5 * 64 * V * 4 + 2 * V * H  # 40,960,000 + 4,096,000
    layer = 512 * (12 * H + 4 * inter) * 2  # 1,310,720: the logits are the larger transient
    assert sharded.working == logits
    assert sharded.total == sharded.gathered + sharded.saved + sharded.states + logits
    # One micro-batch per minibatch: no gradients yet while the head runs (12 P / W, not 16).
    first = estimate_rank_memory(TINY, 4, 512, 64, 2, True, accumulating=False)
    assert first.total == sharded.total - 4 * P / 4
    # float32 single without checkpointing: no cast copies, every layer's activations kept,
    # and the chunk capped by the tokens.
    alone = estimate_rank_memory(TINY, 1, tokens=32, chunk=64, dtype_bytes=4, checkpointing=False)
    assert alone.gathered == 0
    assert alone.saved == L * 32 * (12 * H + 4 * inter) * 4
    assert alone.working == 5 * 32 * V * 4 + 4 * V * H
    assert layer < logits


def test_sizing_shapes_have_the_published_sizes() -> None:
    totals = {shape.name: param_counts(shape).total for shape in SIZING_SHAPES}
    assert totals == {
        "Qwen2.5-1.5B": 1_543_714_304,
        "Qwen3-4B": 4_022_468_096,
        "Qwen3-8B": 8_190_735_360,
    }
    table = sizing_table()
    assert table.count("\n| Qwen") == 6  # 3 models x (4k, 8k)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The benchmark's `main` in this process (its measurements still run in forked ones)."""
    out = tmp_path_factory.mktemp("bench-learner") / "result.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        returned = bench_learner.main([*TINY_FLAGS, "--json", str(out)])
    lines = printed.getvalue().splitlines()
    assert sum(line.startswith("[") for line in lines) == 7  # the model, then 6 measurements
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(returned))
    return written


def test_structure(result: dict) -> None:
    steps = result["steps"]
    assert [(s["strategy"], s["world_size"], s["tokens"], s["rows"]) for s in steps] == [
        ("single", 1, 32, 2),
        ("fsdp2", 2, 32, 2),
        ("single", 1, 64, 1),
        ("fsdp2", 2, 64, 1),
    ]
    for step in steps:
        assert len(step["ranks"]) == step["world_size"]
        assert step["tokens_trained"] == step["tokens"] * step["rows"]
        assert step["ranks"][0]["skipped_minibatches"] == 0  # the record is rank 0's
        for key in (
            "peak_rss_bytes",
            "training_rss_bytes",
            "seconds",
            "tokens_per_s",
            "estimate_bytes",
        ):
            assert math.isfinite(step[key]) and step[key] > 0, key
    assert [r["chunk"] for r in result["logprobs"]] == [64, 512]
    for record in result["logprobs"]:
        for key in ("activation_peak_bytes", "logits_peak_bytes", "logits_estimate_bytes"):
            assert math.isfinite(record[key]) and record[key] > 0, key
    assert result["logprobs"][-1]["vs_unchunked"]["activation_peak_bytes"] == 1.0


def test_parameter_and_optimiser_bytes_are_exact(result: dict) -> None:
    params = result["model"]["params"]
    assert params == param_counts(TINY).total
    # 26 tensors: the (tied) embedding, the final norm, and 12 a layer (q, k, v with their
    # biases, o, gate, up, down, two norms).
    tensors = 2 + 2 * 12
    for step in result["steps"]:
        ranks = step["ranks"]
        # float32 weights; AdamW's exp_avg and exp_avg_sq, and a float32 step count per tensor
        # on every rank.
        assert sum(r["param_bytes"] for r in ranks) == 4 * params
        assert sum(r["optimizer_bytes"] for r in ranks) == 8 * params + 4 * tensors * len(ranks)


def test_fsdp2_halves_the_parameter_and_optimiser_memory_per_rank(result: dict) -> None:
    sharded = [s for s in result["steps"] if s["strategy"] == "fsdp2"]
    assert all(s["vs_single"]["param_optim_bytes"] <= 0.55 for s in sharded)
    assert result["ratios"]["fsdp2_param_optim_vs_single"] <= 0.55


def test_chunked_log_probs_peak_below_unchunked(result: dict) -> None:
    chunked, unchunked = result["logprobs"]
    for key in ("activation_peak_bytes", "logits_peak_bytes"):
        assert 0 < chunked[key] < unchunked[key], key
    assert result["ratios"]["unchunked_vs_chunked_activation_peak"] > 1
    assert result["ratios"]["unchunked_vs_chunked_logits_peak"] > 1
