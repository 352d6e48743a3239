"""The stability guard's decisions on synthetic metric streams from seeded generators.

A healthy stream: entropy level with noise, clip fraction 0.02-0.08, gradient norm lognormal
about a median, reward slowly rising, held-out accuracy every 10 steps slowly rising. The other
streams are it with one signal broken at known steps, so each test knows where the guard must
(and must not) act.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from services.metrics import BY_KEY
from services.pipeline.guard import (
    OBJECTIVE_COMPARISONS,
    GuardDecision,
    StabilityGuard,
    least_squares_slope,
    number,
)
from services.spec import StabilityConfig, StabilityObjectives

Record = dict[str, Any]
STEPS = 300


def healthy_stream(seed: int, steps: int = STEPS) -> list[Record]:
    """A healthy run's metrics records, steps 1..`steps`."""
    rng = random.Random(seed)
    records = []
    for step in range(1, steps + 1):
        progress = step / steps
        record: Record = {
            "step": step,
            "entropy": 0.8 * (1.0 + rng.gauss(0.0, 0.05)),
            "clip_fraction": rng.uniform(0.02, 0.08),
            "grad_norm": 0.5 * math.exp(rng.gauss(0.0, 0.3)),
            "nonfinite_tokens": 0.0,
            "reward_mean": 0.2 + 0.4 * progress + rng.gauss(0.0, 0.05),
            "kalman_gain_mean": 0.1,
            "raw_switch_frequency": rng.uniform(0.40, 0.46),
            "filtered_switch_frequency": rng.uniform(0.01, 0.06),
        }
        if step % 10 == 0:
            record["eval_accuracy_avg_at_k"] = 0.2 + 0.3 * progress + rng.gauss(0.0, 0.01)
        records.append(record)
    return records


def enabled(**settings: Any) -> StabilityConfig:
    """The default guard, switched on, with `settings` (objectives as a mapping)."""
    return StabilityConfig.model_validate({"enabled": True, **settings})


def run(guard: StabilityGuard, records: Iterable[Record]) -> list[GuardDecision]:
    return [guard.observe(record) for record in records]


def acted(decisions: Iterable[GuardDecision]) -> list[GuardDecision]:
    return [d for d in decisions if d.action != "none"]


def first_broken(decisions: Iterable[GuardDecision]) -> int:
    return next(d.step for d in decisions if d.broken)


def broken_steps(decisions: Iterable[GuardDecision], *objectives: str) -> list[int]:
    """The steps at which any of `objectives` was broken."""
    return [d.step for d in decisions if any(b.objective in objectives for b in d.broken)]


def with_values(records: list[Record], key: str, values: dict[int, float]) -> list[Record]:
    """`records` with `key` set to `values[step]` at those steps."""
    return [{**r, key: values[r["step"]]} if r["step"] in values else dict(r) for r in records]


def scaled(records: list[Record], key: str, factor: Callable[[int], float]) -> list[Record]:
    """`records` with `key` multiplied by `factor(step)`."""
    return [{**r, key: r[key] * factor(r["step"])} for r in records]


def entropy_collapse(start: int) -> Callable[[int], float]:
    """Entropy decays to 10% over 20 steps from `start`, then stays there."""
    return lambda step: 0.1 ** (min(max(step - start, 0), 20) / 20)


def spikes(records: list[Record], steps: Iterable[int], factor: float = 20.0) -> list[Record]:
    """`records` with the gradient norm `factor` x its median (0.5) at `steps`."""
    return with_values(records, "grad_norm", {step: 0.5 * factor for step in steps})


# --- the mapping of objectives to record keys -----------------------------------------------------


def test_every_objective_of_the_spec_reads_a_declared_key_that_its_description_names() -> None:
    assert set(OBJECTIVE_COMPARISONS) == set(StabilityObjectives.model_fields)
    for name, (key, _, requires) in OBJECTIVE_COMPARISONS.items():
        assert key in BY_KEY, key
        assert requires is None or requires in BY_KEY, requires
        description = StabilityObjectives.model_fields[name].description or ""
        assert f"`{key}`" in description, name


