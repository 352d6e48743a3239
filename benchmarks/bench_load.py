"""The control plane under load, with a real run training behind it.

1. Starts `kpo serve` (real uvicorn) in a process of its own on a free loopback port, with an
   API token and a data directory of its own under /tmp. Its store is the embedded local store
   (SQLite in that directory) unless KPO_STORE_URL names another, e.g.
   `KPO_STORE_URL=redis://127.0.0.1:6379/0`; `kpo serve` starts a local Ray head for its runs
   (RAY_ADDRESS is ignored here), stopped at the end with everything in the data directory.
2. Submits a run of examples/demo.yaml (the tiny model) with far more steps than the benchmark
   lasts, and waits for its first learner step.
3. Baseline: the request mix below from 1 client for --baseline-seconds (15), the run training.
4. Load: --clients (200) concurrent clients for --seconds (60), each sending its next request as
   soon as the last one is answered (no think time unless --think-ms), plus --sse (5) readers of
   the run's live event stream. A line of progress every --progress-every seconds (5).
5. Cancels the run and waits for it to record `cancelled`.

The mix (weights): list runs 15, get the run 30, metrics history since the client's last seen
step 25, /healthz 10, /metrics (Prometheus) 5, get an unknown run 15 (a 404, as expected).

Reported: requests, requests/s, p50/p95/p99/max latency per operation and overall, for the
baseline and under load, and "p99 under load / p99 baseline"; errors (connection errors,
timeouts, 5xx, and any 4xx an operation does not expect); the event streams' connect time and
delivery lag (record written by the learner -> event read by the client); the learner steps made
during the baseline and the load (steps per minute in each); how the run ended after its cancel.
The load generator is one asyncio loop: its own loop lag is reported, since a late loop adds to
every latency it measures. Exit status 1 when there were errors or the run did not end
`cancelled`.

    python benchmarks/bench_load.py [--clients 200] [--seconds 60] [--json OUT]
    make bench-load LOAD_ARGS="--clients 50 --json runs/load.json"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import print_table

from services.api.client import SseEvent, parse_sse
from services.jobs.ray_head import HEAD_FILE, LocalRayHead, free_port
from services.pipeline.outputs import json_safe
from services.pipeline.specs import load_run_spec

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.yaml"
FINAL = frozenset({"succeeded", "failed", "cancelled"})
OVERALL = "overall"


@dataclass(frozen=True)
class Operation:
    """One kind of request of the mix, and the statuses that are its normal answers."""

    name: str
    weight: int
    expected: frozenset[int] = frozenset({200})


OPERATIONS: tuple[Operation, ...] = (
    Operation("list runs", 15),
    Operation("get run", 30),
    Operation("metrics since step", 25),
    Operation("healthz", 10),
    Operation("prometheus /metrics", 5),
    Operation("unknown run (404)", 15, frozenset({404})),
)


# --- figures (pure) -----------------------------------------------------------------------------


def percentile(ordered: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) of sorted values, interpolated linearly between ranks
    (numpy's default); NaN for no values."""
    if not ordered:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not within 0..100")
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class LatencySummary:
    """Count, rate and latency percentiles (milliseconds) of one operation in one phase."""

    requests: int
    per_second: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


def summarize(latencies_s: Sequence[float], seconds: float) -> LatencySummary:
    """The summary of latencies given in seconds, over a phase of `seconds`."""
    ordered = sorted(latencies_s)
    rate = len(ordered) / seconds if seconds > 0 else math.nan

    def ms(q: float) -> float:
        return percentile(ordered, q) * 1e3

    return LatencySummary(len(ordered), rate, ms(50), ms(95), ms(99), ms(100))


def classify(status: int, expected: frozenset[int]) -> str | None:
    """The error kind of an answer with `status`, or None when it is not an error.

    A 5xx is always an error; a 4xx only when the operation does not expect it (a 404 for an
    unknown run is the right answer, a 404 for the live run is not).
    """
    if status in expected:
        return None
    return "5xx" if status >= 500 else f"unexpected {status}"


def ratio(under_load: float, baseline: float) -> float:
    """under_load / baseline; NaN where the baseline is zero or missing."""
    if not baseline or math.isnan(baseline) or math.isnan(under_load):
        return math.nan
    return under_load / baseline


