"""The /metrics export: values read from a real store, Prometheus' own checker, scrape cost.

Stores are real (the local SQLite store in the test's tmp dir; the export test also runs against a
real redis-server). `promtool` is the real binary from Debian's `prometheus` package.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.api.app import create_app
from services.api.metrics_server import MetricsServer
from services.api.prometheus import (
    FINISHED_GRACE_S,
    MAX_ROUTES,
    RUN_PAGE,
    StoreCollector,
    build_registry,
    render,
)
from services.api.settings import ApiSettings
from services.metrics import BY_KEY, RECORD, STAGES, Kind
from services.pipeline.pause import ACTION_EVENT
from services.store import LocalStore, RedisStore, Store, StoreUnavailable
from tests.services.api.conftest import TOKEN, Api
from tests.services.api.launchers import RecordingLauncher
from tests.services.api.server import serve
from tests.services.store.redis_server import RedisServer

PROMTOOL_HINT = "promtool is not on PATH: install Debian's `prometheus` package"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def record(step: int, **values: Any) -> dict[str, Any]:
    """A metrics record as the driver writes it (docs/pipeline.md), with `values` overriding."""
    base = {
        "step": step,
        "time": 1_700_000_000.0 + step,
        "reward_mean": 0.1 * step,
        "accuracy": 0.05 * step,
        "entropy": 1.0 / step,
        "clip_fraction": 0.01 * step,
        "policy_loss": -0.5,
        "approx_kl": 0.002,
        "grad_norm": 0.25,
        "policy_version": float(step),
        "staleness_mean": 0.5,
        "staleness_max": 1.0,
        "buffer_groups": 4,
        "raw_switch_frequency": 0.3,
        "filtered_switch_frequency": 0.05,
        "raw_low_frequency_ratio": 0.1,
        "filtered_low_frequency_ratio": 0.9,
        "tokens_generated_total": 1000 * step,
        "rescored_groups": 5,
        "tokens_trained_total": 800 * step,
        "rollouts_dropped_stale": 2 * step,
        "groups_dropped_stale": step // 2,
        "step_seconds": 0.7,
    }
    return {**base, **values}


def running_run(store: Store, records: list[dict[str, Any]], name: str = "r") -> str:
    run = store.create_run({"name": name})
    store.transition(run.id, "running")
    store.append_metrics(run.id, records)
    return run.id


def samples(registry_text: str) -> Samples:
    """Every sample of the text format, keyed by (sample name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(registry_text)
        for s in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


def scrape(store: Store) -> Samples:
    registry, _ = build_registry(store)
    body, _ = render(registry)
    return samples(body.decode())


@pytest.fixture(params=["local", "redis"])
def any_store(
    request: pytest.FixtureRequest, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Store]:
    if request.param == "local":
        with LocalStore(tmp_path / "store") as local:
            yield local
        return
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        with RedisStore.from_url(server.url, prefix=f"test-{uuid.uuid4().hex[:8]}") as redis:
            yield redis
    finally:
        server.stop()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with LocalStore(tmp_path / "store") as local:
        yield local


def test_running_run_is_exported_with_its_latest_values(any_store: Store) -> None:
    # Durations 0.3, 0.7 and 2.0 s: buckets le=0.25 -> 0, le=0.5 -> 1, le=1 -> 2, le=2.5 -> 3.
    run_id = running_run(
        any_store,
        [
            record(1, step_seconds=0.3),
            record(2, step_seconds=0.7),
            record(3, step_seconds=2.0, learner_restarts=1, verifier_replacements=2),
        ],
    )
    queued = any_store.create_run({"name": "waiting"}).id

    found = scrape(any_store)

    one = {"run_id": run_id}
    assert value(found, "kpo_reward_mean", **one) == pytest.approx(0.3)
    assert value(found, "kpo_entropy_nats", **one) == pytest.approx(1 / 3)
    assert value(found, "kpo_clip_fraction_ratio", **one) == pytest.approx(0.03)
    assert value(found, "kpo_kl_nats", **one) == pytest.approx(0.002)
    assert value(found, "kpo_policy_loss", **one) == -0.5
    assert value(found, "kpo_policy_version", **one) == 3
    assert value(found, "kpo_staleness_mean", **one) == 0.5
    assert value(found, "kpo_ratio_switch_frequency_ratio", **one, stage="raw") == 0.3
    assert value(found, "kpo_ratio_switch_frequency_ratio", **one, stage="filtered") == 0.05
    assert value(found, "kpo_ratio_low_frequency_ratio", **one, stage="filtered") == 0.9
    assert value(found, "kpo_tokens_generated_total", **one) == 3000
    assert value(found, "kpo_tokens_trained_total", **one) == 2400
    assert value(found, "kpo_rollouts_dropped_stale_total", **one) == 6
    assert value(found, "kpo_learner_restarts_total", **one) == 1
    assert value(found, "kpo_verifier_replacements_total", **one) == 2
    assert value(found, "kpo_rescored_groups_total", **one) == 5
    buckets = {"0.25": 0, "0.5": 1, "1.0": 2, "2.5": 3, "+Inf": 3}
    for le, count in buckets.items():
        assert value(found, "kpo_learner_step_seconds_bucket", **one, le=le) == count
    assert value(found, "kpo_learner_step_seconds_count", **one) == 3
    assert value(found, "kpo_learner_step_seconds_sum", **one) == pytest.approx(3.0)
    # A queued run is counted but has no metrics yet.
    assert value(found, "kpo_reward_mean", run_id=queued) is None
    assert value(found, "kpo_runs", status="running") == 1
    assert value(found, "kpo_runs", status="queued") == 1
    assert value(found, "kpo_runs", status="failed") == 0
    assert value(found, "kpo_build_info", version="0.1.0") == 1
    assert value(found, "kpo_store_up") == 1


def test_every_declared_family_is_exported_from_its_record_key(store: Store) -> None:
    # Each record key services/metrics.py exports gets its own value, 1.0, 2.0, ...; each family
    # must show its key's value (a histogram: one observation of it), not a neighbour's.
    assert record(1).keys() <= BY_KEY.keys()  # the hand-made records of the other tests too
    # (Counters of the run's events are the next test's.)
    exported = [m for m in RECORD if m.kind is not Kind.RECORD and not m.event_labels]
    keys = [key for metric in exported for key in metric.record_keys]
    values = {key: float(i) for i, key in enumerate(keys, start=1)}
    run_id = running_run(store, [{"step": 1, **values, "lr": 1e-3}])

    found = scrape(store)

    one = {"run_id": run_id}
    for metric in exported:
        assert metric.prometheus is not None
        if metric.kind is Kind.HISTOGRAM:
            name, value_of = metric.prometheus, values[metric.key]
            assert value(found, f"{name}_count", **one) == 1, name
            assert value(found, f"{name}_sum", **one) == value_of, name
        elif metric.staged:
            for stage in STAGES:
                got = value(found, metric.prometheus, **one, stage=stage)
                assert got == values[f"{stage}_{metric.key}"], (metric.prometheus, stage)
        elif metric.shadowed:
            for name in metric.shadowed:
                got = value(found, metric.prometheus, **one, estimator=name)
                assert got == values[f"shadow_{name}_{metric.key}"], (metric.prometheus, name)
        else:
            assert value(found, metric.prometheus, **one) == values[metric.key], metric.prometheus


def test_guard_actions_are_counted_from_the_runs_events_by_reason_and_action(
    store: Store,
) -> None:
    run_id = running_run(store, [record(1)])
    action = {"step": 1, "since": 1, "key": "clip_fraction", "message": "m", "rollbacks": 0}
    for reason, kind in (
        ("clip_fraction_max", "warn"),
        ("clip_fraction_max", "warn"),
        ("reward_drop_max", "rollback"),
    ):
        store.append_event(run_id, ACTION_EVENT, {**action, "reason": reason, "action": kind})
    store.append_event(run_id, "alert", {"alertname": "KPONoLearnerProgress", "action": "pause"})
    one = {"run_id": run_id}
    registry, _ = build_registry(store)  # one control plane, scraped twice
    found = samples(render(registry)[0].decode())
    assert (
        value(found, "kpo_guard_actions_total", **one, reason="clip_fraction_max", action="warn")
        == 2
    )
    assert (
        value(found, "kpo_guard_actions_total", **one, reason="reward_drop_max", action="rollback")
        == 1
    )
    # Read on from the last event seen: a new action adds one, nothing is counted twice.
    store.append_event(
        run_id, ACTION_EVENT, {**action, "reason": "alert KPONoLearnerProgress", "action": "pause"}
    )
    found = samples(render(registry)[0].decode())
    assert (
        value(found, "kpo_guard_actions_total", **one, reason="clip_fraction_max", action="warn")
        == 2
    )
    assert (
        value(
            found,
            "kpo_guard_actions_total",
            **one,
            reason="alert KPONoLearnerProgress",
            action="pause",
        )
        == 1
    )
    # The record's own total is not exported a second time, without the labels.
    assert value(found, "kpo_guard_actions_total", **one) is None


def test_shadow_estimators_are_exported_with_an_estimator_label(store: Store) -> None:
    # A run training KPO with two shadow estimators (`algorithm.shadow: [sequence, token]`):
    # one family per key, a sample per shadow estimator, none for the others; the training
    # estimator's own values stay in the unlabelled families.
    shadows = {
        "shadow_sequence_policy_loss": -0.25,
        "shadow_sequence_clip_fraction": 0.5,
        "shadow_sequence_switch_frequency": 0.01,
        "shadow_sequence_low_frequency_ratio": 0.95,
        "shadow_sequence_ratio_mean": 1.01,  # record-only, as the training estimator's
        "shadow_token_policy_loss": -0.125,
        "shadow_token_clip_fraction": 0.02,
        "shadow_token_switch_frequency": math.nan,  # skipped, as any non-finite value
        "shadow_token_low_frequency_ratio": 0.2,
    }
    run_id = running_run(store, [record(1), record(2, **shadows)])

    registry, _ = build_registry(store)
    body, _ = render(registry)
    found = samples(body.decode())

    one = {"run_id": run_id}
    assert value(found, "kpo_shadow_policy_loss", **one, estimator="sequence") == -0.25
    assert value(found, "kpo_shadow_policy_loss", **one, estimator="token") == -0.125
    assert value(found, "kpo_shadow_clip_fraction_ratio", **one, estimator="sequence") == 0.5
    assert value(found, "kpo_shadow_clip_fraction_ratio", **one, estimator="token") == 0.02
    switch = "kpo_shadow_ratio_switch_frequency_ratio"
    assert value(found, switch, **one, estimator="sequence") == 0.01
    assert value(found, switch, **one, estimator="token") is None
    lfr = "kpo_shadow_ratio_low_frequency_ratio"
    assert value(found, lfr, **one, estimator="sequence") == 0.95
    assert value(found, lfr, **one, estimator="token") == 0.2
    shadow_samples = {
        (name, dict(labels)["estimator"])
        for name, labels in found
        if name.startswith("kpo_shadow_")
    }
    assert {estimator for _, estimator in shadow_samples} == {"sequence", "token"}
    assert not any(name.startswith("kpo_shadow_ratio_mean") for name, _ in shadow_samples)
    assert value(found, "kpo_policy_loss", **one) == -0.5  # the training estimator's
    assert value(found, "kpo_clip_fraction_ratio", **one) == pytest.approx(0.02)
    promtool = shutil.which("promtool")
    assert promtool, PROMTOOL_HINT
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=30, check=False
    )
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()
    assert checked.stdout == checked.stderr == b""


