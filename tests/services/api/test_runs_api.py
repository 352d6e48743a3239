"""The REST API over real HTTP: runs CRUD, idempotency, cancel, metrics, events, logs, errors."""

from __future__ import annotations

import json
import time

import anyio
import httpx

from services.api.routes_system import READY_CACHE_S, Readiness, ReadinessProbe
from services.store import LocalStore, RunStatus
from tests.services.api.conftest import Api, ApiFactory
from tests.services.api.launchers import RecordingLauncher

TINY = {"name": "t", "pipeline": {"steps": 3}, "generation": {"group_size": 4}}


def create(api: Api, body: dict | None = None, **headers: str) -> httpx.Response:
    return api.client.post("/v1/runs", json=body if body is not None else TINY, headers=headers)


def test_create_queues_a_resolved_run_and_launches_it(api: Api) -> None:
    response = create(api)
    assert response.status_code == 201, response.text
    run = response.json()
    assert run["id"].startswith("run-") and run["status"] == "queued"
    assert run["spec"]["pipeline"]["steps"] == 3
    assert run["spec"]["pipeline"]["max_staleness"] == 2  # defaults resolved
    assert run["spec"]["algorithm"]["estimator"]["name"] == "kalman"
    assert [t["status"] for t in run["transitions"]] == ["queued"]
    assert api.launcher.submitted == [run["id"]]
    assert api.client.get(f"/v1/runs/{run['id']}").json() == run


def test_the_same_idempotency_key_and_body_give_one_run(api: Api) -> None:
    first = create(api, **{"Idempotency-Key": "k1"}).json()
    again = create(api, **{"Idempotency-Key": "k1"})
    assert again.status_code == 201 and again.json()["id"] == first["id"]
    runs = api.client.get("/v1/runs").json()["runs"]
    assert [r["id"] for r in runs] == [first["id"]]
    other = create(api, {**TINY, "name": "other"}, **{"Idempotency-Key": "k1"})
    assert other.status_code == 409
    assert "idempotency key 'k1'" in other.json()["error"]["message"]


def test_a_bad_spec_is_a_422_naming_the_field_and_the_valid_values(api: Api) -> None:
    response = create(api, {"generation": {"backend": "tgi"}, "pipeline": {"stepz": 1}})
    assert response.status_code == 422
    error = response.json()["error"]
    fields = {f["field"]: f["message"] for f in error["fields"]}
    assert fields["generation.backend"] == "Input should be 'hf' or 'vllm'"
    assert fields["pipeline.stepz"] == "Extra inputs are not permitted"
    estimator = create(api, {"algorithm": {"estimator": {"name": "ppo"}}}).json()["error"]
    assert "'kalman'" in estimator["message"] and "'cumulative'" in estimator["message"]
    assert api.launcher.submitted == []


def test_an_elastic_pool_outside_its_bounds_is_a_422_naming_the_field(api: Api) -> None:
    pool = {"num_workers": 5, "actors": {"min": 1, "max": 4}}
    response = create(api, {**TINY, "generation": pool})
    assert response.status_code == 422
    fields = {f["field"]: f["message"] for f in response.json()["error"]["fields"]}
    assert "within actors.min and actors.max ([1, 4]), got 5" in fields["generation.num_workers"]
    reversed_pool = {"actors": {"min": 3, "max": 2}, "num_workers": 3}
    response = create(api, {**TINY, "generation": reversed_pool})
    fields = {f["field"]: f["message"] for f in response.json()["error"]["fields"]}
    assert fields["generation.actors.max"] == "must be at least min (3), got 2"
    assert api.launcher.submitted == []


def test_malformed_bodies_are_client_errors(api: Api) -> None:
    def post(content: bytes, content_type: str = "application/json") -> httpx.Response:
        return api.client.post("/v1/runs", content=content, headers={"content-type": content_type})

    assert post(b"{not json").status_code == 422
    assert post(b"\xff\xfe\x00garbage").status_code in (400, 422)
    assert post(b"[1, 2]").status_code == 422
    assert post(b"name=x", "application/x-www-form-urlencoded").status_code == 415
    huge = json.dumps({"name": "x" * 2_000_000}).encode()
    assert post(huge).status_code == 413

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        for _ in range(40):
            yield b" " * 50_000

    chunked = api.client.post(
        "/v1/runs", content=chunks(), headers={"content-type": "application/json"}
    )
    assert chunked.status_code == 413


