"""The stability guard's defaults on the stability study's recorded runs.

The runs' metric streams (docs/results/<study>/metrics of the studies in REPLAYED) are replayed
through the guard (benchmarks/stability_study/guard_replay.py): nothing acted on the runs
themselves. The spec's defaults must act on no healthy run, act on the collapsing runs within
`patience` evaluations of the objective's first break, and be the bounds that the derivation
gives from the data.
"""

from __future__ import annotations

from collections import Counter

import pytest

from services.pipeline.guard import OBJECTIVE_COMPARISONS, Comparison, GuardDecision
from services.spec import StabilityConfig, StabilityObjectives
from stability_study.guard_replay import (
    AT_RISK,
    COLLAPSING,
    FLOORS,
    HEALTHY,
    RecordedRun,
    derive_defaults,
    first_action,
    guard_config,
    load_runs,
    only,
    replay,
)
from stability_study.summary import DID_NOT_LEARN, LEARNED

RUNS = load_runs()
HEALTHY_RUNS = [r for r in RUNS if r.group == HEALTHY]
COLLAPSING_RUNS = [r for r in RUNS if r.group == COLLAPSING]
DEFAULTS = StabilityConfig.model_validate({"enabled": True})

# The collapsing run the defaults miss: KPO with the paper's constants, collapsed by the
# criterion only at step 20 of a 20-step run, when its reward, entropy, truncation and KL to the
# behaviour policy all stay within the healthy runs' ranges.
MISSED = {"arms-reduced kpo-paper__lr3e-4-stale-8 s1"}
LATE = (
    "the criterion calls these runs collapsed at the study's first held-out evaluation (step "
    "10), within the guard's 10 warm-up steps; the stale batches' reward shows it 3 or more "
    "steps later"
)


def action_of(run: RecordedRun) -> GuardDecision | None:
    return first_action(replay(run.records, DEFAULTS))


def test_the_runs_are_classified_as_the_study_reported() -> None:
    """docs/results.md: the arms without a trust region collapse under lr 3e-4 and staleness 8
    (6/6 and 5/6 in the full study, 3/3 and 3/3 in the reduced run), and one reduced KPO-paper
    seed; nothing else collapsed."""
    collapsed = Counter((r.study, r.result.cell.key) for r in COLLAPSING_RUNS)
    assert collapsed == {
        ("study", "kpo-q0__lr3e-4-stale-8"): 6,
        ("study", "kpo-matched-unclipped__lr3e-4-stale-8"): 5,
        ("arms-reduced", "kpo-q0__lr3e-4-stale-8"): 3,
        ("arms-reduced", "kpo-matched-unclipped__lr3e-4-stale-8"): 3,
        ("arms-reduced", "kpo-paper__lr3e-4-stale-8"): 1,
    }
    assert {r.outcome.kind for r in HEALTHY_RUNS} == {LEARNED, DID_NOT_LEARN}
    assert len(HEALTHY_RUNS) == 141
    assert [r.name for r in RUNS if r.group == AT_RISK] == [
        "arms-reduced kpo-paper__lr3e-4-stale-8 s0",
        "arms-reduced kpo-paper__lr3e-4-stale-8 s2",
        "study kpo-matched-unclipped__lr3e-4-stale-8 s2",
    ]
    assert all(r.collapse_step is not None for r in COLLAPSING_RUNS)


@pytest.mark.parametrize("run", HEALTHY_RUNS, ids=lambda r: r.name)
def test_the_defaults_act_on_no_healthy_recorded_run(run: RecordedRun) -> None:
    assert action_of(run) is None


@pytest.mark.parametrize(
    "run",
    [
        pytest.param(
            r,
            id=r.name,
            marks=[pytest.mark.xfail(strict=True, reason="no default bound separates it")]
            if r.name in MISSED
            else [],
        )
        for r in COLLAPSING_RUNS
    ],
)
def test_the_defaults_act_on_each_collapsing_recorded_run_within_patience(
    run: RecordedRun,
) -> None:
    action = action_of(run)
    assert action is not None
    assert action.since is not None
    assert action.step - action.since + 1 == DEFAULTS.patience
    assert action.step < max(int(record["step"]) for record in run.records)


@pytest.mark.parametrize(
    "run",
    [pytest.param(r, id=r.name) for r in COLLAPSING_RUNS if r.name not in MISSED],
)
@pytest.mark.xfail(strict=True, reason=LATE)
def test_the_defaults_act_before_the_collapse_criterion_judges_it(run: RecordedRun) -> None:
    """The collapse point: the first evaluation step at which summary.py, given the run up to
    there, classifies it collapsed."""
    action = action_of(run)
    assert action is not None and run.collapse_step is not None
    assert action.step < run.collapse_step


def test_the_spec_defaults_are_the_bounds_derived_from_the_healthy_runs() -> None:
    derived = derive_defaults(HEALTHY_RUNS)
    spec = StabilityObjectives().model_dump()
    assert set(derived) == set(spec)
    for name, derivation in derived.items():
        if derivation.extreme is None:  # no recorded run carries the key: the spec's stays
            assert name == "nonfinite_tokens_max" and spec[name] == 0.0
            continue
        assert spec[name] == derivation.bound, name
        floor = OBJECTIVE_COMPARISONS[name][1] in FLOORS
        assert spec[name] < derivation.extreme if floor else spec[name] > derivation.extreme


@pytest.mark.parametrize("name", [n for n in OBJECTIVE_COMPARISONS if n != "nonfinite_tokens_max"])
def test_a_bound_just_inside_the_healthy_extreme_acts_on_the_run_it_came_from(
    name: str,
) -> None:
    """The derivation measures what the guard compares: one step tighter than the extreme,
    the guard acts on the healthy run that held it."""
    derivation = derive_defaults(HEALTHY_RUNS)[name]
    assert derivation.extreme is not None and derivation.run is not None
    comparison = OBJECTIVE_COMPARISONS[name][1]
    tighter = derivation.extreme + (1e-6 if comparison in FLOORS else -1e-6)
    if comparison is Comparison.SLOPE:
        tighter = min(tighter, -1e-9)
    (run,) = [r for r in HEALTHY_RUNS if r.name == derivation.run]
    bounds = only(StabilityObjectives().model_dump(), name) | {name: tighter}
    action = first_action(replay(run.records, guard_config(bounds)))
    assert action is not None and action.reason == name
