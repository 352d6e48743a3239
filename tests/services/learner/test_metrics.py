"""Metric helpers: batch statistics and the reduction over minibatches, worked out by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kpo_core.diagnostics import diagnostic_sums
from services.learner.batch import collate
from services.learner.host_reads import HostReads
from services.learner.metrics import (
    batch_metrics,
    diagnostic_metrics,
    diagnostic_sum_metrics,
    reduce_minibatches,
)
from services.messages import ScoredGroup
from tests.services.learner.test_batch import PAD, two_groups


def test_batch_metrics_of_the_two_group_example() -> None:
    metrics = batch_metrics(collate(two_groups(), PAD, learner_version=4))
    # rewards [1, 0, 0, 0.5]: mean 0.375; population variance of
    # (0.625, -0.375, -0.375, 0.125) = (0.390625 + 0.140625 * 2 + 0.015625) / 4 = 0.171875.
    assert metrics["reward_mean"] == 0.375
    assert metrics["reward_std"] == pytest.approx(math.sqrt(0.171875), abs=1e-12)
    assert metrics["accuracy"] == 0.25
    assert metrics["response_length_mean"] == 2.0  # (3 + 1 + 0 + 4) / 4
    assert metrics["truncated_fraction"] == 0.75
    assert metrics["zero_variance_group_fraction"] == 0.0  # [1, 0] and [0, 0.5]
    assert metrics["staleness_mean"] == 1.75 and metrics["staleness_max"] == 3.0
    assert metrics["tokens_trained"] == 8.0
    assert metrics["empty_responses"] == 1.0  # C
    assert metrics["nonfinite_rewards"] == 0.0


def with_rewards(rewards: list[float]) -> list[ScoredGroup]:
    """two_groups() with rewards A, B, C, D replaced."""
    values = iter(rewards)
    return [
        ScoredGroup(g.prompt, [dataclasses.replace(s, reward=next(values)) for s in g.responses])
        for g in two_groups()
    ]


def test_nonfinite_rewards_are_counted_and_left_out_of_the_statistics() -> None:
    batch = collate(with_rewards([1.0, math.nan, math.inf, 0.5]), PAD, learner_version=4)
    metrics = batch_metrics(batch)
    assert metrics["nonfinite_rewards"] == 2.0
    assert metrics["reward_mean"] == 0.75  # (1 + 0.5) / 2
    assert metrics["reward_std"] == 0.25
    # Each group is left with one finite reward: no learning signal in either.
    assert metrics["zero_variance_group_fraction"] == 1.0
    # C's inf reward is not a correct answer.
    assert not bool(batch.correct[2]) and metrics["accuracy"] == 0.25
    assert all(math.isfinite(value) for value in metrics.values()), metrics


def test_a_batch_without_finite_rewards_has_zero_reward_statistics() -> None:
    nan = math.nan
    metrics = batch_metrics(collate(with_rewards([nan, nan, -math.inf, nan]), PAD, 0))
    assert metrics["reward_mean"] == metrics["reward_std"] == 0.0
    assert metrics["nonfinite_rewards"] == 4.0
    assert metrics["zero_variance_group_fraction"] == 1.0


def test_minibatch_reduction() -> None:
    records = [
        {"ratio_max": 1.5, "ratio_min": 0.9, "policy_loss": 1.0, "skipped_minibatches": 0.0},
        {"ratio_max": 1.2, "ratio_min": 0.7, "policy_loss": 3.0, "skipped_minibatches": 1.0},
        {"grad_norm": math.nan, "policy_loss": math.inf, "nonfinite_tokens": 2.0},
        {"extreme_ratio_tokens": 3.0, "empty_minibatches": 1.0, "nonfinite_tokens": 1.0},
        {"extreme_ratio_tokens": 2.0, "empty_minibatches": 0.0},
    ]
    assert reduce_minibatches(records) == {
        "ratio_max": 1.5,
        "ratio_min": 0.7,
        "policy_loss": 2.0,  # the non-finite value is left out of the mean
        "skipped_minibatches": 1.0,
        "nonfinite_tokens": 3.0,  # counts are summed
        "extreme_ratio_tokens": 5.0,
        "empty_minibatches": 1.0,
    }


def test_diagnostics_keep_only_the_scalars() -> None:
    ratios = torch.tensor([[1.0, 1.1, 1.1, 0.5]])
    metrics = diagnostic_metrics("raw_", ratios, torch.ones_like(ratios, dtype=torch.bool))
    assert set(metrics) == {
        "raw_switch_frequency",
        "raw_run_length_up",
        "raw_run_length_down",
        "raw_run_length_on",
        "raw_low_frequency_ratio",
        "raw_global_variance",
        "raw_local_variance",
    }
    # Types on, up, up, down: runs of 1, 2, 1; 2 switches over 3 adjacent pairs.
    assert metrics["raw_run_length_up"] == 2.0
    assert metrics["raw_switch_frequency"] == pytest.approx(2 / 3, abs=1e-12)


def test_diagnostics_of_sums_read_nothing_until_the_sums_are_read() -> None:
    gen = torch.Generator().manual_seed(0)
    ratios = 1.0 + 1e-3 * torch.randn(6, 40, generator=gen)
    mask = torch.rand(6, 40, generator=gen) < 0.8
    lengths = mask.sum(dim=1).tolist()
    with HostReads() as reads:
        sums = diagnostic_sums(ratios, mask, lengths)
    assert reads.total == 0, dict(reads.by_name)
    metrics = diagnostic_sum_metrics("filtered_", sums.tolist())
    assert metrics == diagnostic_metrics("filtered_", ratios, mask)
