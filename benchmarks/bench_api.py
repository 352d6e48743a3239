"""Control-plane latency under load, for both stores, in one run.

1. `GET /v1/runs/{id}` from 50 concurrent clients against a real uvicorn server (its own process).
2. Metrics ingestion: 50 concurrent writers (as 50 run drivers would) each appending one metrics
   record per call to its own run, straight into the store, as drivers do.

Each phase runs for --seconds (default 20) per store; the local (SQLite) store is the baseline
the Redis store is compared with. Needs `redis-server` on PATH (started here, on a free port).

    python benchmarks/bench_api.py [--seconds 20] [--clients 50]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import print_table

from services.store import Store, open_store
from tests.services.api.server import free_port
from tests.services.store.redis_server import RedisServer


def quantiles(latencies: list[float]) -> tuple[float, float]:
    """(p50, p99) in milliseconds."""
    cuts = statistics.quantiles(latencies, n=100)
    return cuts[49] * 1e3, cuts[98] * 1e3


async def _get_load(url: str, run_id: str, clients: int, seconds: float) -> list[float]:
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:

        async def one_client() -> None:
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                response = await client.get(f"/v1/runs/{run_id}")
                latencies.append(time.perf_counter() - start)
                response.raise_for_status()

        await asyncio.gather(*(one_client() for _ in range(clients)))
    return latencies


@contextmanager
def server_process(store_url: str) -> Iterator[str]:
    """uvicorn serving the API over `store_url` in a process of its own; yields its URL."""
    port = free_port()
    here = Path(__file__).resolve().parent
    env = {**os.environ, "KPO_STORE_URL": store_url, "PYTHONPATH": f"{here}:{here.parent}"}
    command = [sys.executable, "-m", "uvicorn", "--factory", "_api_server:app"]
    command += ["--port", str(port), "--log-level", "warning", "--no-access-log"]
    process = subprocess.Popen(command, cwd=here, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/healthz", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the API server did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def bench_get(store: Store, store_url: str, clients: int, seconds: float) -> list[float]:
    run = store.create_run({"name": "bench"})
    with server_process(store_url) as url:
        return asyncio.run(_get_load(url, run.id, clients, seconds))


def bench_ingest(store: Store, clients: int, seconds: float) -> list[float]:
    runs = [store.create_run({"name": f"ingest-{i}"}).id for i in range(clients)]
    latencies: list[list[float]] = [[] for _ in runs]
    deadline = time.perf_counter() + seconds
    record = {"reward_mean": 0.5, "entropy": 0.1, "clip_fraction": 0.01, "staleness_mean": 1.0}

    def writer(index: int) -> None:
        step = 0
        while time.perf_counter() < deadline:
            step += 1
            start = time.perf_counter()
            store.append_metrics(runs[index], [{"step": step, **record}])
            latencies[index].append(time.perf_counter() - start)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [value for per_client in latencies for value in per_client]


def stores(work: Path, redis_url: str) -> list[tuple[str, str]]:
    """(name, URL) of each store; every phase creates runs of its own."""
    return [("local", str(work / "local")), ("redis", redis_url)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=50)
    args = parser.parse_args()
    rows, rates = [], {}
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as redis:
        work = Path(tmp)
        for name, store_url in stores(work, redis.url):
            for phase in ("GET /v1/runs/{id}", "ingest metrics"):
                store = open_store(store_url)
                if phase == "ingest metrics":
                    latencies = bench_ingest(store, args.clients, args.seconds)
                else:
                    latencies = bench_get(store, store_url, args.clients, args.seconds)
                store.close()
                p50, p99 = quantiles(latencies)
                rates[(name, phase)] = len(latencies) / args.seconds
                rows.append(
                    [name, phase, f"{rates[(name, phase)]:,.0f}", f"{p50:.1f}", f"{p99:.1f}"]
                )
    print(f"{args.clients} concurrent clients, {args.seconds:.0f} s per row")
    print_table(["store", "operation", "requests/s", "p50 ms", "p99 ms"], rows)
    for phase in ("GET /v1/runs/{id}", "ingest metrics"):
        ratio = rates[("redis", phase)] / rates[("local", phase)]
        print(f"{phase}: redis / local throughput {ratio:.2f}x")


if __name__ == "__main__":
    main()