def weighted_cycle(operations: Sequence[Operation], rng: random.Random) -> Iterator[Operation]:
    """Operations drawn at random by their weights, forever."""
    weights = [op.weight for op in operations]
    while True:
        yield from rng.choices(operations, weights, k=64)


# --- what one phase records ---------------------------------------------------------------------


@dataclass
class SseStats:
    connects: int = 0
    connect_s: list[float] = field(default_factory=list)
    events: int = 0
    lag_s: list[float] = field(default_factory=list)  # metrics record written -> event read
    last_step: int = 0


@dataclass
class Recorder:
    """Latencies by operation, errors by kind (with a few examples), the event streams."""

    latencies: dict[str, list[float]] = field(
        default_factory=lambda: {op.name: [] for op in OPERATIONS}
    )
    errors: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    sse: SseStats = field(default_factory=SseStats)
    loop_lag_s: list[float] = field(default_factory=list)
    cpu_share: float = math.nan  # CPU time of the load generator / wall time

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        if len(self.examples) < 5:
            self.examples.append(f"{kind}: {detail}"[:300])

    @property
    def done(self) -> int:
        return sum(len(values) for values in self.latencies.values())


@dataclass
class PhaseResult:
    name: str
    clients: int
    seconds: float
    summaries: dict[str, LatencySummary]
    errors: dict[str, int]
    error_examples: list[str]
    loop_lag_p99_ms: float
    generator_cpu_share: float
    steps_before: int
    steps_after: int
    sse: dict[str, Any] | None = None

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def steps_per_minute(self) -> float:
        return (self.steps_after - self.steps_before) * 60 / self.seconds


# --- the control plane and the run --------------------------------------------------------------