def test_the_slope_is_the_least_squares_one() -> None:
    assert least_squares_slope([1.0, 3.0, 5.0, 7.0]) == 2.0
    assert least_squares_slope([2.0, 0.0, 2.0, 0.0, 2.0]) == 0.0
    assert math.isclose(least_squares_slope([0.0, 1.0, 1.0, 3.0]), 0.9)


# --- healthy runs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_a_healthy_noisy_run_triggers_nothing_with_the_defaults(seed: int) -> None:
    guard = StabilityGuard(enabled())
    decisions = []
    for record in healthy_stream(seed):
        decisions.append(guard.observe(record))
        assert not guard.wants_checkpoint(record["step"]), record["step"]
        if record["step"] % 10 == 0:
            guard.checkpointed(record["step"])
    assert acted(decisions) == []
    # Every checkpoint but the last (300: no step follows it) became healthy.
    assert guard.healthy_checkpoint() == 290


def test_the_healthy_stream_is_seen_a_tighter_bound_fires_on_it() -> None:
    """The quiet of the test above is the bounds', not a guard that reads nothing."""
    guard = StabilityGuard(enabled(objectives={"clip_fraction_max": 0.05}))
    decisions = acted(run(guard, healthy_stream(0)))
    assert decisions and decisions[0].reason == "clip_fraction_max"
    assert decisions[0].step > guard.config.warmup_steps


def test_a_disabled_guard_never_acts() -> None:
    records = scaled(healthy_stream(0), "entropy", entropy_collapse(100))
    assert acted(run(StabilityGuard(enabled()), records))
    guard = StabilityGuard(StabilityConfig())
    assert acted(run(guard, records)) == []
    assert not guard.wants_checkpoint(101)


# --- entropy collapse -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_an_entropy_collapse_acts_within_patience_of_its_first_broken_step_once(
    seed: int,
) -> None:
    records = scaled(healthy_stream(seed), "entropy", entropy_collapse(100))
    guard = StabilityGuard(enabled())
    decisions = run(guard, records)
    broken_at = first_broken(decisions)
    assert 100 < broken_at <= 120
    actions = acted(decisions)
    assert len(actions) == 1
    (action,) = actions
    patience = guard.config.patience
    assert broken_at <= action.step <= broken_at + patience - 1
    assert action.action == "warn"
    assert action.reason in ("entropy_min_fraction", "entropy_slope_min")
    assert action.key == "entropy"
    assert action.since == broken_at
    assert action.bound is not None and action.value is not None and action.limit is not None
    assert action.value < action.limit
    assert action.reason in action.message and f"step {action.step}" in action.message


def test_the_collapse_does_not_drag_its_own_baseline_down() -> None:
    """The entropy stays at 10% after its fall: every step stays broken against the baseline
    of before the fall (a baseline that followed it would make the fall look healthy)."""
    records = scaled(healthy_stream(0), "entropy", entropy_collapse(100))
    decisions = run(StabilityGuard(enabled()), records)
    broken = {
        d.step for d in decisions if any(b.objective == "entropy_min_fraction" for b in d.broken)
    }
    first = min(broken)
    assert set(range(first, STEPS + 1)) <= broken


@pytest.mark.parametrize("objective", ["entropy_min_fraction", "entropy_slope_min"])
def test_each_entropy_objective_alone_sees_the_collapse(objective: str) -> None:
    other = {"entropy_min_fraction", "entropy_slope_min"} - {objective}
    config = enabled(objectives=dict.fromkeys(other))
    records = scaled(healthy_stream(1), "entropy", entropy_collapse(100))
    actions = acted(run(StabilityGuard(config), records))
    assert [a.reason for a in actions] == [objective]
    assert 100 < actions[0].step <= 125


def test_objectives_set_to_null_never_fire() -> None:
    records = scaled(healthy_stream(0), "entropy", entropy_collapse(100))
    config = enabled(objectives={"entropy_min_fraction": None, "entropy_slope_min": None})
    decisions = run(StabilityGuard(config), records)
    assert acted(decisions) == []
    assert broken_steps(decisions, "entropy_min_fraction", "entropy_slope_min") == []
    everything_off = enabled(objectives=dict.fromkeys(StabilityObjectives.model_fields))
    assert StabilityGuard(everything_off).objectives == ()
    bad = with_values(records, "nonfinite_tokens", {s: 9.0 for s in range(50, 60)})
    assert acted(run(StabilityGuard(everything_off), bad)) == []


