"""Sandbox calls per second and p50/p99 latency, and what tools cost generation, in one run.

Sandbox: a bare subprocess running the code (the baseline), the bwrap sandbox called directly,
and the bwrap sandbox over HTTP (the sandbox server on loopback, as generation workers call it).
Each runs `--clients` calls at a time for `--seconds`; ratios are against the bare subprocess.

Generation: the `hf` backend on the built-in `tiny-arith-tool` model (CPU) samples `--group`
responses to each of `--prompts` arith-tool prompts (`--difficulty`, temperature 1,
`--max-new-tokens`, a fixed seed), once without tools and once with them (fenced calls, up to 3
turns, a local bwrap pool of `--clients` slots). Reported: responses/s, model tokens/s
(observation tokens not counted), tool calls per response, and each rate against the run
without tools. Both runs follow a small warm-up generation.

    python benchmarks/bench_sandbox.py [--seconds 8] [--clients 2] [--prompts 32] [--group 8]
    python benchmarks/bench_sandbox.py --quick   # 2 s per sandbox case, 8 prompts x 4
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

from services.generation.base import SamplingSettings
from services.generation.hf_backend import HFBackend
from services.messages import Response
from services.tasks.models import resolve_model
from services.tasks.registry import get_task
from services.tools.client import HttpSandbox, LocalSandbox
from services.tools.config import ToolsConfig
from services.tools.sandbox import SandboxLimits, SandboxRunner, find_python
from services.tools.server import SandboxSettings
from tests.services.tools.sandbox_server import ThreadServer

# What a tool call of the arith-tool task looks like.
CODE = "print(123456789 * 987654321)"
EXPECTED = str(123456789 * 987654321)

# The generation part: the built-in tool model on its own task.
MODEL = "tiny-arith-tool"
TASK = "arith-tool"
TOOLS = ToolsConfig(enabled=True, max_turns=3, call_format="fenced", max_output_chars=64)


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


def generation_figures(responses: list[Response], seconds: float) -> dict[str, float]:
    """Responses/s, model tokens/s and tool calls per response of one timed generation."""
    model_tokens = sum(sum(response.is_model_token()) for response in responses)
    calls = sum(len(response.tool_calls) for response in responses)
    return {
        "seconds": seconds,
        "responses_per_s": len(responses) / seconds,
        "model_tokens_per_s": model_tokens / seconds,
        "calls_per_response": calls / len(responses),
    }


def measure_generation(
    args: argparse.Namespace,
) -> tuple[list[tuple[str, dict[str, float]]], dict[str, int]]:
    """(case, figures) of the arith-tool generation without tools, then with them; and the
    tool calls run (warm-up included) by result status."""
    prompts = get_task(TASK).generate_prompts(args.prompts, args.seed, args.difficulty, "train")
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)
    backend = HFBackend(resolve_model(MODEL))
    sandbox = LocalSandbox("bwrap", max_concurrency=args.clients)
    results: list[tuple[str, dict[str, float]]] = []
    try:
        for name in ("no tools", "tools"):
            if name == "tools":
                backend.enable_tools(
                    TOOLS.model_copy(update={"max_concurrent_calls": args.clients}), sandbox
                )
                sandbox.run(CODE)  # warm-up of the sandbox
            backend.generate(prompts[:2], 2, sampling)  # warm-up
            started = time.perf_counter()
            groups = backend.generate(prompts, args.group, sampling)
            seconds = time.perf_counter() - started
            results.append((name, generation_figures([r for g in groups for r in g], seconds)))
        counts = backend.tool_call_counts()
    finally:
        if backend.tools is not None:
            backend.tools.close()
        sandbox.close()
    return results, counts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="per sandbox case")
    parser.add_argument("--clients", type=int, default=2, help="concurrent sandbox calls")
    parser.add_argument("--prompts", type=int, default=32, help="arith-tool prompts generated")
    parser.add_argument("--group", type=int, default=8, help="responses per prompt")
    parser.add_argument("--difficulty", type=int, default=4, help="arith-tool difficulty")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="model tokens per response")
    parser.add_argument("--seed", type=int, default=0, help="prompts and sampling")
    parser.add_argument("--quick", action="store_true", help="--seconds 2 --prompts 8 --group 4")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.prompts, args.group = 2.0, 8, 4
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

    generation, call_counts = measure_generation(args)
    base = generation[0][1]
    print()
    print(
        f"{MODEL} on {TASK} (hf, CPU): {args.prompts} prompts x {args.group}, difficulty "
        f"{args.difficulty}, temperature 1, max_new_tokens {args.max_new_tokens}, seed "
        f"{args.seed}; tools: fenced, max_turns {TOOLS.max_turns}, {args.clients} sandbox slots"
    )
    print_table(
        [
            "generation",
            "s",
            "responses/s",
            "model tok/s",
            "calls/resp",
            "resp/s vs no tools",
            "tok/s vs no tools",
        ],
        [
            [
                name,
                f"{figures['seconds']:.1f}",
                f"{figures['responses_per_s']:.1f}",
                f"{figures['model_tokens_per_s']:.0f}",
                f"{figures['calls_per_response']:.2f}",
                f"{figures['responses_per_s'] / base['responses_per_s']:.2f}",
                f"{figures['model_tokens_per_s'] / base['model_tokens_per_s']:.2f}",
            ]
            for name, figures in generation
        ],
    )
    print(f"tool calls by status: {call_counts}")


if __name__ == "__main__":
    main()
