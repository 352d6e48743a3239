"""Sandbox calls per second and p50/p99 latency, in one run: a bare subprocess running the
code (the baseline), the bwrap sandbox called directly, and the bwrap sandbox over HTTP (the
sandbox server on loopback, as generation workers call it). Each runs `--clients` calls at a
time for `--seconds`; ratios are against the bare subprocess.

    python benchmarks/bench_sandbox.py [--seconds 8] [--clients 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import print_table

from services.tools.client import HttpSandbox
from services.tools.sandbox import SandboxLimits, SandboxRunner, find_python
from services.tools.server import SandboxSettings
from tests.services.tools.sandbox_server import ThreadServer

# What a tool call of the arith-tool task looks like.
CODE = "print(123456789 * 987654321)"
EXPECTED = str(123456789 * 987654321)


def measure(call: Callable[[], str], seconds: float, clients: int) -> tuple[float, list[float]]:
    """(calls per second, latencies in s) of `clients` threads calling for `seconds`."""
    latencies: list[float] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            output = call()
            elapsed = time.perf_counter() - started
            if output != EXPECTED:
                raise RuntimeError(f"wrong output {output!r}")
            with lock:
                latencies.append(elapsed)

    call()  # warm-up (page cache, imports)
    began = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(latencies) / (time.monotonic() - began), latencies


def quantile_ms(latencies: list[float], q: int) -> float:
    return statistics.quantiles(latencies, n=100)[q - 1] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=2)
    args = parser.parse_args()
    python = find_python()

    def bare() -> str:
        done = subprocess.run([python, "-I", "-c", CODE], capture_output=True, check=True)
        return done.stdout.decode().strip()

    runner = SandboxRunner("bwrap", SandboxLimits(), slots=args.clients)
    settings = SandboxSettings(max_concurrency=args.clients, max_queue=args.clients)
    rows: list[list[str]] = []
    with ThreadServer(settings) as server, HttpSandbox(server.url) as http:
        cases: list[tuple[str, Callable[[], str]]] = [
            ("bare subprocess", bare),
            ("bwrap", lambda: runner.run(CODE).output),
            ("bwrap over HTTP", lambda: http.run(CODE).output),
        ]
        baseline = 0.0
        for name, call in cases:
            rate, latencies = measure(call, args.seconds, args.clients)
            baseline = baseline or rate
            rows.append(
                [
                    name,
                    f"{rate:.1f}",
                    f"{quantile_ms(latencies, 50):.1f}",
                    f"{quantile_ms(latencies, 99):.1f}",
                    f"{rate / baseline:.2f}",
                ]
            )
    print(f"{args.clients} clients, {args.seconds:g} s each, code: {CODE}")
    print_table(["backend", "calls/s", "p50 ms", "p99 ms", "rate vs bare"], rows)


if __name__ == "__main__":
    main()