# --- gradient-norm spikes, non-finite values ------------------------------------------------------


def test_a_single_gradient_spike_does_not_act_at_patience_3_but_three_in_a_row_do() -> None:
    one = run(StabilityGuard(enabled()), spikes(healthy_stream(2), [150]))
    assert acted(one) == []
    assert [b.objective for b in one[149].broken] == ["grad_norm_max_ratio"]
    two = run(StabilityGuard(enabled()), spikes(healthy_stream(2), [150, 151]))
    assert acted(two) == []
    three = acted(run(StabilityGuard(enabled()), spikes(healthy_stream(2), [150, 151, 152])))
    assert [(a.step, a.reason, a.since) for a in three] == [(152, "grad_norm_max_ratio", 150)]
    bound = StabilityObjectives().grad_norm_max_ratio
    assert bound is not None and three[0].value == 10.0 and three[0].bound == bound
    assert three[0].limit is not None and 0.4 * bound < three[0].limit < 0.6 * bound  # x ~0.5


def test_patience_1_acts_on_a_single_spike() -> None:
    actions = acted(run(StabilityGuard(enabled(patience=1)), spikes(healthy_stream(2), [150])))
    assert [(a.step, a.reason) for a in actions] == [(150, "grad_norm_max_ratio")]


def test_nonfinite_tokens_trigger() -> None:
    records = with_values(healthy_stream(3), "nonfinite_tokens", {200: 4.0, 201: 1.0, 202: 2.0})
    actions = acted(run(StabilityGuard(enabled()), records))
    assert [(a.step, a.reason, a.value, a.since) for a in actions] == [
        (202, "nonfinite_tokens_max", 2.0, 200)
    ]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_values_that_are_not_finite_break_their_objective_even_in_warmup(bad: float) -> None:
    records = with_values(healthy_stream(3), "grad_norm", {2: bad, 3: bad, 4: bad})
    actions = acted(run(StabilityGuard(enabled()), records))
    assert [(a.step, a.reason, a.limit) for a in actions] == [(4, "grad_norm_max_ratio", None)]
    assert "not finite" in actions[0].message


def test_nothing_but_a_value_that_is_not_finite_breaks_in_warmup() -> None:
    """The first warmup_steps records only form the baselines."""
    records = with_values(healthy_stream(3), "nonfinite_tokens", {s: 5.0 for s in range(1, 11)})
    decisions = run(StabilityGuard(enabled(warmup_steps=10)), records)
    assert broken_steps(decisions, "nonfinite_tokens_max") == []
    records = with_values(healthy_stream(3), "nonfinite_tokens", {s: 5.0 for s in range(1, 12)})
    decisions = run(StabilityGuard(enabled(warmup_steps=10)), records)
    assert broken_steps(decisions, "nonfinite_tokens_max") == [11]


# --- re-arming ------------------------------------------------------------------------------------


def test_the_guard_rearms_after_patience_clean_steps() -> None:
    # Clean 153, 154, 155: re-armed before the second burst at 160.
    records = spikes(healthy_stream(4), [150, 151, 152, 160, 161, 162])
    actions = acted(run(StabilityGuard(enabled()), records))
    assert [a.step for a in actions] == [152, 162]


def test_a_burst_before_patience_clean_steps_is_the_same_episode() -> None:
    # Clean 153, 154 only: the burst at 155 belongs to the episode that already acted.
    records = spikes(healthy_stream(4), [150, 151, 152, 155, 156, 157])
    decisions = run(StabilityGuard(enabled()), records)
    assert [a.step for a in acted(decisions)] == [152]
    assert decisions[156].broken and decisions[156].broken[0].streak == 3


def test_one_episode_seen_by_two_objectives_acts_once() -> None:
    records = spikes(healthy_stream(4), [150, 151, 152, 153])
    records = with_values(records, "nonfinite_tokens", {s: 3.0 for s in (151, 152, 153)})
    decisions = run(StabilityGuard(enabled()), records)
    assert [(a.step, a.reason) for a in acted(decisions)] == [(152, "grad_norm_max_ratio")]
    assert {b.objective for b in decisions[152].broken} == {
        "grad_norm_max_ratio",
        "nonfinite_tokens_max",
    }


