"""The elastic pool's policy (services/pipeline/elastic_policy.py): it grows under a sustained
starved learner, shrinks under a sustained backed-up buffer, never leaves its bounds and does
not flap; seeded random sequences keep its invariants."""

from __future__ import annotations

import random

import pytest

from services.pipeline.elastic_policy import ElasticPolicy, PoolDecision, Sample

WINDOW, COOLDOWN = 10.0, 5.0


def policy(low: int = 1, high: int = 4) -> ElasticPolicy:
    return ElasticPolicy(
        low, high, WINDOW, COOLDOWN, grow_idle_fraction=0.3, shrink_full_fraction=0.8
    )


def drive(
    pool: ElasticPolicy,
    size: int,
    states: list[tuple[bool, bool]],
    start: float = 0.0,
    dt: float = 1.0,
) -> tuple[int, list[PoolDecision]]:
    """Feed one sample every `dt` seconds, applying each decision to the size."""
    decisions = []
    for step, (starved, backed_up) in enumerate(states):
        decision = pool.observe(Sample(start + step * dt, starved, backed_up), size)
        if decision is not None:
            assert decision.size == size
            size = decision.target
            decisions.append(decision)
    return size, decisions


def test_a_sustained_starved_learner_grows_the_pool_once_per_window_and_cooldown() -> None:
    size, decisions = drive(policy(), 1, [(True, False)] * 26)
    # The first decision needs a full window (t = 10); the next a fresh window after it, which
    # also covers the cooldown (t = 20); then none before t = 30.
    assert [(d.direction, d.time) for d in decisions] == [("grow", 10.0), ("grow", 20.0)]
    assert size == 3
    assert decisions[0].starved_fraction == pytest.approx(1.0)
    assert "waited for data" in decisions[0].reason


def test_a_sustained_backed_up_buffer_shrinks_the_pool() -> None:
    size, decisions = drive(policy(), 3, [(False, True)] * 12)
    assert [(d.direction, d.size, d.target) for d in decisions] == [("shrink", 3, 2)]
    assert size == 2
    assert decisions[0].backed_up_fraction == pytest.approx(1.0)


def test_below_the_thresholds_nothing_happens() -> None:
    # Starved 2 s in 10 (20% < 30%); backed up 7 s in 10 (70% < 80%).
    states = [(i % 5 == 0, i % 10 in (1, 2, 3, 4, 5, 6, 7)) for i in range(60)]
    assert drive(policy(), 2, states) == (2, [])


def test_the_pool_never_leaves_its_bounds() -> None:
    size, decisions = drive(policy(1, 2), 1, [(True, False)] * 100)
    assert size == 2 and len(decisions) == 1
    size, decisions = drive(policy(2, 4), 2, [(False, True)] * 100)
    assert size == 2 and decisions == []


def test_a_brief_change_of_regime_does_not_reverse_a_decision() -> None:
    """Hysteresis: after a grow, a few seconds of a backed-up buffer shrink nothing; only a
    whole window of it does, and not before the cooldown."""
    pool = policy()
    size, decisions = drive(pool, 1, [(True, False)] * 11)
    assert size == 2 and len(decisions) == 1  # grown at t = 10
    # 4 s backed up, then balanced: no shrink.
    size, later = drive(pool, size, [(False, True)] * 4 + [(False, False)] * 20, start=11.0)
    assert later == [] and size == 2
    # A sustained backed-up buffer: one shrink, once it fills 80% of a window.
    size, later = drive(pool, size, [(False, True)] * 12, start=35.0)
    # At t = 43 the window [33, 43] was backed up 8 s of 10: the 80% threshold.
    assert [(d.direction, d.time) for d in later] == [("shrink", 43.0)]


def test_the_cooldown_holds_even_with_a_short_window() -> None:
    pool = ElasticPolicy(1, 8, 1.0, 30.0, grow_idle_fraction=0.5, shrink_full_fraction=0.5)
    _, decisions = drive(pool, 1, [(True, False)] * 70)
    assert [d.time for d in decisions] == [1.0, 31.0, 61.0]


def test_irregular_samples_are_weighted_by_the_time_they_hold() -> None:
    pool = policy()
    # Starved for 2 s (from t=0), then a single not-starved sample holding 8.5 s: 2/10 < 0.3.
    assert pool.observe(Sample(0.0, True, False), 1) is None
    assert pool.observe(Sample(2.0, False, False), 1) is None
    assert pool.observe(Sample(10.5, False, False), 1) is None
    assert pool.fractions(10.5) == pytest.approx((1.5 / WINDOW, 0.0))  # 0.5..2.0 starved


def test_samples_out_of_order_and_bad_settings_are_refused() -> None:
    pool = policy()
    pool.observe(Sample(5.0, False, False), 1)
    with pytest.raises(ValueError, match="time order"):
        pool.observe(Sample(4.0, False, False), 1)
    with pytest.raises(ValueError):
        ElasticPolicy(3, 2, WINDOW, COOLDOWN, 0.3, 0.8)
    with pytest.raises(ValueError):
        ElasticPolicy(1, 2, WINDOW, COOLDOWN, 0.0, 0.8)


@pytest.mark.parametrize("seed", range(20))
def test_random_sequences_keep_the_invariants(seed: int) -> None:
    """Whatever the loop reports: the size stays in bounds, each decision moves it by one
    towards its evidence, decisions are at least a window and the cooldown apart, and each
    is backed by its threshold over the window."""
    rng = random.Random(seed)
    low, high = rng.randint(1, 3), rng.randint(3, 6)
    pool = ElasticPolicy(low, high, 10.0, 5.0, grow_idle_fraction=0.3, shrink_full_fraction=0.8)
    size, now, last = rng.randint(low, high), 0.0, None
    regime = rng.choice([(True, False), (False, True), (False, False)])
    for _ in range(2000):
        if rng.random() < 0.02:  # regimes last a while, with noise inside them
            regime = rng.choice([(True, False), (False, True), (False, False)])
        noisy = rng.random() < 0.2
        starved, backed_up = (rng.random() < 0.5, False) if noisy else regime
        now += rng.uniform(0.05, 1.5)
        decision = pool.observe(Sample(now, starved, backed_up), size)
        if decision is None:
            continue
        assert decision.target == size + (1 if decision.direction == "grow" else -1)
        if decision.direction == "grow":
            assert decision.starved_fraction >= 0.3
        else:
            assert decision.backed_up_fraction >= 0.8
        if last is not None:
            assert decision.time - last >= max(10.0, 5.0)
        size, last = decision.target, decision.time
        assert low <= size <= high
