"""Generation throughput of the `hf` and `vllm` backends on the same model, batch 64, one run.

Run it with an interpreter that has both backends (the vLLM test environment has transformers
too): `make bench-generation`, or `.venv-vllm/bin/python benchmarks/bench_generation.py`.
Without vLLM installed, only `hf` is measured and the table says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import print_table

from services.generation.base import SamplingSettings
from services.generation.registry import create_backend
from services.messages import Prompt

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "services/tasks/assets/tiny-arith"
# A KV cache sized for the tiny model; vLLM's default reserves 90% of (CPU) memory.
BACKEND_OPTIONS: dict[str, dict[str, object]] = {
    "hf": {},
    "vllm": {"max_model_len": 512, "kv_cache_memory_bytes": 256 * 2**20},
}


def bench_prompts(count: int) -> list[Prompt]:
    """Prompts of the built-in task, so response lengths are those of a real run."""
    from services.tasks import get_task

    task = get_task("arith")
    return task.generate_prompts(count, 0, task.default_difficulty, "eval")


def measure(backend_name: str, model: Path, prompts: list[Prompt], group: int, repeats: int):
    backend = create_backend(backend_name, model, **BACKEND_OPTIONS[backend_name])
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=256, seed=0)
    backend.generate(prompts[:2], 2, sampling)  # warm-up: kernels, caches, engine graphs
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        groups = backend.generate(prompts, group, sampling)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.response_token_ids) for g in groups for r in g)
        if best is None or tokens / seconds > best[0] / best[1]:
            best = (tokens, seconds)
    assert best is not None
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4, help="responses per prompt")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompts = bench_prompts(args.prompts)
    backends = ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
    results = {b: measure(b, args.model, prompts, args.group, args.repeats) for b in backends}
    hf_rate = results["hf"][0] / results["hf"][1]
    rows = [
        [
            name,
            str(tokens),
            f"{seconds:.2f}",
            f"{tokens / seconds:.0f}",
            f"{tokens / seconds / hf_rate:.2f}x",
        ]
        for name, (tokens, seconds) in results.items()
    ]
    print(
        f"generation, batch {args.prompts * args.group} ({args.prompts} prompts x {args.group}), "
        f"model {args.model.name}, {torch.get_num_threads()} torch threads"
    )
    print_table(["backend", "tokens", "seconds", "tokens/s", "vs hf"], rows)
    if "vllm" not in results:
        print("vllm: not installed in this interpreter (run `make bench-generation`)")


if __name__ == "__main__":
    main()