# --- checkpoints ----------------------------------------------------------------------------------


def observe_with_checkpoints(
    guard: StabilityGuard, records: Iterable[Record], every: int
) -> list[GuardDecision]:
    decisions = []
    for record in records:
        decisions.append(guard.observe(record))
        if record["step"] % every == 0:
            guard.checkpointed(record["step"])
    return decisions


def test_a_checkpoint_is_healthy_once_patience_clean_steps_followed_it() -> None:
    guard = StabilityGuard(enabled())
    records = healthy_stream(5, steps=120)
    observe_with_checkpoints(guard, records[:102], every=100)
    assert guard.healthy_checkpoint() is None  # 101, 102: not yet patience (3) steps
    guard.observe(records[102])
    assert guard.healthy_checkpoint() == 100


def test_a_checkpoint_followed_by_a_broken_objective_within_patience_is_not_healthy() -> None:
    guard = StabilityGuard(enabled())
    records = spikes(healthy_stream(5, steps=140), [113])
    observe_with_checkpoints(guard, records[:119], every=10)
    # 110 was followed by a spike at 113 (within 3 steps); 100 and 120 were not. At 119 the
    # newest healthy one is still 100.
    assert guard.healthy_checkpoint() == 100
    observe_with_checkpoints(guard, records[119:], every=10)
    assert guard.healthy_checkpoint() == 130  # 140: the stream ended before 143


def test_under_staleness_a_checkpoint_is_judged_on_the_rollouts_its_own_policy_sampled() -> None:
    """At staleness 8 the step after a checkpoint of step 100 trains on rollouts of versions 92
    and on: clean steps 101-108 say nothing of it. Step 109 is the first whose whole batch its
    policy (version 100) or a later one sampled, so it is healthy after step 111; a broken
    objective at step 106, on older rollouts, spoils it all the same."""
    stale = [{**r, "staleness_max": 8} for r in healthy_stream(7, steps=130)]
    guard = StabilityGuard(enabled())
    observe_with_checkpoints(guard, stale[:110], every=100)
    assert guard.healthy_checkpoint() is None
    guard.observe(stale[110])  # step 111
    assert guard.healthy_checkpoint() == 100

    spoilt = StabilityGuard(enabled())
    observe_with_checkpoints(spoilt, spikes(stale, [106]), every=100)
    assert spoilt.healthy_checkpoint() is None
    # On policy (no staleness_max, or 0) the three steps after it judge it, as before.
    fresh = StabilityGuard(enabled())
    observe_with_checkpoints(fresh, [{**r, "staleness_max": 0} for r in stale[:103]], every=100)
    assert fresh.healthy_checkpoint() == 100


def test_a_checkpoint_half_judged_keeps_its_count_through_the_saved_state() -> None:
    stale = [{**r, "staleness_max": 8} for r in healthy_stream(7, steps=130)]
    guard = StabilityGuard(enabled())
    observe_with_checkpoints(guard, stale[:110], every=100)  # 109, 110 judged it: 2 of 3
    restored = StabilityGuard.from_state(enabled(), guard.state())
    restored.observe(stale[110])
    assert restored.healthy_checkpoint() == 100


def test_a_checkpoint_during_an_open_objective_becomes_healthy_only_after_it_holds() -> None:
    """Held-out accuracy dropped at step 50 and is evaluated again only at 60: the steps between
    keep the objective open, so a checkpoint at 52 is not healthy, one at 60 is."""
    records = with_values(healthy_stream(6, steps=70), "eval_accuracy_avg_at_k", {50: 0.0})
    guard = StabilityGuard(enabled())
    for record in records:
        guard.observe(record)
        if record["step"] in (52, 60):
            guard.checkpointed(record["step"])
        if record["step"] == 59:
            assert guard.healthy_checkpoint() is None
    assert guard.healthy_checkpoint() == 60