def test_finished_run_is_exported_for_the_grace_period_only(store: Store) -> None:
    run_id = running_run(store, [record(1), record(2)])
    store.transition(run_id, "succeeded")
    finished_at = store.get_run(run_id).transitions[-1].at.timestamp()
    now = [finished_at + 1]
    collector = StoreCollector(store, clock=lambda: now[0])

    assert _names_with_run(collector, run_id) >= {"kpo_reward_mean", "kpo_tokens_generated_total"}

    now[0] = finished_at + FINISHED_GRACE_S + 1
    assert _names_with_run(collector, run_id) == set()
    assert collector.series == {}  # and its cache is gone


def _names_with_run(collector: StoreCollector, run_id: str) -> set[str]:
    return {
        s.name
        for family in collector.collect()
        for s in family.samples
        if s.labels.get("run_id") == run_id
    }


def test_missing_nan_and_non_numeric_values_are_skipped(store: Store) -> None:
    bad = record(
        1,
        entropy=math.nan,
        clip_fraction=None,
        approx_kl="n/a",
        policy_loss=math.inf,
        grad_norm=True,
        step_seconds=math.nan,
    )
    del bad["reward_mean"]
    run_id = running_run(store, [bad])

    registry, _ = build_registry(store)
    text = render(registry)[0].decode()
    found = samples(text)

    for name in (
        "kpo_reward_mean",
        "kpo_entropy_nats",
        "kpo_clip_fraction_ratio",
        "kpo_kl_nats",
        "kpo_policy_loss",
        "kpo_grad_norm",
    ):
        assert value(found, name, run_id=run_id) is None, name
    assert "NaN" not in text
    assert not any(line.endswith("Inf") for line in text.splitlines())
    # The histogram has no observation, so no samples (not a row of zeros).
    assert value(found, "kpo_learner_step_seconds_count", run_id=run_id) is None
    assert value(found, "kpo_staleness_mean", run_id=run_id) == 0.5  # the rest is exported


