"""The adaptive staleness bound's controller on synthetic record streams: its range, when it
tightens, loosens and holds, its learnt band, and its state carried through JSON."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest

from services.pipeline.staleness import (
    FACTOR,
    PATIENCE,
    SIGNAL_FLOORS,
    WARMUP,
    StalenessController,
    learner_waited,
)

# Steady, healthy values of the signals (of a run at its usual staleness).
CLIP, KL, SWITCH, VARIANCE = 0.02, 0.002, 0.1, 0.02


def record(
    step: int,
    clip: float = CLIP,
    kl: float = KL,
    *,
    waited: bool = False,
    idle: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A learner step's record with the health signals; `waited`: the learner was idle for
    half its step (one of a second), else for none of it."""
    out: dict[str, Any] = {
        "step": step,
        "clip_fraction": clip,
        "approx_kl": kl,
        "filtered_switch_frequency": SWITCH,
        "raw_local_variance": VARIANCE,
        "filtered_local_variance": VARIANCE,
        "step_seconds": 1.0,
        "learner_idle_seconds": (0.5 if waited else 0.0) if idle is None else idle,
        **extra,
    }
    return out


def feed(controller: StalenessController, records: list[dict[str, Any]]) -> list[int]:
    """The bound after each record."""
    return [controller.observe(r).bound for r in records]


def warm(controller: StalenessController, waited: bool = False) -> None:
    """The warm-up on healthy, steady records: the bound does not move."""
    start = controller.bound
    bounds = feed(controller, [record(step, waited=waited) for step in range(1, WARMUP + 1)])
    assert bounds == [start] * WARMUP


@pytest.mark.parametrize(
    ("low", "high", "start"), [(0, 3, 2), (0, 8, 2), (3, 5, 3), (0, 1, 1), (0, 0, 0), (4, 4, 4)]
)
def test_the_bound_starts_at_two_clamped_into_the_range(low: int, high: int, start: int) -> None:
    assert StalenessController(low, high).bound == start


@pytest.mark.parametrize("seed", range(40))
def test_the_bound_stays_in_its_range_and_moves_by_one_on_random_signals(seed: int) -> None:
    rng = random.Random(seed)
    low = rng.randint(0, 3)
    high = low + rng.randint(0, 5)
    controller = StalenessController(low, high, patience=rng.randint(1, 4))
    moves = 0
    for step in range(1, 400):
        roll = rng.random()
        clip = rng.choice([math.nan, math.inf]) if roll < 0.02 else rng.uniform(0.0, 0.12)
        fields = record(step, clip, rng.uniform(0.0, 0.01), waited=rng.random() < 0.6)
        if rng.random() < 0.1:
            del fields["approx_kl"]  # an absent signal is not judged
        decision = controller.observe(fields)
        assert low <= decision.bound <= high
        assert abs(decision.bound - decision.previous) <= 1
        expected = {1: "loosen", -1: "tighten", 0: "hold"}[decision.bound - decision.previous]
        assert decision.direction == expected
        moves += decision.moved
        assert controller.changes == moves
    if high > low:  # room to move: random health does move it
        assert moves > 0


def test_worsening_health_tightens_step_by_step_to_the_floor() -> None:
    controller = StalenessController(0, 4, start=4)
    warm(controller)
    # The clip fraction climbs far above its band and stays there.
    bounds = feed(controller, [record(step, clip=0.1 * step) for step in range(6, 26)])
    # A tightening at once, then one more after each hold of PATIENCE steps, down to 0.
    hold = [None] * PATIENCE
    expected = []
    for bound in (3, 2, 1, 0):
        expected += [bound, *[bound for _ in hold]]
    expected += [0] * (20 - len(expected))
    assert bounds == expected
    assert controller.changes == 4
    decision = controller.observe(record(26, clip=3.0))
    assert decision.direction == "hold" and decision.reason.startswith("at the floor (0)")
    assert decision.unhealthy == ("clip_fraction",)


def test_a_rising_kl_alone_tightens() -> None:
    controller = StalenessController(0, 4)
    warm(controller)
    decision = controller.observe(record(6, kl=0.05))
    assert (decision.previous, decision.bound, decision.direction) == (2, 1, "tighten")
    assert decision.unhealthy == ("approx_kl",) and "approx_kl" in decision.reason