def test_wants_a_checkpoint_at_the_first_warning_without_a_recent_healthy_one() -> None:
    guard = StabilityGuard(enabled(max_healthy_age_steps=50))
    records = spikes(healthy_stream(7), [30, 31, 140, 141, 200])
    wanted = []
    for record in records:
        step = record["step"]
        guard.observe(record)
        if guard.wants_checkpoint(step):
            wanted.append(step)
            guard.checkpointed(step)
            assert not guard.wants_checkpoint(step)  # written: asked once
        if step == 100:
            guard.checkpointed(step)
    # 30: none healthy yet (30's own is spoilt by 31); 140: the newest healthy (100) is 40
    # steps old; 200: it is 100 steps old.
    assert wanted == [30, 200]
    assert guard.healthy_checkpoint() == 200


def test_wants_no_checkpoint_after_the_first_step_of_an_episode() -> None:
    guard = StabilityGuard(enabled())
    records = spikes(healthy_stream(7), [30, 31, 32])
    decisions = run(guard, records[:31])
    assert decisions[29].broken and not guard.wants_checkpoint(31)


# --- rollbacks ------------------------------------------------------------------------------------


def test_rollbacks_stop_the_run_as_unstable_after_max_rollbacks() -> None:
    bursts = [s for start in (100, 130, 160, 190) for s in range(start, start + 3)]
    guard = StabilityGuard(enabled(action="rollback", max_rollbacks=2))
    decisions = observe_with_checkpoints(guard, spikes(healthy_stream(8), bursts), every=20)
    actions = acted(decisions)
    assert [(a.step, a.action, a.rollbacks) for a in actions] == [
        (102, "rollback", 1),
        (132, "rollback", 2),
        (162, "stop_unstable", 2),
        (192, "stop_unstable", 2),
    ]
    assert [a.rollback_to for a in actions] == [80, 120, None, None]
    assert actions[2].reason == "grad_norm_max_ratio"
    assert "unstable after 2 rollbacks" in actions[2].message
    assert guard.rollbacks == 2


def test_a_guard_restored_from_its_healthy_checkpoint_goes_on_from_there() -> None:
    # As the driver does it: the guard saved with each checkpoint; at a rollback, the one of
    # the healthy checkpoint comes back, told of the rollback, and judges the steps again.
    config = enabled(action="rollback", max_rollbacks=3)
    records = spikes(healthy_stream(8), range(100, 103))
    guard = StabilityGuard(config)
    saved: dict[int, dict[str, Any]] = {}
    for record in records[:102]:
        decision = guard.observe(record)
        if record["step"] % 20 == 0:
            guard.checkpointed(record["step"])
            saved[record["step"]] = json.loads(json.dumps(guard.state()))
    assert (decision.action, decision.rollback_to, decision.rollbacks) == ("rollback", 80, 1)
    assert guard.kept_checkpoints() == (80,)  # 100 spoilt by the broken steps after it
    back = StabilityGuard.from_state(config, saved[80])
    assert back.kept_checkpoints() == (60, 80)  # as saved: 80 pending then
    back.rolled_back(80, decision.rollbacks)
    assert back.rollbacks == 1 and back.healthy_checkpoint() == 80
    assert back.kept_checkpoints() == (80,)
    assert not back.wants_checkpoint(81)
    # The same steps again: healthy ones pass, the spike acts again, now the second rollback.
    again = run(back, records[80:102])
    assert [(a.step, a.action, a.rollback_to, a.rollbacks) for a in acted(again)] == [
        (102, "rollback", 80, 2)
    ]
    # Without the spike the steps after the checkpoint are clean and it stays healthy.
    calm = StabilityGuard.from_state(config, saved[80])
    calm.rolled_back(80, 1)
    assert acted(run(calm, healthy_stream(8)[80:140])) == []
    assert calm.healthy_checkpoint() == 80 and calm.rollbacks == 1


def test_a_rollback_to_step_0_leaves_no_healthy_checkpoint() -> None:
    guard = StabilityGuard(enabled(action="rollback"))
    guard.rolled_back(None, 1)
    assert guard.healthy_checkpoint() is None and guard.kept_checkpoints() == ()
    assert guard.rollbacks == 1


