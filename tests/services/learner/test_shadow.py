"""Shadow estimators (`algorithm.shadow`) on the random tiny model: computed on the live batch,
they never change training, and each reports what a learner training with it reports.

Real steps of `LearnerCore` on groups the tiny model sampled; the 2-rank case is a real FSDP2
group on gloo (forked ranks, tests/services/learner/ranks.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from kpo_core.config import (
    ESTIMATOR_NAMES,
    MAX_SHADOW_ESTIMATORS,
    AlgorithmConfig,
    KalmanEstimator,
    describe_validation_error,
)
from kpo_core.diagnostics import DIAGNOSTIC_SCALARS
from services.learner.distributed import RankGroup
from services.learner.step import LearnerCore
from services.messages import ScoredGroup
from services.metrics import BY_KEY, SHADOW_ESTIMATORS, SHADOW_KEYS, Kind, MetricKey, Source
from services.spec import RunSpec
from tests.services.learner.conftest import MAX_NEW_TOKENS, make_core, sample_groups
from tests.services.learner.ranks import run_ranks

REPO = Path(__file__).resolve().parents[3]
DASHBOARD_JS = REPO / "services" / "api" / "static" / "dashboard.js"
# The other estimators, as `algorithm.shadow` lists them beside KPO.
BESIDE_KPO = ["token", "sequence", "geometric", "cumulative"]
# What a shadow estimator reports that a learner training with it reports under the same key.
LOSS_KEYS = ("policy_loss", "clip_fraction", "ratio_mean", "ratio_max", "ratio_min")
KALMAN_KEYS = ("kalman_gain_mean", "kalman_shrinkage_mean", "filtered_ratio_mean")


def shadow_keys(record: dict[str, float]) -> set[str]:
    return {key for key in record if key.startswith("shadow_")}


def training_keys(record: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in record.items() if not key.startswith("shadow_")}


@pytest.fixture(scope="module")
def stale_groups(tiny_model_dir: Path) -> list[ScoredGroup]:
    """Groups sampled at temperature 0.7 and trained at 1: ratios far from 1 from the first step
    on, so that every estimator clips some tokens and its diagnostics are not trivial."""
    return sample_groups(tiny_model_dir, temperature=0.7)


def parameters(core: LearnerCore) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in core.model.named_parameters()}


# --- shadows never change training ----------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"estimator": "kalman"},
        {"estimator": "token", "reference": "proximal", "minibatches": 2, "ppo_epochs": 2},
    ],
    ids=["kalman", "token-proximal-2x2"],
)
def test_a_learner_with_shadows_trains_bitwise_as_one_without(
    tiny_model_dir: Path, stale_groups: list[ScoredGroup], settings: dict[str, Any]
) -> None:
    others = [name for name in ESTIMATOR_NAMES if name != settings["estimator"]]
    plain = make_core(tiny_model_dir, **settings)
    shadowed = make_core(tiny_model_dir, algorithm={"shadow": others}, **settings)
    for _ in range(3):  # from the second step on the batch is stale: ratios are not 1
        expected, got = plain.train_step(stale_groups), shadowed.train_step(stale_groups)
        assert training_keys(got) == expected  # every training key, bitwise
        # Every declared key of the listed estimators, and no other.
        assert shadow_keys(got) == {key for key in SHADOW_KEYS if key.split("_")[1] in others}
        after, before = parameters(shadowed), parameters(plain)
        assert after.keys() == before.keys()
        assert all(torch.equal(after[name], before[name]) for name in before)
        shadowed_state = shadowed.optimizer.state_dict()["state"]
        for index, state in plain.optimizer.state_dict()["state"].items():
            assert all(torch.equal(v, shadowed_state[index][k]) for k, v in state.items())


def test_without_shadows_the_record_has_none(tiny_model_dir: Path, groups: list[Any]) -> None:
    core = make_core(tiny_model_dir)
    assert core.shadows == ()
    assert not shadow_keys(core.train_step(groups))


# --- each shadow is what training with it reports -------------------------------------------


def assert_reports_as_trained(
    shadowed: dict[str, float], trained: dict[str, float], name: str
) -> None:
    """The shadow `name`'s keys of one record against the training keys of a learner that
    trained with `name` on the same batch from the same weights."""
    keys = [*LOSS_KEYS, *(KALMAN_KEYS if name == "kalman" else ())]
    for key in keys:
        expected = pytest.approx(trained[key], rel=1e-6, abs=1e-9)
        assert shadowed[f"shadow_{name}_{key}"] == expected, (name, key)
    for scalar in DIAGNOSTIC_SCALARS:  # of the estimator's ratio: the `filtered_` stage
        expected = pytest.approx(trained[f"filtered_{scalar}"], rel=1e-6, abs=1e-9)
        assert shadowed[f"shadow_{name}_{scalar}"] == expected, (name, scalar)
    written = {key for key in shadowed if key.startswith(f"shadow_{name}_")}
    declared = {key for key in SHADOW_KEYS if key.startswith(f"shadow_{name}_")}
    assert written == declared  # and nothing else of it


CASES = {
    "kpo-beside-the-others": ({"estimator": "kalman"}, {"shadow": BESIDE_KPO}),
    # KPO as a shadow: its `reference_length: auto` resolves to the response limit too.
    "kpo-as-shadow-proximal-micro-batches": (
        {"estimator": "token", "reference": "proximal", "micro_batch_tokens": 64},
        {"shadow": ["kalman", "sequence"], "off_policy": {"tis_cap": 1.5}},
    ),
    "explicit-aggregation": (
        {"estimator": "geometric"},
        {"shadow": ["token", "kalman"], "loss_agg_mode": "seq-mean-token-sum-norm"},
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_each_shadow_reports_what_training_with_it_reports(
    tiny_model_dir: Path, stale_groups: list[ScoredGroup], case: str
) -> None:
    settings, algorithm = CASES[case]
    shadowed = make_core(tiny_model_dir, algorithm=algorithm, **settings)
    record = shadowed.train_step(stale_groups)
    assert record["micro_batches"] >= (3.0 if "micro_batch_tokens" in settings else 1.0)
    common = {key: value for key, value in algorithm.items() if key != "shadow"}
    for name in algorithm["shadow"]:
        trained = make_core(tiny_model_dir, **{**settings, "estimator": name}, algorithm=common)
        reported = trained.train_step(stale_groups)
        assert_reports_as_trained(record, reported, name)
        # Against the behaviour log-probs of another temperature, every estimator clips some
        # tokens (a first step's proximal reference is the weights themselves: ratios 1, no
        # clipping; the behaviour weights differ there).
        if settings.get("reference") != "proximal":
            assert reported["clip_fraction"] > 0, name


def test_shadows_drop_the_tokens_the_training_loss_drops(
    tiny_model_dir: Path, stale_groups: list[ScoredGroup]
) -> None:
    first = stale_groups[0].responses[0]
    logprobs = list(first.response.behaviour_logprobs)
    logprobs[1] = math.nan
    response = dataclasses.replace(first.response, behaviour_logprobs=logprobs)
    broken = [
        ScoredGroup(
            stale_groups[0].prompt,
            [dataclasses.replace(first, response=response), *stale_groups[0].responses[1:]],
        ),
        *stale_groups[1:],
    ]
    shadowed = make_core(tiny_model_dir, algorithm={"shadow": BESIDE_KPO})
    record = shadowed.train_step(broken)
    assert record["nonfinite_tokens"] == 1.0
    assert all(math.isfinite(record[key]) for key in shadow_keys(record))
    for name in BESIDE_KPO:
        trained = make_core(tiny_model_dir, name).train_step(broken)
        assert_reports_as_trained(record, trained, name)


def test_the_kpo_shadow_matches_its_constants_to_the_response_limit(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir, "token", algorithm={"shadow": ["kalman", "sequence"]})
    kalman, sequence = core.shadows
    assert isinstance(kalman, KalmanEstimator)
    assert kalman.reference_length == MAX_NEW_TOKENS
    assert sequence.name == "sequence"
    # What a learner group hands its ranks: resolved already, no response length given.
    resolved = core.algorithm.with_response_length(None)
    assert resolved is core.algorithm and resolved.shadow_estimators == core.shadows
    unresolved = AlgorithmConfig.model_validate(
        {"estimator": {"name": "token"}, "shadow": ["kalman"]}
    )
    with pytest.raises(ValueError, match=r"generation\.max_new_tokens is not set"):
        unresolved.with_response_length(None)


# --- a learner group of 2 ranks -------------------------------------------------------------


def one_step(
    group: RankGroup | None, model_dir: Path, groups: list[ScoredGroup]
) -> dict[str, float]:
    core = make_core(model_dir, group=group, algorithm={"shadow": BESIDE_KPO})
    return core.train_step(groups)


def test_two_ranks_report_the_shadows_of_one(
    tiny_model_dir: Path, stale_groups: list[ScoredGroup]
) -> None:
    single = one_step(None, tiny_model_dir, stale_groups)
    ranks = run_ranks(one_step, 2, tiny_model_dir, stale_groups)
    assert ranks[1] == {}  # the group's record is rank 0's
    two = ranks[0]
    assert two["learner_world_size"] == 2.0
    assert two.keys() == single.keys()
    assert shadow_keys(single) == {k for k in SHADOW_KEYS if not k.startswith("shadow_kalman_")}
    # Sharding changes the summation order only (tests/services/learner/test_group_equivalence):
    # float32 round-off; the loss of terms of order 1 that cancel, to 1e-5 of their scale.
    for key in shadow_keys(single):
        margin = 1e-5 if key.endswith("_policy_loss") else 1e-9
        assert two[key] == pytest.approx(single[key], rel=1e-5, abs=margin), key


# --- the spec ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shadow", "problem"),
    [
        (["token", "kalman"], "lists the training estimator 'kalman'"),
        (["token", "sequence", "token"], "lists 'token' more than once"),
        (["ppo"], "Input should be 'token', 'sequence', 'geometric', 'kalman' or 'cumulative'"),
        (["token"] * (MAX_SHADOW_ESTIMATORS + 1), "at most 5 items"),
        ("token", "Input should be a valid tuple"),
    ],
)
def test_a_bad_shadow_list_is_refused_naming_algorithm_shadow(shadow: Any, problem: str) -> None:
    with pytest.raises(ValidationError) as error:
        RunSpec.model_validate({"algorithm": {"estimator": {"name": "kalman"}, "shadow": shadow}})
    message = describe_validation_error(error.value, "run.yaml")
    assert re.search(r"^run\.yaml: algorithm\.shadow(\.\d+)?: ", message), message
    assert problem in message
    assert len(message.splitlines()) == 1, message


def test_a_shadow_list_is_accepted_and_kept_as_names() -> None:
    spec = RunSpec.model_validate(
        {"algorithm": {"estimator": {"name": "token"}, "shadow": ["kalman", "cumulative"]}}
    )
    assert spec.algorithm.shadow == ("kalman", "cumulative")
    assert spec.model_dump(mode="json")["algorithm"]["shadow"] == ["kalman", "cumulative"]
    assert [s.name for s in spec.algorithm.shadow_estimators] == ["kalman", "cumulative"]
    assert RunSpec().algorithm.shadow == ()


# --- the metrics declaration ------------------------------------------------------------------


def test_the_declared_shadow_estimators_are_those_of_the_config_and_dashboard() -> None:
    assert SHADOW_ESTIMATORS == ESTIMATOR_NAMES
    script = DASHBOARD_JS.read_text(encoding="utf-8")
    block = re.search(r"const SHADOW_ESTIMATORS = \{(.*?)\};", script, re.DOTALL)
    assert block, "no SHADOW_ESTIMATORS in dashboard.js: update this test's pattern"
    assert tuple(re.findall(r"(\w+): \"#", block.group(1))) == ESTIMATOR_NAMES
    # The shadow charts draw declared keys of every estimator.
    charts = re.findall(r'shadowChart\("[^"]+", "[^"]+", "([^"]+)", "([^"]+)"\)', script)
    assert len(charts) == 3
    for training, key in charts:
        assert BY_KEY[training].source is Source.LEARNER
        for name in ESTIMATOR_NAMES:
            assert f"shadow_{name}_{key}" in BY_KEY


def test_every_shadow_key_is_the_learners_and_a_gauge_or_record_only() -> None:
    for key in SHADOW_KEYS:
        metric = BY_KEY[key]
        assert metric.source is Source.LEARNER and metric.kind in (Kind.GAUGE, Kind.RECORD)
        assert metric.shadowed and key.startswith("shadow_") and not metric.staged


@pytest.mark.parametrize(
    ("kind", "name", "staged", "shadowed", "problem"),
    [
        (Kind.RECORD, None, False, ("ppo",), "unknown estimators ['ppo']"),
        (Kind.GAUGE, "kpo_x", True, ("token",), "staged or shadowed, not both"),
        (Kind.COUNTER, "kpo_x_total", False, ("token",), "a gauge or record-only"),
    ],
)
def test_a_bad_shadow_declaration_is_refused(
    kind: Kind, name: str | None, staged: bool, shadowed: tuple[str, ...], problem: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        MetricKey("x", kind, "", "h", Source.LEARNER, name, staged=staged, shadowed=shadowed)