@contextmanager
def control_plane(data_dir: Path, token: str) -> Iterator[str]:
    """`kpo serve` in a process of its own over `data_dir`; yields its URL. At the end the server
    is stopped, then the local Ray head it started (with any job still running on it)."""
    port = free_port()
    env = {**os.environ, "KPO_DATA_DIR": str(data_dir), "KPO_API_TOKEN": token}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for name in ("KPO_API_TOKEN_FILE", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(name, None)
    command = [sys.executable, "-m", "services.cli", "serve", "--port", str(port)]
    log_path = data_dir / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with log_path.open("ab") as log_file:
        server = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 300  # the first start of a Ray head is slow on 2 cores
        while True:
            try:
                httpx.get(f"{url}/healthz", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"`kpo serve` did not start; its log:\n{_tail(log_path)}"
                    ) from None
                time.sleep(0.5)
        yield url
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        _stop_ray_head(data_dir)


def _stop_ray_head(data_dir: Path) -> None:
    temp_dir: str | None = None
    with suppress(OSError, ValueError):
        temp_dir = json.loads((data_dir / HEAD_FILE).read_text(encoding="utf-8"))["temp_dir"]
    LocalRayHead(data_dir).stop(timeout_s=5.0)
    if temp_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def submit_run(client: httpx.Client, config: Path) -> str:
    """Submit `config` with a step count the benchmark never reaches; the run's id."""
    spec = load_run_spec(config, ["name=bench-load", "pipeline.steps=1000000"])
    response = client.post("/v1/runs", json=spec.model_dump(mode="json"))
    if response.status_code != 201:
        raise RuntimeError(f"submitting the run: HTTP {response.status_code}: {response.text}")
    run_id: str = response.json()["id"]
    return run_id


def latest_step(client: httpx.Client, run_id: str, known: int = 0) -> int:
    """The run's newest learner step, reading its metrics history forward from `known`."""
    while True:
        response = client.get(
            f"/v1/runs/{run_id}/metrics", params={"since_step": known, "limit": 10_000}
        )
        response.raise_for_status()
        page = response.json()
        if page["last_step"] is None:
            return known
        known = int(page["last_step"])
        if len(page["records"]) < 10_000:
            return known


def run_status(client: httpx.Client, run_id: str) -> dict[str, Any]:
    response = client.get(f"/v1/runs/{run_id}")
    response.raise_for_status()
    run: dict[str, Any] = response.json()
    return run


def wait_for_first_step(client: httpx.Client, run_id: str, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    last_print = 0.0
    while True:
        step = latest_step(client, run_id)
        if step >= 1:
            return step
        run = run_status(client, run_id)
        if run["status"] in FINAL:
            lines = client.get(f"/v1/runs/{run_id}/logs", params={"tail": 30}).json()["lines"]
            raise RuntimeError(
                f"the run ended {run['status']} before its first step: {run.get('error')}\n"
                + "\n".join(lines)
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"no learner step within {timeout_s:.0f} s (run {run['status']})")
        if time.monotonic() - last_print > 15:
            print(f"  waiting for the run's first learner step (run {run['status']})", flush=True)
            last_print = time.monotonic()
        time.sleep(1.0)


def cancel_and_wait(client: httpx.Client, run_id: str, timeout_s: float) -> dict[str, Any]:
    """Cancel the run and wait for it to end; its final status, last step and time taken."""
    start = time.monotonic()
    response = client.post(f"/v1/runs/{run_id}/cancel")
    if response.status_code != 202:
        raise RuntimeError(f"cancelling the run: HTTP {response.status_code}: {response.text}")
    while True:
        run = run_status(client, run_id)
        if run["status"] in FINAL or time.monotonic() - start > timeout_s:
            break
        time.sleep(0.5)
    return {
        "status": run["status"],
        "seconds": round(time.monotonic() - start, 1),
        "last_step": latest_step(client, run_id),
        "error": run.get("error"),
    }


# --- the load -----------------------------------------------------------------------------------


def unknown_run_id(rng: random.Random) -> str:
    """A well-formed run id that no run has (ids are random: a clash is 1 in 2^48)."""
    return f"run-{rng.getrandbits(48):012x}"


async def api_client(
    http: httpx.AsyncClient,
    run_id: str,
    rng: random.Random,
    first_step: int,
    deadline: float,
    think_s: float,
    record: Recorder,
) -> None:
    """One client: requests of the mix, one after the other, until `deadline`."""
    since = max(-1, first_step - rng.randint(1, 20))
    operations = weighted_cycle(OPERATIONS, rng)
    while time.perf_counter() < deadline:
        op = next(operations)
        params: dict[str, Any] = {}
        if op.name == "list runs":
            path = "/v1/runs"
            params = {"limit": 20}
        elif op.name == "get run":
            path = f"/v1/runs/{run_id}"
        elif op.name == "metrics since step":
            path = f"/v1/runs/{run_id}/metrics"
            params = {"since_step": since}
        elif op.name == "healthz":
            path = "/healthz"
        elif op.name == "prometheus /metrics":
            path = "/metrics"
        else:
            path = f"/v1/runs/{unknown_run_id(rng)}"
        start = time.perf_counter()
        try:
            response = await http.get(path, params=params)
        except httpx.TimeoutException as error:
            record.error("timeout", f"{op.name}: {type(error).__name__}")
            continue
        except httpx.HTTPError as error:
            record.error("connection", f"{op.name}: {type(error).__name__}: {error}")
            await asyncio.sleep(0.1)  # a refused connection answers at once: do not spin
            continue
        record.latencies[op.name].append(time.perf_counter() - start)
        kind = classify(response.status_code, op.expected)
        if kind is not None:
            record.error(kind, f"{op.name} {path}: {response.text[:200]}")
        elif op.name == "metrics since step":
            last = response.json().get("last_step")
            since = since if last is None else int(last)
        if think_s > 0:
            await asyncio.sleep(think_s * rng.uniform(0.5, 1.5))


async def sse_events(response: httpx.Response) -> AsyncIterator[SseEvent]:
    """The events of a stream, parsed a message at a time by the project's parser."""
    block: list[str] = []
    async for line in response.aiter_lines():
        block.append(line)
        if not line:
            for event in parse_sse(iter(block)):
                yield event
            block = []


async def sse_reader(
    http: httpx.AsyncClient, run_id: str, phase_start_wall: float, record: Recorder
) -> None:
    """A reader of the run's live events until cancelled, reconnecting with Last-Event-ID."""
    last_id: str | None = None
    stats = record.sse
    while True:
        headers = {"Last-Event-ID": last_id} if last_id else {}
        start = time.perf_counter()
        try:
            async with http.stream("GET", f"/v1/runs/{run_id}/events", headers=headers) as response:
                stats.connects += 1
                stats.connect_s.append(time.perf_counter() - start)
                if response.status_code != 200:
                    await response.aread()
                    record.error(f"events {response.status_code}", response.text[:200])
                    await asyncio.sleep(1.0)
                    continue
                async for event in sse_events(response):
                    stats.events += 1
                    last_id = event.id or last_id
                    if event.kind == "metrics":
                        stats.last_step = max(stats.last_step, int(event.data.get("step", 0)))
                        written = event.data.get("time")
                        # Events replayed on connecting were written long before: not a lag.
                        if isinstance(written, int | float) and written >= phase_start_wall:
                            stats.lag_s.append(time.time() - written)
            record.error("events stream ended", "the stream ended while the run was running")
        except httpx.HTTPError as error:
            record.error("events connection", f"{type(error).__name__}: {error}")
        await asyncio.sleep(1.0)


async def loop_lag(record: Recorder, every_s: float = 0.1) -> None:
    """How late this process's event loop wakes up: the load generator's own delay."""
    while True:
        start = time.perf_counter()
        await asyncio.sleep(every_s)
        record.loop_lag_s.append(time.perf_counter() - start - every_s)


async def progress(
    name: str, record: Recorder, start: float, seconds: float, every_s: float
) -> None:
    previous, previous_t = 0, start
    while True:
        await asyncio.sleep(every_s)
        now = time.perf_counter()
        done = record.done
        rate = (done - previous) / (now - previous_t)
        recent = sorted(v for values in record.latencies.values() for v in values[-2000:])
        step = f", learner step {record.sse.last_step}" if record.sse.last_step else ""
        print(
            f"  [{name} {now - start:4.0f}/{seconds:.0f} s] {done:,} requests "
            f"({rate:,.0f}/s now), p99 of recent {percentile(recent, 99) * 1e3:,.0f} ms, "
            f"errors {sum(record.errors.values())}{step}",
            flush=True,
        )
        previous, previous_t = done, now


@dataclass(frozen=True)
class Phase:
    """What one phase sends, where, and for how long."""

    name: str
    url: str
    token: str
    run_id: str
    clients: int
    seconds: float
    sse_readers: int
    think_s: float = 0.0
    timeout_s: float = 10.0
    progress_every_s: float = 5.0
    seed: int = 0


async def drive(phase: Phase, first_step: int) -> tuple[Recorder, float]:
    """The phase's clients and readers for its seconds; the recorder and the phase's wall time
    (until the last request in flight at the deadline has its answer)."""
    record = Recorder()
    headers = {"Authorization": f"Bearer {phase.token}"}
    # A client of its own (one connection) per simulated client, as separate users have: one
    # shared pool of hundreds of connections costs httpx ~10x the CPU per request, and the load
    # generator, not the server, would set the pace. One TLS context for all (httpx makes one
    # per client otherwise, slowly, though nothing here uses TLS).
    tls = ssl.create_default_context()
    one = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    timeout = httpx.Timeout(phase.timeout_s)
    # No read timeout for the streams: they are quiet between learner steps (a ping every 15 s).
    stream_timeout = httpx.Timeout(phase.timeout_s, read=None)
    async with AsyncExitStack() as stack:

        async def new_client(limits: httpx.Limits, timeout: httpx.Timeout) -> httpx.AsyncClient:
            client = httpx.AsyncClient(
                base_url=phase.url, headers=headers, verify=tls, limits=limits, timeout=timeout
            )
            return await stack.enter_async_context(client)

        http = [await new_client(one, timeout) for _ in range(phase.clients)]
        streams = [await new_client(one, stream_timeout) for _ in range(phase.sse_readers)]
        background = [asyncio.create_task(loop_lag(record))]
        background += [
            asyncio.create_task(sse_reader(client, phase.run_id, time.time(), record))
            for client in streams
        ]
        start, cpu_start = time.perf_counter(), time.process_time()
        deadline = start + phase.seconds
        background.append(
            asyncio.create_task(
                progress(phase.name, record, start, phase.seconds, phase.progress_every_s)
            )
        )
        await asyncio.gather(
            *(
                api_client(
                    client,
                    phase.run_id,
                    random.Random(phase.seed * 100_003 + index),
                    first_step,
                    deadline,
                    phase.think_s,
                    record,
                )
                for index, client in enumerate(http)
            )
        )
        elapsed = time.perf_counter() - start
        record.cpu_share = (time.process_time() - cpu_start) / elapsed
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    return record, elapsed


def sse_figures(stats: SseStats, readers: int) -> dict[str, Any]:
    connect, lag = sorted(stats.connect_s), sorted(stats.lag_s)
    return {
        "readers": readers,
        "connects": stats.connects,
        "connect_p50_ms": percentile(connect, 50) * 1e3,
        "connect_max_ms": percentile(connect, 100) * 1e3,
        "events": stats.events,
        "metrics_events_live": len(lag),
        "lag_p50_ms": percentile(lag, 50) * 1e3,
        "lag_p99_ms": percentile(lag, 99) * 1e3,
        "lag_max_ms": percentile(lag, 100) * 1e3,
    }


def run_phase(phase: Phase, api: httpx.Client) -> PhaseResult:
    """Run `phase` against the live run; its figures, with the learner steps made meanwhile."""
    print(
        f"{phase.name}: {phase.clients} client(s), {phase.sse_readers} event stream reader(s), "
        f"{phase.seconds:.0f} s",
        flush=True,
    )
    before = latest_step(api, phase.run_id)
    record, elapsed = asyncio.run(drive(phase, before))
    after = latest_step(api, phase.run_id, before)
    summaries = {op: summarize(values, elapsed) for op, values in record.latencies.items()}
    every = [v for values in record.latencies.values() for v in values]
    summaries[OVERALL] = summarize(every, elapsed)
    return PhaseResult(
        name=phase.name,
        clients=phase.clients,
        seconds=elapsed,
        summaries=summaries,
        errors=dict(record.errors),
        error_examples=record.examples,
        loop_lag_p99_ms=percentile(sorted(record.loop_lag_s), 99) * 1e3,
        generator_cpu_share=record.cpu_share,
        steps_before=before,
        steps_after=after,
        sse=sse_figures(record.sse, phase.sse_readers) if phase.sse_readers else None,
    )


# --- the report ---------------------------------------------------------------------------------


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.1f}"


def _x(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}x"


def report(baseline: PhaseResult, load: PhaseResult, ended: dict[str, Any], store: str) -> None:
    print()
    print(
        f"store: {store}; baseline {baseline.clients} client for {baseline.seconds:.0f} s, "
        f"load {load.clients} clients for {load.seconds:.0f} s"
    )
    rows = []
    for op in [*(o.name for o in OPERATIONS), OVERALL]:
        b, u = baseline.summaries[op], load.summaries[op]
        rows.append(
            [
                op,
                f"{u.requests:,}",
                f"{u.per_second:,.1f}",
                _ms(u.p50_ms),
                _ms(u.p95_ms),
                _ms(u.p99_ms),
                _ms(u.max_ms),
                _ms(b.p99_ms),
                _x(ratio(u.p99_ms, b.p99_ms)),
            ]
        )
    headers = ["operation", "requests", "req/s", "p50 ms", "p95 ms", "p99 ms", "max ms"]
    print_table([*headers, "baseline p99 ms", "p99 load / p99 baseline"], rows)
    overall_b, overall_u = baseline.summaries[OVERALL], load.summaries[OVERALL]
    print()
    print(
        f"p99 under load / p99 baseline: {_x(ratio(overall_u.p99_ms, overall_b.p99_ms))} "
        f"({_ms(overall_u.p99_ms)} ms / {_ms(overall_b.p99_ms)} ms); "
        f"throughput {overall_u.per_second:,.0f} req/s under load, "
        f"{overall_b.per_second:,.0f} req/s with 1 client"
    )
    for phase in (baseline, load):
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(phase.errors.items())) or "none"
        print(f"errors ({phase.name}): {phase.error_count} ({kinds})")
        for example in phase.error_examples:
            print(f"  e.g. {example}")
    if load.sse:
        s = load.sse
        print(
            f"event streams: {s['readers']} readers, {s['connects']} connects "
            f"(p50 {_ms(s['connect_p50_ms'])} ms, max {_ms(s['connect_max_ms'])} ms), "
            f"{s['events']} events; delivery lag of {s['metrics_events_live']} live metrics "
            f"events p50 {_ms(s['lag_p50_ms'])} ms, p99 {_ms(s['lag_p99_ms'])} ms, "
            f"max {_ms(s['lag_max_ms'])} ms"
        )
    print(
        f"load generator (part of every latency above): loop lag p99 baseline "
        f"{_ms(baseline.loop_lag_p99_ms)} ms, load {_ms(load.loop_lag_p99_ms)} ms; CPU "
        f"{baseline.generator_cpu_share:.0%} / {load.generator_cpu_share:.0%} of one core"
    )
    for phase in (baseline, load):
        print(
            f"learner steps during the {phase.name}: {phase.steps_before} -> {phase.steps_after} "
            f"({phase.steps_per_minute:.1f} steps/min)"
        )
    print(
        f"run after its cancel: {ended['status']} in {ended['seconds']:.1f} s, "
        f"at step {ended['last_step']}" + (f" ({ended['error']})" if ended.get("error") else "")
    )