def test_list_pages_newest_first_and_filters_by_status(api: Api) -> None:
    ids = [create(api, {**TINY, "name": f"r{i}"}).json()["id"] for i in range(5)]
    api.store.transition(ids[1], RunStatus.RUNNING)
    page = api.client.get("/v1/runs", params={"limit": 2}).json()
    assert [r["id"] for r in page["runs"]] == ids[::-1][:2]
    rest = api.client.get("/v1/runs", params={"limit": 10, "cursor": page["next_cursor"]}).json()
    assert [r["id"] for r in rest["runs"]] == ids[::-1][2:] and rest["next_cursor"] is None
    running = api.client.get("/v1/runs", params={"status": "running"}).json()["runs"]
    assert [r["id"] for r in running] == [ids[1]]
    assert api.client.get("/v1/runs", params={"status": "done"}).status_code == 422
    assert api.client.get("/v1/runs", params={"limit": 10_000}).status_code == 422
    assert api.client.get("/v1/runs", params={"cursor": "garbage"}).status_code == 422


def test_unknown_runs_are_404_everywhere(api: Api) -> None:
    for path in ("", "/metrics", "/logs", "/events"):
        response = api.client.get(f"/v1/runs/run-000000000000{path}")
        assert response.status_code == 404, path
        assert response.json()["error"]["type"] == "not_found"
    assert api.client.post("/v1/runs/run-000000000000/cancel").status_code == 404
    assert api.client.get("/v1/runs/../../etc/passwd").status_code == 404


def test_cancel_queued_running_and_finished_runs(api: Api) -> None:
    queued = create(api).json()["id"]
    response = api.client.post(f"/v1/runs/{queued}/cancel")
    assert response.status_code == 202 and response.json()["status"] == "cancelled"
    assert api.client.post(f"/v1/runs/{queued}/cancel").status_code == 409
    running = create(api).json()["id"]
    api.store.transition(running, RunStatus.RUNNING)
    response = api.client.post(f"/v1/runs/{running}/cancel")
    # The driver records `cancelled` once it has stopped; the API asks the launcher to stop it.
    assert response.status_code == 202 and response.json()["status"] == "running"
    assert api.launcher.stopped == [queued, running]
    api.store.transition(running, RunStatus.SUCCEEDED)
    finished = api.client.post(f"/v1/runs/{running}/cancel")
    assert finished.status_code == 409
    assert "succeeded" in finished.json()["error"]["message"]


def test_cancel_while_the_job_server_is_unreachable(api: Api) -> None:
    queued, running = create(api).json()["id"], create(api).json()["id"]
    api.store.transition(running, RunStatus.RUNNING)
    api.launcher.reachable = False
    # Queued: recorded as cancelled now; the job (if any) is stopped by the reconciler later.
    assert api.client.post(f"/v1/runs/{queued}/cancel").json()["status"] == "cancelled"
    response = api.client.post(f"/v1/runs/{running}/cancel")
    assert response.status_code == 503 and "try again" in response.json()["error"]["message"]
    # The launcher's own words (hosts, internals) stay in the server's log.
    assert "job server unreachable" not in response.text