def test_good_health_with_the_learner_waiting_loosens_to_the_ceiling() -> None:
    controller = StalenessController(0, 4)
    warm(controller, waited=True)
    bounds = feed(controller, [record(step, waited=True) for step in range(6, 20)])
    # Healthy for longer than PATIENCE steps already: loosened at once, then again once the
    # hold after the move is over (PATIENCE healthy steps since it), and no further than 4.
    assert bounds == [3, 3, 3, 3, 4, *[4] * 9]
    assert controller.changes == 2
    last = controller.observe(record(20, waited=True))
    assert last.direction == "hold" and "ceiling" in last.reason


def test_good_health_without_the_learner_waiting_holds() -> None:
    controller = StalenessController(0, 4)
    decisions = [controller.observe(record(step)) for step in range(1, 60)]
    assert {d.bound for d in decisions} == {2}
    assert controller.changes == 0
    assert "did not wait" in decisions[-1].reason
    # A step whose record lacks the learner's idle time (a run's first) did not wait either.
    fields = record(60)
    del fields["learner_idle_seconds"]
    assert controller.observe(fields).learner_waited is False


@pytest.mark.parametrize(
    ("idle", "step_seconds", "waited"),
    [(0.0, 1.0, False), (0.09, 1.0, False), (0.11, 1.0, True), (5.0, 2.0, True)],
)
def test_the_learner_waited_when_idle_for_more_than_a_tenth_of_its_step(
    idle: float, step_seconds: float, waited: bool
) -> None:
    fields = {"learner_idle_seconds": idle, "step_seconds": step_seconds}
    assert learner_waited(fields) is waited
    assert learner_waited({"learner_idle_seconds": math.nan, "step_seconds": 1.0}) is False


def test_a_move_is_followed_by_a_hold_of_patience_steps() -> None:
    controller = StalenessController(0, 4, start=3)
    warm(controller, waited=True)
    bad = controller.observe(record(6, clip=0.5))
    assert (bad.bound, bad.direction) == (2, "tighten")
    # Still unhealthy, but held for PATIENCE steps: the batches admitted before train first.
    held = [controller.observe(record(7 + i, clip=0.5)) for i in range(PATIENCE)]
    assert [d.bound for d in held] == [2] * PATIENCE
    assert all(d.direction == "hold" and d.reason.startswith("held") for d in held)
    assert controller.observe(record(7 + PATIENCE, clip=0.5)).bound == 1
    # Healthy again, the learner waiting: loosening waits for PATIENCE healthy steps (and the
    # hold), and one unhealthy step starts the count again.
    step = 8 + PATIENCE
    bounds = feed(controller, [record(step + i, waited=True) for i in range(PATIENCE - 1)])
    assert bounds == [1] * (PATIENCE - 1)
    assert controller.observe(record(step + PATIENCE - 1, clip=0.5, waited=True)).bound == 1
    step += PATIENCE
    bounds = feed(controller, [record(step + i, waited=True) for i in range(PATIENCE)])
    assert bounds == [1] * (PATIENCE - 1) + [2]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, None, "nan"])
def test_a_signal_that_is_not_a_finite_number_tightens(value: Any) -> None:
    controller = StalenessController(0, 4)
    warm(controller)
    band = controller.band("clip_fraction")
    decision = controller.observe(record(6, clip=value))
    assert (decision.bound, decision.direction) == (1, "tighten")
    assert decision.unhealthy == ("clip_fraction",)
    assert controller.band("clip_fraction") == band  # not learnt


def test_the_band_is_learnt_from_the_run() -> None:
    # A run whose clip fraction is steadily high (0.2) is healthy at 0.2: its band is
    # FACTOR x 0.2 + the floor, not an absolute limit.
    controller = StalenessController(0, 4)
    feed(controller, [record(step, clip=0.2) for step in range(1, WARMUP + 1)])
    edge = FACTOR * 0.2 + SIGNAL_FLOORS["clip_fraction"]
    assert controller.band("clip_fraction") == pytest.approx(edge)
    assert controller.observe(record(6, clip=edge - 0.001)).direction == "hold"
    assert controller.observe(record(7, clip=edge + 0.001)).direction == "tighten"


