"""services/metrics.py: the one declaration of the metrics record, against what writes and reads it.

Writers: a real learner step on the committed tiny model, and the driver's `_on_trained` called on
a real `RunDriver` (no actors). Readers: the Prometheus export, the web dashboard, the docs table.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import metrics_table
import pytest

from kpo_core.config import AlgorithmConfig
from services.api import prometheus
from services.learner.step import LearnerCore
from services.messages import Response
from services.metrics import (
    BY_KEY,
    EVAL_KEYS,
    FAULT_COUNTERS,
    GUARD_KEYS,
    LEARNER_TOTALS,
    RECORD,
    REPLAY_KEYS,
    SHADOW_KEYS,
    STALENESS_AUTO_KEYS,
    TOOL_KEYS,
    Kind,
    MetricKey,
    Source,
    markdown_table,
)
from services.pipeline import calls, driver
from services.pipeline.outputs import RunDirectory
from services.spec import LearnerConfig
from services.tasks.models import resolve_model
from services.tools.metrics import tool_metrics
from tests.services.learner.conftest import MAX_NEW_TOKENS, sample_groups
from tests.services.pipeline.conftest import tiny_spec

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_JS = REPO / "services" / "api" / "static" / "dashboard.js"
# Declared as the learner's, but not written by it yet (the learner group's rewrite adds them);
# drop a key from here once the learner writes it.
NOT_YET_EMITTED = {"micro_batches", "learner_world_size"}
# Written by the learner's actor around its core's step (a step has none before it): checked by
# tests/services/learner/test_publish_actor.py, and the publish's by test_delta_publish.py.
ACTOR_KEYS = {
    "learner_idle_seconds",
    "publish_seconds",
    "publish_bytes",
    "publish_changed_fraction",
}
# The exported names as deploy/ (Grafana dashboard, Prometheus rules) reads them: (kind, name,
# record key). Spelled out on purpose: renaming an exported metric must fail a test.
EXPORTED = {
    ("gauge", "kpo_tool_calls_per_response", "tool_calls_per_response"),
    ("gauge", "kpo_tool_error_ratio", "tool_error_fraction"),
    ("gauge", "kpo_turns_mean", "turns_mean"),
    ("gauge", "kpo_observation_token_ratio", "observation_token_fraction"),
    ("gauge", "kpo_reward_mean", "reward_mean"),
    ("gauge", "kpo_accuracy_ratio", "accuracy"),
    ("gauge", "kpo_eval_accuracy_avg_at_k_ratio", "eval_accuracy_avg_at_k"),
    ("gauge", "kpo_eval_pass_at_k_ratio", "eval_pass_at_k"),
    ("gauge", "kpo_entropy_nats", "entropy"),
    ("gauge", "kpo_clip_fraction_ratio", "clip_fraction"),
    ("gauge", "kpo_policy_loss", "policy_loss"),
    ("gauge", "kpo_kl_nats", "approx_kl"),
    ("gauge", "kpo_grad_norm", "grad_norm"),
    ("gauge", "kpo_policy_version", "policy_version"),
    ("gauge", "kpo_staleness_mean", "staleness_mean"),
    ("gauge", "kpo_staleness_max", "staleness_max"),
    ("gauge", "kpo_buffer_groups", "buffer_groups"),
    ("gauge", "kpo_staleness_bound", "staleness_bound"),
    ("counter", "kpo_staleness_bound_changes_total", "staleness_bound_changes_total"),
    ("gauge", "kpo_last_step_timestamp_seconds", "time"),
    ("stage gauge", "kpo_ratio_switch_frequency_ratio", "switch_frequency"),
    ("stage gauge", "kpo_ratio_low_frequency_ratio", "low_frequency_ratio"),
    ("shadow gauge", "kpo_shadow_policy_loss", "policy_loss"),
    ("shadow gauge", "kpo_shadow_clip_fraction_ratio", "clip_fraction"),
    ("shadow gauge", "kpo_shadow_ratio_switch_frequency_ratio", "switch_frequency"),
    ("shadow gauge", "kpo_shadow_ratio_low_frequency_ratio", "low_frequency_ratio"),
    ("counter", "kpo_tokens_generated_total", "tokens_generated_total"),
    ("counter", "kpo_tokens_trained_total", "tokens_trained_total"),
    ("counter", "kpo_rollouts_dropped_stale_total", "rollouts_dropped_stale"),
    ("counter", "kpo_groups_dropped_stale_total", "groups_dropped_stale"),
    ("counter", "kpo_rollouts_dropped_invalid_total", "rollouts_dropped_invalid"),
    ("counter", "kpo_groups_dropped_invalid_total", "groups_dropped_invalid"),
    ("counter", "kpo_prompts_too_long_total", "prompts_too_long"),
    ("counter", "kpo_nonfinite_rewards_total", "nonfinite_rewards_total"),
    ("counter", "kpo_nonfinite_tokens_total", "nonfinite_tokens_total"),
    ("counter", "kpo_extreme_ratio_tokens_total", "extreme_ratio_tokens_total"),
    ("counter", "kpo_skipped_minibatches_total", "skipped_minibatches_total"),
    ("counter", "kpo_learner_restarts_total", "learner_restarts"),
    ("counter", "kpo_generation_replacements_total", "generation_replacements"),
    ("counter", "kpo_standby_promotions_total", "standby_promotions"),
    ("counter", "kpo_verifier_replacements_total", "verifier_replacements"),
    ("counter", "kpo_rescored_groups_total", "rescored_groups"),
    ("counter", "kpo_unverified_groups_total", "unverified_groups"),
    ("gauge", "kpo_guard_broken_objectives", "guard_broken_objectives"),
    ("event counter", "kpo_guard_actions_total", "guard_actions_total"),
    ("gauge", "kpo_guard_rollbacks", "guard_rollbacks"),
    ("counter", "kpo_rollouts_rolled_back_total", "rollouts_rolled_back_total"),
    ("histogram", "kpo_learner_step_seconds", "step_seconds"),
    ("gauge", "kpo_learner_idle_seconds", "learner_idle_seconds"),
    ("histogram", "kpo_generation_batch_seconds", "generation_batch_seconds"),
    ("gauge", "kpo_generation_workers", "generation_workers"),
    ("counter", "kpo_generation_pool_grows_total", "generation_pool_grows_total"),
    ("counter", "kpo_generation_pool_shrinks_total", "generation_pool_shrinks_total"),
}


def declared(source: Source) -> set[str]:
    return {key for key, metric in BY_KEY.items() if metric.source is source}


@pytest.fixture(scope="module")
def learner_record() -> dict[str, float]:
    """One real learner step on the committed tiny model, with every option that adds keys:
    KPO with the token backstop (Kalman gain, shrinkage, filtered ratio, backstop fraction), the
    proximal reference with TIS and MIS (behaviour weights, their truncated and masked
    fractions)."""
    model_dir = resolve_model("tiny-arith")
    algorithm = AlgorithmConfig.model_validate(
        {
            "estimator": {"name": "kalman", "token_clip": [0.2, 0.28]},
            "reference": "proximal",
            "off_policy": {"tis_cap": 2.0, "mis_low": 0.5, "mis_high": 4.0},
        }
    )
    core = LearnerCore(
        model_dir,
        LearnerConfig(lr=1e-3),
        algorithm,
        temperature=1.0,
        seed=0,
        response_length=MAX_NEW_TOKENS,
    )
    return core.train_step(sample_groups(model_dir))


def test_a_learner_step_writes_declared_keys_only(learner_record: dict[str, float]) -> None:
    undeclared = sorted(learner_record.keys() - BY_KEY.keys())
    assert not undeclared, f"declare the learner's keys in services/metrics.py: {undeclared}"
    others = sorted(k for k in learner_record if BY_KEY[k].source is not Source.LEARNER)
    assert not others, f"written by the learner, declared as another's: {others}"


def test_the_learner_writes_every_key_declared_as_its_own(
    learner_record: dict[str, float],
) -> None:
    # The shadow estimators' keys are only in a record of `algorithm.shadow`, and the KPO
    # shadow's never beside KPO's own: tests/services/learner/test_shadow.py checks them. The
    # replay's only in a record of a batch with kept sets: tests/services/learner/
    # test_replay.py checks them.
    missing = sorted(
        declared(Source.LEARNER)
        - learner_record.keys()
        - NOT_YET_EMITTED
        - ACTOR_KEYS
        - set(SHADOW_KEYS)
        - set(REPLAY_KEYS)
    )
    assert not missing, f"declared in services/metrics.py, not in the learner's record: {missing}"


def test_the_driver_writes_exactly_the_keys_declared_as_its_own(tmp_path: Path) -> None:
    run_dir = RunDirectory(tmp_path)
    run = driver.RunDriver(tiny_spec("pipeline.checkpoint_every=0"), run_dir, [])
    learner_part = {"tokens_trained": 12.0, "nonfinite_rewards": 1.0, "policy_version": 1.0}
    no_actors: Any = SimpleNamespace(generation=[])

    run._on_trained(no_actors, driver.LearnerCall(time.perf_counter()), learner_part)

    (record,) = run_dir.read_metrics()
    added = record.keys() - learner_part.keys()
    # The evaluation's keys join a record only after an evaluation (`eval`, off here), the
    # tools' only in a run with tools, the guard's only with `stability.enabled`, the adaptive
    # staleness bound's only with `pipeline.max_staleness: {auto: ...}`.
    only_with_options = {*EVAL_KEYS, *TOOL_KEYS, *GUARD_KEYS, *STALENESS_AUTO_KEYS}
    assert added == declared(Source.DRIVER) - only_with_options
    # The run totals the driver keeps, from the constants it reads them by.
    assert {*FAULT_COUNTERS, *(f"{key}_total" for key in LEARNER_TOTALS)} <= added
    assert record["nonfinite_rewards_total"] == 1.0  # summed from the learner's count


def test_a_guarded_run_records_the_guards_keys(tmp_path: Path) -> None:
    run_dir = RunDirectory(tmp_path)
    spec = tiny_spec("pipeline.checkpoint_every=0", "stability.enabled=true")
    run = driver.RunDriver(spec, run_dir, [])
    call = driver.LearnerCall(time.perf_counter())
    run._on_trained(SimpleNamespace(generation=[]), call, {"tokens_trained": 6.0})

    (record,) = run_dir.read_metrics()
    assert {key: record[key] for key in GUARD_KEYS} == {
        "guard_broken_objectives": 0,
        "guard_actions_total": 0,
        "guard_rollbacks": 0,
        "rollouts_rolled_back_total": 0,
    }


def test_a_run_with_an_adaptive_staleness_bound_records_its_keys(tmp_path: Path) -> None:
    run_dir = RunDirectory(tmp_path)
    spec = tiny_spec(
        "pipeline.checkpoint_every=0",
        "pipeline.max_staleness.auto.min=0",
        "pipeline.max_staleness.auto.max=3",
    )
    run = driver.RunDriver(spec, run_dir, [])
    no_actors: Any = SimpleNamespace(generation=[])
    run._on_trained(no_actors, calls.LearnerCall(time.perf_counter()), {"tokens_trained": 6.0})

    (record,) = run_dir.read_metrics()
    # The first step is in the warm-up: the bound is still the one it started at (2).
    assert {key: record[key] for key in STALENESS_AUTO_KEYS} == {
        "staleness_bound": 2,
        "staleness_bound_changes_total": 0,
    }
    assert run.buffer.max_staleness == 2


def test_a_run_with_tools_records_the_tool_keys_of_its_batch(tmp_path: Path) -> None:
    run_dir = RunDirectory(tmp_path)
    run = driver.RunDriver(
        tiny_spec("pipeline.checkpoint_every=0", "tools.enabled=true"), run_dir, []
    )
    observed = [False, True, True, False, False]
    two_calls = Response(
        "p", [1], [5, 6, 7, 8, 9], [0.0] * 5, "stop", 0, "",
        observation_mask=observed, tool_calls=["ok", "timeout"],
    )  # fmt: skip
    no_call = Response("p", [1], [5, 6, 7], [0.0] * 3, "stop", 0, "")
    tools = tool_metrics([two_calls, no_call])
    call = driver.LearnerCall(time.perf_counter(), [1, 1], tools)
    run._on_trained(SimpleNamespace(generation=[]), call, {"tokens_trained": 6.0})

    (record,) = run_dir.read_metrics()
    assert {key: record[key] for key in TOOL_KEYS} == {
        "tool_calls_per_response": 1.0,  # 2 calls over 2 responses
        "tool_error_fraction": 0.5,  # the timeout
        "turns_mean": 2.0,  # 3 turns and 1
        "observation_token_fraction": 0.25,  # 2 of 8 tokens
    }


def test_the_drivers_totals_are_declared_counters_it_keeps() -> None:
    assert calls.FAULT_COUNTERS is FAULT_COUNTERS and driver.LEARNER_TOTALS is LEARNER_TOTALS
    fields = {f.name for f in dataclasses.fields(calls.Counters)}
    for key in (*FAULT_COUNTERS, *(f"{key}_total" for key in LEARNER_TOTALS)):
        assert BY_KEY[key].kind is Kind.COUNTER, key
        assert key in fields, f"the driver's Counters have no field {key}"
    for key in LEARNER_TOTALS:
        assert BY_KEY[key].source is Source.LEARNER and BY_KEY[key].kind is Kind.RECORD


def test_the_exported_names_stay_those_dashboards_and_alerts_use() -> None:
    found = {
        *(("gauge", m.name, m.key) for m in prometheus.RUN_GAUGES),
        *(("stage gauge", m.name, m.key) for m in prometheus.STAGE_GAUGES),
        *(("shadow gauge", m.name, m.key) for m in prometheus.SHADOW_GAUGES),
        *(("counter", m.name, m.key) for m in prometheus.RUN_COUNTERS),
        *(("event counter", m.prometheus, m.key) for m in prometheus.EVENT_COUNTERS),
        *(("histogram", m.name, m.key) for m in prometheus.RUN_HISTOGRAMS),
    }
    assert found == EXPORTED
    # Every declaration that is not record-only is exported, with its help text.
    exported = {m.key for m in RECORD if m.kind is not Kind.RECORD}
    assert exported == {key for _, _, key in EXPORTED}


@pytest.mark.parametrize(
    ("kind", "unit", "name", "problem"),
    [
        (Kind.GAUGE, "", None, "needs its Prometheus name"),
        (Kind.RECORD, "", "kpo_x", "has no Prometheus name"),
        (Kind.GAUGE, "", "x_mean", "must start with `kpo_`"),
        (Kind.COUNTER, "tokens", "kpo_tokens", "ends in `_total`"),
        (Kind.GAUGE, "tokens", "kpo_tokens_total", "ends in `_total`"),
        (Kind.GAUGE, "ratio", "kpo_clip_fraction", "must end in `_ratio`"),
        (Kind.GAUGE, "", "kpo_clip_fraction_ratio", "its unit must be 'ratio'"),
        (Kind.GAUGE, "nats", "kpo_entropy_seconds", "must end in `_nats`"),
        (Kind.COUNTER, "seconds", "kpo_busy_total", "must end in `_seconds`"),
        (Kind.HISTOGRAM, "tokens", "kpo_lengths", "holds durations"),
    ],
)
def test_a_declaration_against_the_naming_rules_is_refused(
    kind: Kind, unit: str, name: str | None, problem: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        MetricKey("x", kind, unit, "help", Source.LEARNER, name)


def test_names_that_follow_the_rules_are_accepted() -> None:
    MetricKey("busy", Kind.COUNTER, "seconds", "h", Source.DRIVER, "kpo_busy_seconds_total")
    MetricKey("s", Kind.HISTOGRAM, "seconds", "h", Source.DRIVER, "kpo_step_seconds")
    MetricKey("x", Kind.GAUGE, "ratio", "h", Source.LEARNER, "kpo_x_ratio", staged=True)
    MetricKey("x", Kind.RECORD, "tokens", "h", Source.LEARNER)


def test_each_key_is_declared_once() -> None:
    keys = [key for metric in RECORD for key in metric.record_keys]
    assert len(keys) == len(set(keys)) == len(BY_KEY)
    assert {"raw_switch_frequency", "filtered_switch_frequency"} <= BY_KEY.keys()
    assert "switch_frequency" not in BY_KEY  # only ever in the record with its stage
    assert all(metric.help.endswith(".") for metric in RECORD)


def test_the_docs_table_is_the_generated_one() -> None:
    doc = metrics_table.DOC.read_text(encoding="utf-8")
    assert metrics_table.with_table(doc) == doc, (
        "docs/pipeline.md's metrics table is out of date: run `python scripts/metrics_table.py`"
    )
    table = markdown_table()
    for metric in RECORD:
        for key in metric.record_keys:
            assert f"`{key}`" in table, key


def test_the_web_dashboard_draws_declared_keys() -> None:
    drawn = set(re.findall(r'\bkey:\s*"([^"]+)"', DASHBOARD_JS.read_text(encoding="utf-8")))
    assert drawn, 'no `key: "..."` in dashboard.js: update this test\'s pattern'
    assert not drawn - BY_KEY.keys(), f"undeclared keys in dashboard.js: {drawn - BY_KEY.keys()}"


def test_the_table_script_rewrites_a_stale_table_and_check_says_so(tmp_path: Path) -> None:
    stale = tmp_path / "doc.md"
    stale.write_text(f"# t\n{metrics_table.START}\n| old |\n{metrics_table.END}\nafter\n")
    assert metrics_table.main(["--doc", str(stale), "--check"]) == 1
    assert metrics_table.main(["--doc", str(stale)]) == 0
    table = f"{metrics_table.START}\n{markdown_table()}\n{metrics_table.END}"
    assert stale.read_text() == f"# t\n{table}\nafter\n"
    assert metrics_table.main(["--doc", str(stale), "--check"]) == 0
    stale.write_text("no markers\n")
    assert metrics_table.main(["--doc", str(stale)]) == 1