def test_a_running_runs_cancel_is_stored_before_ray_is_asked(api: Api) -> None:
    queued, running = create(api).json()["id"], create(api).json()["id"]
    api.store.transition(running, RunStatus.RUNNING)
    # Queued: cancelled at once, as before; there is nothing for a reconciler to hold back.
    assert api.client.post(f"/v1/runs/{queued}/cancel").json()["cancel_requested_at"] is None
    api.launcher.reachable = False
    refused = api.client.post(f"/v1/runs/{running}/cancel")
    assert refused.status_code == 503 and "the cancel is recorded" in refused.text
    # The request outlived the job server it could not reach; a resend keeps its first time.
    stored = api.store.get_run(running)
    assert stored.status == RunStatus.RUNNING and stored.cancel_requested_at is not None
    api.launcher.reachable = True
    response = api.client.post(f"/v1/runs/{running}/cancel")
    assert response.status_code == 202 and response.json()["status"] == "running"
    assert (
        response.json()["cancel_requested_at"]
        == stored.model_dump(mode="json")["cancel_requested_at"]
    )
    assert api.launcher.stopped == [queued, running]


def test_metrics_history_since_a_step(api: Api) -> None:
    run = create(api).json()["id"]
    api.store.append_metrics(run, [{"step": s, "reward_mean": s / 10} for s in (1, 2, 3)])
    page = api.client.get(f"/v1/runs/{run}/metrics", params={"since_step": 1}).json()
    assert [r["step"] for r in page["records"]] == [2, 3] and page["last_step"] == 3
    assert api.client.get(f"/v1/runs/{run}/metrics", params={"since_step": 3}).json() == {
        "run_id": run,
        "records": [],
        "last_step": None,
    }
    assert api.client.get(f"/v1/runs/{run}/metrics", params={"since_step": -2}).status_code == 422


def parse_sse(text: str) -> list[dict]:
    """The events of a stream's text (the `retry:` block and pings, which are none, left out)."""
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in block.splitlines() if not line.startswith(":")
        )
        if "event" in fields:
            events.append(
                {"id": fields["id"], "event": fields["event"], "data": json.loads(fields["data"])}
            )
    return events


def test_events_stream_status_and_metrics_and_resume_after_an_id(api: Api) -> None:
    run = create(api).json()["id"]
    api.store.transition(run, RunStatus.RUNNING)
    api.store.append_metrics(
        run, [{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.2}]
    )
    api.store.transition(run, RunStatus.SUCCEEDED)
    response = api.client.get(f"/v1/runs/{run}/events")  # ends: the run has finished
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert [e["event"] for e in events] == ["status", "status", "metrics", "metrics", "status"]
    assert [e["data"].get("status") for e in events if e["event"] == "status"] == [
        "queued",
        "running",
        "succeeded",
    ]
    resumed = api.client.get(f"/v1/runs/{run}/events", headers={"Last-Event-ID": events[2]["id"]})
    assert parse_sse(resumed.text) == events[3:]
    bad = api.client.get(f"/v1/runs/{run}/events", headers={"Last-Event-ID": "nonsense"})
    assert bad.status_code == 422


def test_events_arrive_live_while_the_run_goes_on(api: Api) -> None:
    run = create(api).json()["id"]
    api.store.transition(run, RunStatus.RUNNING)
    seen: list[str] = []
    with api.client.stream("GET", f"/v1/runs/{run}/events") as stream:
        lines = stream.iter_lines()
        for line in lines:
            if not line.startswith("event: "):
                continue
            seen.append(line.removeprefix("event: "))
            if seen == ["status", "status"]:
                api.store.append_metrics(run, [{"step": 1}])
            if seen == ["status", "status", "metrics"]:
                api.store.transition(run, RunStatus.SUCCEEDED)
    assert seen == ["status", "status", "metrics", "status"]


def test_logs_tail(api: Api) -> None:
    run = create(api).json()["id"]
    api.store.append_logs(run, [f"line {i}" for i in range(10)])
    body = api.client.get(f"/v1/runs/{run}/logs", params={"tail": 3}).json()
    assert body == {"run_id": run, "lines": ["line 7", "line 8", "line 9"]}


def test_health_and_readiness(api: Api) -> None:
    assert api.client.get("/healthz").json() == {"status": "ok"}
    assert api.client.get("/readyz").json() == {"store": True, "ray": True}
    api.launcher.is_ready = False
    # Readiness is checked at most every READY_CACHE_S: the change shows within that.
    deadline = time.monotonic() + READY_CACHE_S + 10
    while (not_ready := api.client.get("/readyz")).status_code == 200:
        assert time.monotonic() < deadline, "/readyz never saw Ray go away"
        time.sleep(0.1)
    assert not_ready.status_code == 503 and not_ready.json() == {"store": True, "ray": False}