def test_promtool_accepts_the_output(store: Store) -> None:
    promtool = shutil.which("promtool")
    assert promtool, PROMTOOL_HINT
    running_run(store, [record(step) for step in range(1, 6)])
    failed = running_run(store, [record(1, generation_batch_seconds=[0.2, 0.4])], name="f")
    store.transition(failed, "failed", "out of memory")
    registry, api = build_registry(store)
    api.observe("GET", "/v1/runs/{run_id}", 200, 0.004)
    api.observe("POST", "/v1/runs", 422, 0.02)

    body, content_type = render(registry)

    assert content_type.startswith("text/plain; version=0.0.4")
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=30, check=False
    )
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()
    assert checked.stdout == checked.stderr == b""  # no lint remark either


def test_a_scrape_reads_only_what_changed(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    run_ids = [running_run(store, [record(s) for s in range(1, 401)], name=n) for n in "ab"]
    for _ in range(30):  # finished runs: never read again
        store.transition(store.create_run({"name": "old"}).id, "cancelled")
    reads = _count_reads(store, monkeypatch)
    collector = StoreCollector(store)

    list(collector.collect())
    assert reads["records"] == 800  # the whole history, once

    reads.update(dict.fromkeys(reads, 0))
    store.append_metrics(run_ids[0], [record(401), record(402, step_seconds=3.0)])
    list(collector.collect())
    assert reads["records"] == 2
    assert reads["get_run"] == 2  # the two unfinished runs, not the 30 finished ones
    assert reads["runs_listed"] <= 100  # one page, down to the newest run already known

    reads.update(dict.fromkeys(reads, 0))
    list(collector.collect())
    assert reads["records"] == 0

    # What was built step by step equals what a fresh collector builds from the whole history.
    assert _run_samples(collector, run_ids[0]) == _run_samples(StoreCollector(store), run_ids[0])


def test_after_a_rewind_the_steps_trained_again_are_exported(any_store: Store) -> None:
    """A run resumed from its checkpoint of step 2 trains steps 3 and on again: the collector
    that had read to step 5 reads them, and its gauges are theirs."""
    run_id = running_run(any_store, [record(s, reward_mean=0.1) for s in range(1, 6)])
    collector = StoreCollector(any_store)

    def collected() -> Samples:
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in collector.collect()
            for s in family.samples
        }

    assert value(collected(), "kpo_reward_mean", run_id=run_id) == 0.1
    any_store.rewind_metrics(run_id, 2)
    any_store.append_metrics(run_id, [record(3, reward_mean=0.7), record(4, reward_mean=0.8)])
    found = collected()
    assert value(found, "kpo_reward_mean", run_id=run_id) == 0.8
    assert value(found, "kpo_policy_version", run_id=run_id) == 4
    # Steps 3 and 4 are observed twice (both attempts ran them): 5 + 2 step durations.
    assert value(found, "kpo_learner_step_seconds_count", run_id=run_id) == 7