def test_bad_values_enter_the_band_capped_at_its_edge() -> None:
    controller = StalenessController(0, 4, window=20)
    feed(controller, [record(step, clip=0.2) for step in range(1, 21)])  # a full window
    edge = FACTOR * 0.2 + SIGNAL_FLOORS["clip_fraction"]
    # Fewer bad steps than half the window leave the median, and the band, as they were.
    bad = [controller.observe(record(step, clip=5.0)) for step in range(21, 30)]
    assert controller.band("clip_fraction") == pytest.approx(edge)
    assert all(d.unhealthy == ("clip_fraction",) for d in bad)
    assert controller.bound == 0
    # A rise that lasts widens the band only gradually: each bad value entered as the edge.
    controller.observe(record(30, clip=5.0))
    halfway = FACTOR * (0.2 + edge) / 2 + SIGNAL_FLOORS["clip_fraction"]
    assert controller.band("clip_fraction") == pytest.approx(halfway)


def random_noisy(seed: int, steps: int) -> list[dict[str, Any]]:
    """Healthy steps of a run whose signals are very noisy: uniform in [0, twice the mean]."""
    rng = random.Random(seed)
    return [
        record(step, clip=rng.uniform(0.0, 0.12), kl=rng.uniform(0.0, 0.01), waited=True)
        for step in range(1, steps + 1)
    ]


@pytest.mark.parametrize("seed", range(10))
def test_the_band_does_not_collapse_on_noisy_signals(seed: int) -> None:
    """Steady but very noisy signals (a sixth of them above FACTOR x their median): the band
    stays around FACTOR x the median + the floor (0.1 for the clip fraction, 0.0085 for the KL)
    whatever the warm-up happened to see. Learning from healthy values only would cut off the
    high end of the noise at every step, and the band would shrink towards 4 floors (0.04,
    0.004) with most steps unhealthy."""
    controller = StalenessController(0, 6)
    decisions = [controller.observe(r) for r in random_noisy(seed, 400)]
    clip, kl = controller.band("clip_fraction"), controller.band("approx_kl")
    assert clip is not None and 0.06 < clip < 0.14
    assert kl is not None and 0.006 < kl < 0.014
    unhealthy = sum(bool(d.unhealthy) for d in decisions[200:])
    assert unhealthy < 0.5 * 200
    assert max(d.bound for d in decisions[200:]) > 2  # it loosens at times (the learner waits)


def test_no_move_during_the_warm_up_even_on_bad_values() -> None:
    controller = StalenessController(0, 4)
    records = [record(1), record(2, clip=math.nan), record(3, clip=0.9), record(4), record(5)]
    decisions = [controller.observe(r) for r in records]
    assert [d.bound for d in decisions] == [2] * 5
    assert all(d.reason.startswith("warm-up") for d in decisions)


def random_records(seed: int, start: int, count: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        record(
            step,
            clip=rng.choice([rng.uniform(0.0, 0.05), rng.uniform(0.0, 0.3), math.nan]),
            kl=rng.uniform(0.0, 0.01),
            waited=rng.random() < 0.7,
        )
        for step in range(start, start + count)
    ]


@pytest.mark.parametrize("seed", range(5))
def test_the_state_round_trips_through_json_and_goes_on_identically(seed: int) -> None:
    controller = StalenessController(1, 6)
    feed(controller, random_records(seed, 1, 30))
    saved = json.loads(json.dumps(controller.state(), allow_nan=False))
    again = StalenessController.from_state(1, 6, saved)
    assert again.state() == controller.state()
    later = random_records(seed + 100, 31, 200)
    assert [controller.observe(r) for r in later] == [again.observe(r) for r in later]
    assert again.state() == controller.state()


def test_a_restored_bound_outside_the_range_is_clamped_into_it() -> None:
    state = StalenessController(0, 8, start=7).state()
    assert StalenessController.from_state(0, 4, state).bound == 4


@pytest.mark.parametrize(
    ("args", "settings"),
    [((2, 1), {}), ((-1, 3), {}), ((0, 3), {"patience": 0}), ((0, 3), {"factor": 0.5})],
)
def test_bad_settings_are_refused(args: tuple[int, int], settings: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        StalenessController(*args, **settings)