def test_no_rollbacks_allowed_stops_at_the_first_episode() -> None:
    guard = StabilityGuard(enabled(action="rollback", max_rollbacks=0))
    actions = acted(run(guard, spikes(healthy_stream(8), [100, 101, 102])))
    assert [(a.step, a.action) for a in actions] == [(102, "stop_unstable")]


@pytest.mark.parametrize("action", ["warn", "pause", "cancel"])
def test_the_other_actions_are_the_specs_and_never_count_rollbacks(action: str) -> None:
    bursts = [s for start in (100, 130, 160) for s in range(start, start + 3)]
    guard = StabilityGuard(enabled(action=action, max_rollbacks=0))
    actions = acted(run(guard, spikes(healthy_stream(8), bursts)))
    assert [a.action for a in actions] == [action] * 3
    assert guard.rollbacks == 0


# --- pause and resume -----------------------------------------------------------------------------


def paused_at_102(bursts: Iterable[int]) -> tuple[StabilityConfig, list[Record], dict[str, Any]]:
    """A pausing guard over the healthy stream with spikes at `bursts`, checkpointed every 20
    steps and at the pause (step 102, as the driver does): its config, the records, and the
    state saved with the pause's checkpoint."""
    config = enabled(action="pause")
    records = spikes(healthy_stream(8), bursts)
    guard = StabilityGuard(config)
    decisions = observe_with_checkpoints(guard, records[:102], every=20)
    assert [(a.step, a.action, a.since) for a in acted(decisions)] == [(102, "pause", 100)]
    guard.checkpointed(102)
    return config, records, json.loads(json.dumps(guard.state()))


def test_after_a_resume_the_guard_acts_again_only_after_patience_more_broken_steps() -> None:
    # The spikes go on after the pause: the patch did not help.
    config, records, saved = paused_at_102(range(100, 110))
    resumed = StabilityGuard.from_state(config, saved)
    resumed.resumed(102)
    actions = acted(run(resumed, records[102:110]))
    # 103, 104, 105 broken anew: it acts at the third, not at the first.
    assert [(a.step, a.action, a.since) for a in actions] == [(105, "pause", 103)]
    # Without the resume the episode that acted would still be open: no second action.
    unresumed = StabilityGuard.from_state(config, saved)
    assert acted(run(unresumed, records[102:110])) == []


def test_a_resume_keeps_the_healthy_checkpoint_and_judges_the_pauses_on_its_own() -> None:
    config, records, saved = paused_at_102(range(100, 103))
    resumed = StabilityGuard.from_state(config, saved)
    assert resumed.healthy_checkpoint() == 80  # 100 spoilt by the spikes after it
    resumed.resumed(102)
    assert resumed.healthy_checkpoint() == 80
    assert resumed.kept_checkpoints() == (80, 102)  # the pause's checkpoint: not judged yet
    run(resumed, records[102:104])
    assert resumed.healthy_checkpoint() == 80  # two clean steps after it: not yet patience
    run(resumed, records[104:105])
    assert resumed.healthy_checkpoint() == 102
    assert acted(run(resumed, healthy_stream(8)[105:200])) == []


def test_a_resumed_guards_state_round_trips() -> None:
    config, records, saved = paused_at_102(range(100, 106))
    resumed = StabilityGuard.from_state(config, saved)
    resumed.resumed(102)
    run(resumed, records[102:104])
    again = StabilityGuard.from_state(config, json.loads(json.dumps(resumed.state())))
    assert again.state() == resumed.state()
    assert run(again, records[104:120]) == run(resumed, records[104:120])


# --- missing keys ---------------------------------------------------------------------------------


def test_missing_keys_are_skipped() -> None:
    guard = StabilityGuard(enabled(warmup_steps=0))
    assert acted(run(guard, [{"step": s} for s in range(1, 50)])) == []
    # Entropy collapses in records that do not carry it: nothing is judged.
    records = scaled(healthy_stream(0), "entropy", entropy_collapse(100))
    without = [{k: v for k, v in r.items() if k != "entropy" or r["step"] <= 100} for r in records]
    decisions = run(StabilityGuard(enabled()), without)
    assert acted(decisions) == []
    assert broken_steps(decisions, "entropy_min_fraction", "entropy_slope_min") == []


