"""The learner speed benchmark's arithmetic (its GPU run needs a GPU: scripts/gpu_check.sh).

Model FLOPs are worked out by hand for a small shape and checked against the issue's figures for
Qwen2.5-0.5B (1.45 s for 64 x 1,152 tokens was 16% of 989 TFLOP/s); the long-tailed lengths
keep their range and mean; the groups carry a learning signal in every group.
"""

from __future__ import annotations

import statistics

from bench_learner import QWEN25_05B, ModelShape
from bench_learner_speed import (
    GROUP_SIZE,
    H100_BF16_DENSE_FLOPS,
    case_groups,
    gpu_cases,
    long_tailed_lengths,
    matmul_params,
    model_flops,
)

SMALL = ModelShape("small", hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=10,
                   tied=True)  # fmt: skip


def test_model_flops_worked_out_by_hand() -> None:
    # head_dim 4: q, o 8 x 8 each; k, v 8 x 4 each; MLP 3 x 8 x 16; head 10 x 8.
    per_layer = 64 + 64 + 32 + 32 + 384
    assert matmul_params(SMALL) == 2 * per_layer + 80
    # Rows of 3 and 5 tokens: 6 P tokens + 6 L (heads x head_dim) sum(L^2).
    assert model_flops(SMALL, [3, 5]) == 6 * 1232 * 8 + 6 * 2 * 8 * (9 + 25)


def test_the_half_billion_case_gives_the_mfu_measured_before() -> None:
    case = gpu_cases(0)["a"]
    assert case.shape == QWEN25_05B and case.real_tokens == 64 * 1152
    mfu = model_flops(case.shape, [1152] * 64) / 1.45 / H100_BF16_DENSE_FLOPS
    assert 0.15 < mfu < 0.17


def test_long_tailed_lengths_span_the_range_with_the_mean_asked_for() -> None:
    lengths = long_tailed_lengths(64, 128, 4096, 1091.0, seed=0)
    assert len(lengths) == 64 and min(lengths) >= 128 and max(lengths) == 4096
    assert abs(statistics.mean(lengths) - 1091) < 5
    assert statistics.median(lengths) < 900  # long-tailed: most rows are short
    assert long_tailed_lengths(64, 128, 4096, 1091.0, seed=0) == lengths
    assert long_tailed_lengths(64, 128, 4096, 1091.0, seed=1) != lengths


def test_every_group_of_a_case_has_both_rewards() -> None:
    case = gpu_cases(0)["c"]
    groups = case_groups(case, seed=0)
    assert [len(g.responses) for g in groups] == [GROUP_SIZE] * (64 // GROUP_SIZE)
    lengths = [len(r.response.response_token_ids) for g in groups for r in g.responses]
    assert lengths == list(case.responses)
    assert all({r.reward for r in g.responses} == {0.0, 1.0} for g in groups)
