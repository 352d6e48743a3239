"""Event streams: the SSE message format, and the bounds that keep streams from starving the
server (caps in all and per client, a lifetime, store reads on threads of their own), over real
HTTP."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.api.client import ApiClient
from services.api.sse import POLL_SECONDS, RETRY_MS, STREAM_THREADS, format_event
from services.store import Event, LocalStore, RunStatus
from tests.services.api.conftest import Api, ApiFactory

# More streams than the worker threads of the routes' default pool (anyio's 40): were their
# store reads on that pool, a stalled store would leave no thread for any sync route.
STREAMS = 48


def reject_constant(name: str) -> None:
    raise ValueError(f"not JSON: {name}")


def test_a_diverged_metric_is_sent_as_null_so_browsers_can_parse_it() -> None:
    event = Event(
        id="7",
        kind="metrics",
        data={"step": 3, "entropy": float("nan"), "nested": [float("inf"), 1.5]},
        at=datetime.now(UTC),
    )
    text = format_event(event)
    assert text.startswith("id: 7\nevent: metrics\ndata: ") and text.endswith("\n\n")
    data = json.loads(text.split("data: ", 1)[1], parse_constant=reject_constant)
    assert data == {"step": 3, "entropy": None, "nested": [None, 1.5]}


class StallingStore(LocalStore):
    """A local store whose reads of events and runs can be made to hang (a store that stopped
    answering), counting the calls that hang."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.stalled = False
        self.go_on = threading.Event()
        self.hanging = 0
        self._count = threading.Lock()

    def _hang_while_stalled(self) -> None:
        if self.stalled:
            with self._count:
                self.hanging += 1
            self.go_on.wait(timeout=60)

    def read_events(self, run_id: str, after_id: str | None = None, limit: int = 1000) -> Any:
        self._hang_while_stalled()
        return super().read_events(run_id, after_id, limit)

    def get_run(self, run_id: str) -> Any:
        self._hang_while_stalled()
        return super().get_run(run_id)