def test_a_missing_key_neither_breaks_nor_resets_a_streak() -> None:
    """Held-out accuracy is in every tenth record: three evaluations in a row below the best
    act at the third, the records between carrying no verdict."""
    drops = {200: 0.1, 210: 0.1, 220: 0.1}
    records = with_values(healthy_stream(9), "eval_accuracy_avg_at_k", drops)
    decisions = run(StabilityGuard(enabled()), records)
    actions = acted(decisions)
    assert [(a.step, a.reason, a.since) for a in actions] == [(220, "held_out_drop_max", 200)]
    assert broken_steps(decisions, "held_out_drop_max") == [200, 210, 220]
    two = with_values(healthy_stream(9), "eval_accuracy_avg_at_k", {200: 0.1, 210: 0.1})
    assert acted(run(StabilityGuard(enabled()), two)) == []


def test_the_switch_frequency_is_judged_only_with_kpos_gain() -> None:
    unfiltered = {s: 0.45 for s in range(100, 110)}
    records = with_values(healthy_stream(10), "filtered_switch_frequency", unfiltered)
    actions = acted(run(StabilityGuard(enabled()), records))
    assert [(a.step, a.reason) for a in actions] == [(102, "switch_frequency_max")]
    grpo = [{k: v for k, v in r.items() if k != "kalman_gain_mean"} for r in records]
    assert acted(run(StabilityGuard(enabled()), grpo)) == []


# --- state ----------------------------------------------------------------------------------------


def test_the_state_round_trips_mid_stream_to_identical_later_decisions() -> None:
    records = spikes(healthy_stream(11), [60, 61, 62])
    records = scaled(records, "entropy", entropy_collapse(150))
    # The entropy bounds the split below was chosen for (a tighter fraction breaks earlier).
    entropy = {"entropy_min_fraction": 0.5, "entropy_slope_min": -0.02}
    config = enabled(action="rollback", max_rollbacks=1, objectives=entropy)
    guard = StabilityGuard(config)
    split = 157  # mid-collapse: two objectives broken twice in a row, the action not yet taken
    before = observe_with_checkpoints(guard, records[:split], every=25)
    assert [a.action for a in acted(before)] == ["rollback"]  # the spikes at 60-62
    assert [b.streak for b in before[-1].broken] == [2, 2]
    saved = json.loads(json.dumps(guard.state(), allow_nan=False))
    restored = StabilityGuard.from_state(config, saved)
    assert restored.state() == guard.state()
    later = observe_with_checkpoints(guard, records[split:], every=25)
    again = observe_with_checkpoints(restored, records[split:], every=25)
    assert again == later
    assert restored.state() == guard.state()
    assert [a.action for a in acted(later)] == ["stop_unstable"]
    # A guard that started afresh at the split decides otherwise: the state carried something.
    fresh = observe_with_checkpoints(StabilityGuard(config), records[split:], every=25)
    assert fresh != later


def test_a_state_of_another_version_is_refused() -> None:
    state = StabilityGuard(enabled()).state()
    with pytest.raises(ValueError, match="version 0, expected 1"):
        StabilityGuard.from_state(enabled(), {**state, "version": 0})


def test_an_objective_switched_off_on_resume_is_dropped_one_switched_on_starts_afresh() -> None:
    guard = StabilityGuard(enabled(objectives={"reward_drop_max": None}))
    run(guard, healthy_stream(12, steps=50))
    config = enabled(objectives={"grad_norm_max_ratio": None})
    restored = StabilityGuard.from_state(config, guard.state())
    objectives = restored.state()["objectives"]
    assert "grad_norm_max_ratio" not in objectives
    assert objectives["reward_drop_max"]["baseline"] == []
    assert objectives["entropy_min_fraction"] == guard.state()["objectives"]["entropy_min_fraction"]


def test_record_values_are_read_as_numbers_and_anything_else_as_missing() -> None:
    assert number(3) == 3.0 and number(0.5) == 0.5 and number(math.nan) is not None
    assert number(None) is None and number(True) is None and number("0.5") is None
    assert number([1.0]) is None
