"""A fixed vs an elastic pool of generation workers (`generation.actors`) on a long-tailed task
with a slow verifier: trained tokens/s of each, measured in the same run.

The fixed pool keeps the spec's starting size; the elastic one starts there and may grow to
`ELASTIC_MAX` workers while the learner waits for data (and shrink back while batches wait for
the learner). The verifier sleeps per check, longer for longer responses
(benchmarks/slow_verifier.py), with enough check processes that it adds latency, not a
bottleneck of its own: more workers then mean more groups generated and scored at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from slow_verifier import SLOW_VERIFIER

from services.observers import MetricsRecord
from services.pipeline import actors as actors_module
from services.reward.actor import start_verifier_actor
from services.spec import RunSpec

ELASTIC_MAX = 3
# Windows of a few steps on a CPU machine; on a cluster the defaults (60 s, 120 s) fit engines
# that take minutes to start.
ELASTIC_TUNING = {"window_s": 10.0, "cooldown_s": 10.0}
CHECK_PROCESSES = 8  # sleeping checks: they hold no core
# Each worker's share of the machine: every worker of the largest pool fits a local instance.
WORKER_CPUS = 0.25
# Groups one worker holds at once: few, so that one worker alone cannot keep the learner fed
# on long responses (generation the bottleneck, which more workers relieve).
PROMPTS_PER_WORKER = 4

RunMode = Callable[[RunSpec], list[MetricsRecord]]
Measured = Callable[[list[MetricsRecord], int], tuple[float, float, float]]


def add_to_actor_path() -> None:
    """Actors of a local Ray instance inherit this process's environment: they import the
    slow verifier from here."""
    here = str(Path(__file__).resolve().parent)
    paths = [here, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))


@contextmanager
def slow_verifiers() -> Iterator[None]:
    """The run's verifier actors run the slow verifier (the spec's names only the built-in
    ones); restored afterwards."""
    original = actors_module.start_verifier

    def start(spec: RunSpec) -> Any:
        reward = spec.reward
        return start_verifier_actor(
            SLOW_VERIFIER,
            {"timeout_s": reward.timeout_s, "format_reward": reward.format_reward},
            num_workers=CHECK_PROCESSES,
            plugin_modules=["slow_verifier"],
            num_cpus=0,
        )

    actors_module.start_verifier = start
    try:
        yield
    finally:
        actors_module.start_verifier = original


def pool_spec(long_tail: RunSpec, elastic: bool) -> RunSpec:
    """`long_tail` (an async streaming spec of long-tailed prompts) with one worker to start
    with, fixed or elastic up to ELASTIC_MAX."""
    data = long_tail.model_dump(mode="json")
    data["name"] = f"{long_tail.name}-{'elastic' if elastic else 'fixed'}"
    data["generation"].update(
        num_workers=1, num_cpus=WORKER_CPUS, prompts_per_batch=PROMPTS_PER_WORKER, actors=None
    )
    data["reward"]["timeout_s"] = max(data["reward"]["timeout_s"], 5.0)
    data["reward"]["call_timeout_s"] = max(data["reward"]["call_timeout_s"], 600.0)
    if elastic:
        data["generation"]["actors"] = {"min": 1, "max": ELASTIC_MAX, **ELASTIC_TUNING}
    return RunSpec.model_validate(data)


def compare_pools(
    long_tail: RunSpec, warmup: int, run_mode: RunMode, measured: Measured
) -> list[list[str]]:
    """Rows (pool, trained tokens/s, s/step, learner idle s/step, workers at the end, grows,
    shrinks, vs fixed) of the fixed and the elastic pool."""
    rows, rates = [], {}
    with slow_verifiers():
        for elastic in (False, True):
            records = run_mode(pool_spec(long_tail, elastic))
            rate, per_step, idle = measured(records, warmup)
            name = f"elastic 1-{ELASTIC_MAX}" if elastic else "fixed 1"
            rates[name] = rate
            last = records[-1]
            print(f"{name}: {rate:,.0f} trained tokens/s, {per_step:.2f} s/step", flush=True)
            rows.append(
                [
                    name,
                    f"{rate:,.0f}",
                    f"{per_step:.2f}",
                    f"{idle:.3f}",
                    str(last["generation_workers"]),
                    str(last["generation_pool_grows_total"]),
                    str(last["generation_pool_shrinks_total"]),
                ]
            )
    fixed = rates["fixed 1"]
    for row in rows:
        row.append(f"{rates[row[0]] / fixed:.2f}x")
    return rows