def test_readiness_is_checked_once_per_period_however_often_it_is_asked() -> None:
    now = [0.0]
    store = CountingStore()
    probe = ReadinessProbe(store, RecordingLauncher(), ttl_s=2.0, clock=lambda: now[0])

    async def ask(times: int) -> list[Readiness]:
        return [await probe.check() for _ in range(times)]

    assert anyio.run(ask, 5) == [Readiness(store=True, ray=True)] * 5
    assert store.pings == 1
    now[0] = 1.9
    anyio.run(ask, 3)
    assert store.pings == 1
    now[0] = 2.0
    anyio.run(ask, 3)
    assert store.pings == 2


class CountingStore(LocalStore):
    """A store that counts its pings (nothing else is called)."""

    def __init__(self) -> None:  # no database: only ping is called
        self.pings = 0

    def ping(self) -> bool:
        self.pings += 1
        return True


# --- run summaries, the cap on active runs, idempotency over HTTP -----------------------------


def test_the_list_gives_summaries_without_specs(api: Api) -> None:
    body = {**TINY, "algorithm": {"estimator": {"name": "token"}}, "pipeline": {"mode": "sync"}}
    run = create(api, body).json()
    listed = api.client.get("/v1/runs").json()["runs"]
    assert len(listed) == 1 and "spec" not in listed[0]
    assert listed[0] == {
        "id": run["id"],
        "status": "queued",
        "name": "t",
        "model": "tiny-arith",
        "estimator": "token",
        "mode": "sync",
        "steps": 100,
        "created_at": run["created_at"],
        "transitions": run["transitions"],
        "error": None,
    }
    assert api.client.get(f"/v1/runs/{run['id']}").json()["spec"] == run["spec"]
    # A run stored with another spec (the store takes any mapping) lists with what it has.
    other = api.store.create_run({"name": 7, "pipeline": {"steps": "many"}}).id
    summary = api.client.get("/v1/runs").json()["runs"][0]
    assert summary["id"] == other and summary["name"] is None and summary["steps"] is None


def test_past_the_cap_on_active_runs_a_new_run_is_a_429(api_factory: ApiFactory) -> None:
    with api_factory(KPO_MAX_ACTIVE_RUNS="2") as api:
        first = create(api, **{"Idempotency-Key": "k1"}).json()["id"]
        create(api)
        refused = create(api)
        assert refused.status_code == 429
        assert refused.headers["retry-after"].isdigit()
        error = refused.json()["error"]
        assert error["type"] == "quota_exceeded" and error["limit"] == 2
        assert "KPO_MAX_ACTIVE_RUNS" in error["message"] and "2 runs" in error["message"]
        # A resend of a key that made a run still returns it.
        again = create(api, **{"Idempotency-Key": "k1"})
        assert again.status_code == 201 and again.json()["id"] == first
        assert len(set(api.launcher.submitted)) == 2  # (a resend is submitted again: a no-op)
        api.client.post(f"/v1/runs/{first}/cancel")
        assert create(api).status_code == 201
    with api_factory(KPO_MAX_ACTIVE_RUNS="0") as unlimited:  # 0: no cap
        assert all(create(unlimited).status_code == 201 for _ in range(20))


def test_an_idempotency_key_is_free_again_once_its_run_has_been_finished_long_enough(
    api_factory: ApiFactory,
) -> None:
    with api_factory(KPO_IDEMPOTENCY_TTL_S="1") as api:
        key = {"Idempotency-Key": "nightly"}
        first = create(api, **key).json()["id"]
        api.client.post(f"/v1/runs/{first}/cancel")
        deadline = time.monotonic() + 10
        while (again := create(api, **key).json()["id"]) == first:
            assert time.monotonic() < deadline, "the key never expired"
            time.sleep(0.05)
        assert create(api, **key).json()["id"] == again
