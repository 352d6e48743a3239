"""The load benchmark's figures: percentiles, summaries, what counts as an error, the mix."""

from __future__ import annotations

import math
import random
from collections import Counter

import bench_load
import pytest
from bench_load import OPERATIONS, classify, percentile, ratio, summarize, weighted_cycle

from services.store.base import RUN_ID_PATTERN


def test_percentile_interpolates_between_ranks_as_numpy_does() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_is_nan_and_of_a_bad_rank_an_error() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_gives_milliseconds_and_a_rate() -> None:
    latencies = [0.001 * i for i in range(1, 101)]  # 1..100 ms, unsorted below
    random.Random(0).shuffle(latencies)
    summary = summarize(latencies, seconds=4.0)
    assert summary.requests == 100
    assert summary.per_second == 25.0
    assert summary.p50_ms == pytest.approx(50.5)
    assert summary.p95_ms == pytest.approx(95.05)
    assert summary.p99_ms == pytest.approx(99.01)
    assert summary.max_ms == pytest.approx(100.0)


def test_summarize_of_no_requests_is_nan_not_an_error() -> None:
    summary = summarize([], seconds=1.0)
    assert summary.requests == 0 and summary.per_second == 0
    assert math.isnan(summary.p99_ms)


def test_expected_answers_are_not_errors_and_5xx_always_are() -> None:
    ok, not_found = frozenset({200}), frozenset({404})
    assert classify(200, ok) is None
    assert classify(404, not_found) is None
    assert classify(404, ok) == "unexpected 404"
    assert classify(422, ok) == "unexpected 422"
    assert classify(500, ok) == "5xx"
    assert classify(503, not_found) == "5xx"


def test_ratio_is_nan_without_a_baseline() -> None:
    assert ratio(30.0, 10.0) == 3.0
    assert math.isnan(ratio(30.0, 0.0))
    assert math.isnan(ratio(30.0, math.nan))
    assert math.isnan(ratio(math.nan, 10.0))


def test_the_mix_follows_its_weights() -> None:
    draws = weighted_cycle(OPERATIONS, random.Random(1))
    counts = Counter(next(draws).name for _ in range(20_000))
    total_weight = sum(op.weight for op in OPERATIONS)
    for op in OPERATIONS:
        assert counts[op.name] / 20_000 == pytest.approx(op.weight / total_weight, abs=0.02)


def test_unknown_run_ids_are_well_formed() -> None:
    rng = random.Random(2)
    ids = {bench_load.unknown_run_id(rng) for _ in range(100)}
    assert len(ids) == 100
    assert all(RUN_ID_PATTERN.fullmatch(run_id) for run_id in ids)