def wait_for(condition: Any, what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def crowded(api_factory: ApiFactory, tmp_path: Path) -> Iterator[tuple[Api, StallingStore, str]]:
    """An API that serves at most STREAMS event streams, over a store that can stall, with a
    run that goes on (its streams never end by themselves)."""
    store = StallingStore(tmp_path / "stalling")
    env = {"KPO_MAX_STREAMS": str(STREAMS), "KPO_MAX_STREAMS_PER_CLIENT": str(STREAMS)}
    with api_factory(store=store, **env) as api:
        run = api.client.post("/v1/runs", json={}).json()["id"]
        store.transition(run, RunStatus.RUNNING)
        try:
            yield api, store, run
        finally:
            store.go_on.set()


def test_past_the_cap_a_stream_is_a_429_and_healthz_answers_while_streams_hang(
    crowded: tuple[Api, StallingStore, str],
) -> None:
    api, store, run = crowded
    limits = httpx.Limits(max_connections=STREAMS + 10)
    with httpx.Client(base_url=api.url, timeout=30, limits=limits) as client, ExitStack() as open_:
        for _ in range(STREAMS):
            stream = open_.enter_context(client.stream("GET", f"/v1/runs/{run}/events"))
            assert stream.status_code == 200
        refused = client.get(f"/v1/runs/{run}/events")
        assert refused.status_code == 429
        assert refused.headers["retry-after"].isdigit()
        error = refused.json()["error"]
        assert error["type"] == "too_many_requests" and "KPO_MAX_STREAMS" in error["message"]

        # The store stops answering: every stream's next read hangs on a thread. Theirs are
        # STREAM_THREADS of their own; the routes' pool stays free, and /healthz needs none.
        store.stalled = True
        wait_for(lambda: store.hanging >= STREAM_THREADS, "the streams' reads to hang")
        time.sleep(2 * POLL_SECONDS)  # every stream has tried to read by now
        assert store.hanging == STREAM_THREADS  # the others wait for one of those threads
        start = time.perf_counter()
        health = httpx.get(f"{api.url}/healthz", timeout=5)
        latency = time.perf_counter() - start
        assert health.status_code == 200
        # 100 ms is the aim; the bound is loose so that a loaded machine does not fail it.
        assert latency < 1.0, f"/healthz took {latency:.3f} s while streams hang"
        store.stalled = False
        store.go_on.set()
    # The streams are closed: their slots are free again.
    wait_for(lambda: api.client.get("/healthz").status_code == 200, "the server")
    with api.client.stream("GET", f"/v1/runs/{run}/events") as again:
        assert again.status_code == 200


def test_one_client_may_hold_only_its_share_of_streams(api_factory: ApiFactory) -> None:
    env = {"KPO_MAX_STREAMS": "10", "KPO_MAX_STREAMS_PER_CLIENT": "2"}
    with api_factory(**env) as api, ExitStack() as open_:
        run = api.client.post("/v1/runs", json={}).json()["id"]
        api.store.transition(run, RunStatus.RUNNING)
        path = f"/v1/runs/{run}/events"
        for _ in range(2):
            assert open_.enter_context(api.client.stream("GET", path)).status_code == 200
        third = api.client.get(path)
        assert third.status_code == 429
        assert "KPO_MAX_STREAMS_PER_CLIENT" in third.json()["error"]["message"]
        # Another address (all of 127.0.0.0/8 is this machine) is another client.
        other = httpx.HTTPTransport(local_address="127.0.0.2")
        with (
            httpx.Client(base_url=api.url, transport=other, timeout=30) as elsewhere,
            elsewhere.stream("GET", path) as stream,
        ):
            assert stream.status_code == 200


def test_a_stream_ends_after_its_lifetime_and_resumes_where_it_was(
    api_factory: ApiFactory,
) -> None:
    lifetime_s = 0.5
    with api_factory(KPO_STREAM_LIFETIME_S=str(lifetime_s)) as api:
        run = api.client.post("/v1/runs", json={}).json()["id"]
        api.store.transition(run, RunStatus.RUNNING)
        start = time.monotonic()
        first = api.client.get(f"/v1/runs/{run}/events")  # returns: the stream ended by itself
        assert time.monotonic() - start >= lifetime_s
        assert api.store.get_run(run).status == RunStatus.RUNNING
        assert first.text.startswith(f"retry: {RETRY_MS}\n\n")
        ids = [line[4:] for line in first.text.splitlines() if line.startswith("id: ")]
        assert len(ids) == 2  # queued, running
        api.store.append_metrics(run, [{"step": 1}])
        resumed = api.client.get(f"/v1/runs/{run}/events", headers={"Last-Event-ID": ids[-1]})
        assert [line for line in resumed.text.splitlines() if line.startswith("event: ")] == [
            "event: metrics"
        ]


def test_kpo_follows_a_run_across_streams_that_end(api_factory: ApiFactory) -> None:
    with api_factory(KPO_STREAM_LIFETIME_S="0.3") as api:
        run = api.client.post("/v1/runs", json={}).json()["id"]
        seen: list[str] = []

        def drive() -> None:  # the run goes on over several stream lifetimes
            api.store.transition(run, RunStatus.RUNNING)
            for step in (1, 2, 3):
                time.sleep(0.4)
                api.store.append_metrics(run, [{"step": step}])
            api.store.transition(run, RunStatus.SUCCEEDED)

        driver = threading.Thread(target=drive)
        driver.start()
        with ApiClient(api.url) as client:
            for event in client.follow(run, reconnect_s=10):
                seen.append(event.data.get("status") or f"step {event.data['step']}")
        driver.join()
        assert seen == ["queued", "running", "step 1", "step 2", "step 3", "succeeded"]


def open_streams(client: httpx.Client, path: str, forwarded: str, stack: ExitStack) -> int:
    """Open streams as `X-Forwarded-For: forwarded` until one is refused; how many opened."""
    for opened in range(10):
        response = stack.enter_context(
            client.stream("GET", path, headers={"X-Forwarded-For": forwarded})
        )
        if response.status_code != 200:
            assert response.status_code == 429
            return opened
    return 10


def test_a_forwarded_address_counts_only_from_a_trusted_proxy(api_factory: ApiFactory) -> None:
    """The per-client cap is keyed on the peer; a peer that is one of KPO_TRUSTED_PROXIES (the
    Ingress) speaks for the client it forwards, anyone else's X-Forwarded-For is ignored."""
    caps = {"KPO_MAX_STREAMS": "20", "KPO_MAX_STREAMS_PER_CLIENT": "2"}
    with api_factory(**caps) as api, ExitStack() as stack:
        run = api.client.post("/v1/runs", json={}).json()["id"]
        api.store.transition(run, RunStatus.RUNNING)
        path = f"/v1/runs/{run}/events"
        # Not a trusted peer: a new made-up address per stream changes nothing.
        opened = sum(open_streams(api.client, path, f"203.0.113.{i}", stack) for i in range(1, 4))
        assert opened == 2

    # The loopback peer is the operator's proxy now.
    trusting = {**caps, "KPO_TRUSTED_PROXIES": "127.0.0.0/8, ::1"}
    with api_factory(**trusting) as api, ExitStack() as stack:
        run = api.client.post("/v1/runs", json={}).json()["id"]
        api.store.transition(run, RunStatus.RUNNING)
        path = f"/v1/runs/{run}/events"
        assert open_streams(api.client, path, "203.0.113.1", stack) == 2
        assert open_streams(api.client, path, "203.0.113.2", stack) == 2
        # What a client wrote before the address the proxy appended is not believed.
        assert open_streams(api.client, path, "198.51.100.7, 203.0.113.1", stack) == 0


def test_kpo_follow_says_when_a_run_resumed_from_an_earlier_checkpoint(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    import typer

    from services.cli import _follow

    run = api.store.create_run({}).id
    api.store.transition(run, RunStatus.RUNNING)
    api.store.append_metrics(run, [{"step": s, "reward_mean": 0.1} for s in (1, 2, 3)])
    api.store.rewind_metrics(run, 1)
    api.store.append_metrics(run, [{"step": 2, "reward_mean": 0.5}])
    api.store.transition(run, RunStatus.SUCCEEDED)
    with ApiClient(api.url) as client, pytest.raises(typer.Exit) as ended:
        _follow(client, run, 3)
    assert ended.value.exit_code == 0
    lines = capsys.readouterr().out.splitlines()
    rewound = "[kpo] resumed from the checkpoint of step 1: the steps after it are trained again"
    assert rewound in lines
    at = lines.index(rewound)
    assert "step 3/3" in lines[at - 1] and "step 2/3" in lines[at + 1]