def _count_reads(store: Store, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Wrap the store's read methods on this instance to count what they return."""
    reads: dict[str, int] = {"records": 0, "get_run": 0, "runs_listed": 0}
    read_metrics, get_run, list_runs = store.read_metrics, store.get_run, store.list_runs

    def counted_read_metrics(*args: Any, **kwargs: Any) -> Any:
        records = read_metrics(*args, **kwargs)
        reads["records"] += len(records)
        return records

    def counted_get_run(*args: Any, **kwargs: Any) -> Any:
        reads["get_run"] += 1
        return get_run(*args, **kwargs)

    def counted_list_runs(*args: Any, **kwargs: Any) -> Any:
        page, cursor = list_runs(*args, **kwargs)
        reads["runs_listed"] += len(page)
        return page, cursor

    monkeypatch.setattr(store, "read_metrics", counted_read_metrics)
    monkeypatch.setattr(store, "get_run", counted_get_run)
    monkeypatch.setattr(store, "list_runs", counted_list_runs)
    return reads


def _run_samples(collector: StoreCollector, run_id: str) -> set[tuple[str, str, float]]:
    return {
        (s.name, str(sorted(s.labels.items())), s.value)
        for family in collector.collect()
        for s in family.samples
        if s.labels.get("run_id") == run_id
    }


def test_store_outage_is_reported_not_raised(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = running_run(store, [record(1)])
    registry, _ = build_registry(store)
    render(registry)

    def down(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("redis is restarting")

    monkeypatch.setattr(store, "get_run", down)
    monkeypatch.setattr(store, "list_runs", down)
    found = samples(render(registry)[0].decode())

    assert value(found, "kpo_store_up") == 0
    # The last values read stay visible; kpo_store_up says they are not fresh.
    assert value(found, "kpo_reward_mean", run_id=run_id) == pytest.approx(0.1)


def test_a_listing_cut_short_is_read_again_whole(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    for _ in range(RUN_PAGE + 20):  # two pages
        store.create_run({"name": "q"})
    list_runs = store.list_runs
    calls = [0]

    def second_page_fails_once(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise StoreUnavailable("connection reset")
        return list_runs(*args, **kwargs)

    monkeypatch.setattr(store, "list_runs", second_page_fails_once)
    registry, _ = build_registry(store)

    assert value(samples(render(registry)[0].decode()), "kpo_store_up") == 0
    found = samples(render(registry)[0].decode())
    assert value(found, "kpo_store_up") == 1
    assert value(found, "kpo_runs", status="queued") == RUN_PAGE + 20


def test_api_metrics_count_requests_by_route_template(store: Store) -> None:
    registry, api = build_registry(store)
    api.observe("get", "/v1/runs/{run_id}", 200, 0.003)
    api.observe("GET", "/v1/runs/{run_id}", 200, 0.2)
    api.observe("BREW", "/v1/runs", 405, 0.001)
    for i in range(MAX_ROUTES + 5):  # a caller passing raw paths cannot add a series per path
        api.observe("GET", f"/raw/{i}", 404, 0.001)

    found = samples(render(registry)[0].decode())

    get_run = {"method": "GET", "route": "/v1/runs/{run_id}"}
    assert value(found, "kpo_api_requests_total", **get_run, status="200") == 2
    assert value(found, "kpo_api_request_duration_seconds_bucket", **get_run, le="0.005") == 1
    assert value(found, "kpo_api_request_duration_seconds_bucket", **get_run, le="0.25") == 2
    assert value(found, "kpo_api_requests_total", method="OTHER", route="/v1/runs", status="405")
    routes = {labels for (name, labels) in found if name == "kpo_api_requests_total"}
    assert len(routes) == MAX_ROUTES + 1  # the cap, plus "other"
    assert value(found, "kpo_api_requests_total", method="GET", route="other", status="404") == 7


def test_metrics_endpoint_of_the_real_app(api: Api) -> None:
    run_id = running_run(api.store, [record(1), record(2)])
    assert api.client.get(f"/v1/runs/{run_id}").status_code == 200

    response = api.client.get("/metrics")

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    found = samples(response.text)
    assert value(found, "kpo_reward_mean", run_id=run_id) == pytest.approx(0.2)
    get_run = {"method": "GET", "route": "/v1/runs/{run_id}", "status": "200"}
    assert value(found, "kpo_api_requests_total", **get_run) == 1


def test_an_evaluation_stays_the_latest_until_the_next_one(store: Store) -> None:
    """Evaluation keys are in the record after an evaluation only; the gauge keeps them."""
    evaluated = {"eval_accuracy_avg_at_k": 0.25, "eval_pass_at_k": 0.5, "eval_step": 2}
    run_id = running_run(store, [record(1), record(2), record(3, **evaluated), record(4)])
    found = scrape(store)
    assert value(found, "kpo_eval_accuracy_avg_at_k_ratio", run_id=run_id) == 0.25
    assert value(found, "kpo_eval_pass_at_k_ratio", run_id=run_id) == 0.5
    assert value(found, "kpo_policy_version", run_id=run_id) == 4  # the rest is the latest


# --- /metrics on a port of its own ----------------------------------------------------------


def test_with_a_metrics_port_the_export_is_served_there_and_not_by_the_api(
    tmp_path: Path,
) -> None:
    env = {"KPO_DATA_DIR": str(tmp_path), "KPO_API_TOKEN": TOKEN, "KPO_METRICS_PORT": "9090"}
    store = LocalStore(tmp_path / "store")
    app = create_app(ApiSettings.model_validate(env), store, RecordingLauncher())
    run_id = running_run(store, [record(1), record(2)])
    registry, trusted = app.state.registry, app.state.trusted_hosts
    with (
        serve(app) as url,
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as admin,
        MetricsServer(registry, "127.0.0.1", 0, trusted) as metrics,
    ):
        assert admin.get("/metrics").status_code == 404  # not on the API's port, token or not
        assert admin.get(f"/v1/runs/{run_id}").status_code == 200
        # The metrics port is the scrapers': no token, the same registry (API requests too).
        scrape = httpx.get(f"http://127.0.0.1:{metrics.port}/metrics")
        assert scrape.status_code == 200
        assert scrape.headers["content-type"].startswith("text/plain; version=0.0.4")
        found = samples(scrape.text)
        assert value(found, "kpo_reward_mean", run_id=run_id) == pytest.approx(0.2)
        get_run = {"method": "GET", "route": "/v1/runs/{run_id}", "status": "200"}
        assert value(found, "kpo_api_requests_total", **get_run) == 1
        assert httpx.get(f"http://127.0.0.1:{metrics.port}/v1/runs").status_code == 404
        assert httpx.post(f"http://127.0.0.1:{metrics.port}/metrics").status_code == 405


def test_the_metrics_port_answers_only_the_apis_host_names(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    app = create_app(ApiSettings.model_validate({}), store, RecordingLauncher())  # no token
    with MetricsServer(app.state.registry, "127.0.0.1", 0, app.state.trusted_hosts) as metrics:
        url = f"http://127.0.0.1:{metrics.port}/metrics"
        assert httpx.get(url).status_code == 200
        assert httpx.get(url, headers={"Host": "localhost:9090"}).status_code == 200
        assert httpx.get(url, headers={"Host": "evil.example"}).status_code == 400


def test_the_metrics_route_needs_the_token_like_reads(secured: Api) -> None:
    assert secured.client.get("/metrics").status_code == 401
    assert secured.admin.get("/metrics").status_code == 200