def _store_label() -> str:
    url = os.environ.get("KPO_STORE_URL")
    if not url:
        return "local (embedded, SQLite)"
    return "redis" if url.startswith(("redis://", "rediss://", "unix://")) else f"local ({url})"


def figures(
    args: argparse.Namespace,
    baseline: PhaseResult,
    load: PhaseResult,
    ended: dict[str, Any],
    store: str,
) -> dict[str, Any]:
    def phase(result: PhaseResult) -> dict[str, Any]:
        data = asdict(result)
        data["error_count"] = result.error_count
        data["steps_per_minute"] = result.steps_per_minute
        return data

    overall_b, overall_u = baseline.summaries[OVERALL], load.summaries[OVERALL]
    data: dict[str, Any] = json_safe(
        {
            "store": store,
            "clients": args.clients,
            "seconds": args.seconds,
            "sse_readers": args.sse,
            "think_ms": args.think_ms,
            "baseline": phase(baseline),
            "load": phase(load),
            "p99_ratio": ratio(overall_u.p99_ms, overall_b.p99_ms),
            "p99_ratio_by_operation": {
                op: ratio(load.summaries[op].p99_ms, baseline.summaries[op].p99_ms)
                for op in load.summaries
            },
            "run": ended,
        }
    )
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200, help="concurrent API clients")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the load")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--sse", type=int, default=5, help="readers of the live event stream")
    parser.add_argument("--baseline-seconds", type=float, default=15.0)
    parser.add_argument("--think-ms", type=float, default=0.0, help="mean pause between requests")
    parser.add_argument("--timeout", type=float, default=10.0, help="request timeout, seconds")
    parser.add_argument("--progress-every", type=float, default=5.0, help="seconds")
    parser.add_argument("--config", type=Path, default=DEMO, help="the run's YAML file")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="for the first step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.clients < 1 or args.seconds <= 0 or args.sse < 0:
        parser.error("--clients must be >= 1, --seconds > 0 and --sse >= 0")

    store = _store_label()
    token = secrets.token_urlsafe(24)
    data_dir = Path(tempfile.mkdtemp(prefix="kpo-load-"))
    ended: dict[str, Any] = {"status": "not started", "seconds": 0.0, "last_step": 0}
    try:
        print(f"starting `kpo serve` (store: {store}, data in {data_dir})", flush=True)
        with (
            control_plane(data_dir, token) as url,
            httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30
            ) as api,
        ):
            run_id = submit_run(api, args.config)
            print(f"submitted {run_id}; waiting for its first learner step", flush=True)
            wait_for_first_step(api, run_id, args.start_timeout)
            quiet = Phase(
                "baseline",
                url,
                token,
                run_id,
                clients=1,
                seconds=args.baseline_seconds,
                sse_readers=0,
                think_s=args.think_ms / 1e3,
                timeout_s=args.timeout,
                progress_every_s=args.progress_every,
                seed=args.seed,
            )
            busy = replace(
                quiet, name="load", clients=args.clients, seconds=args.seconds, sse_readers=args.sse
            )
            try:
                baseline = run_phase(quiet, api)
                load = run_phase(busy, api)
            finally:
                print(f"cancelling {run_id}", flush=True)
                ended = cancel_and_wait(api, run_id, timeout_s=300)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)

    report(baseline, load, ended, store)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = figures(args, baseline, load, ended, store)
        args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        print(f"figures: {args.json}")
    if baseline.error_count or load.error_count or ended["status"] != "cancelled":
        sys.exit(1)


if __name__ == "__main__":
    main()
