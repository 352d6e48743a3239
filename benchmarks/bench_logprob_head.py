"""The learner's log-prob head against a plain head, on CPU, in one run.

Three heads, forward + backward of the taken tokens' log-probs over N positions of one bias-free
head H -> V, float32, each timed in its own forked process:

  - fused: `vocab_chunked_logprobs` (services/learner/vocab_logprobs.py), with and without the
    entropy, with `--kernel` (torch by default: the eager path);
  - old: the head it replaced (benchmarks/_old_vocab_logprobs.py), with and without entropy;
  - plain: what a user writes by hand: per chunk of positions, logits = hidden @ W^T in float32,
    log_softmax, gather of the taken token, autograd keeping each chunk's [c, V] softmax; no
    entropy.

For each: seconds of one forward + backward (the least of `--repeats` in each of `--rounds`
rounds over the heads, after one untimed pass: the least disturbed by whatever else the machine
runs), the peak RSS above the inputs and gradient buffers (as benchmarks/bench_learner.py
measures it), and two counts that do not depend on the machine, taken on the eager path under a
TorchDispatchMode (`HeadTraffic`):

  - matrix products, as FLOPs / (N V H): 1.0 is one [N, H] x [H, V] product;
  - elementwise bytes per position x vocabulary element: the bytes read and written by every
    non-matmul, non-view aten op, counting each of its tensors (inputs and outputs) that has at
    least as many elements as the smallest [positions, vocabulary] block of the fused head and
    no dimension of the hidden size (so the weight's and hidden states' [., H] traffic, the
    same for every head, is left out), divided by N V. An op is counted at its inputs' and
    outputs' sizes, as if each were one kernel reading and writing them once: the figure is
    the traffic of the ops as written, not of what a kernel does inside.

Ratios are against the plain head measured in the same run, and so are the gaps of the values
(the largest |log-prob difference|) and of the gradients (the relative difference of the norms
of d hidden and d head). The goals the fused head is held to (`GOALS`, each met or missed in the
report): time <= 1.0x plain, peak memory <= 0.5x, elementwise bytes <= 1.2x, products <= plain
+ 1. tests/services/learner/test_logprob_head_traffic.py asserts the counted two.

`measure_heads` measures and returns the records, `report` prints them: benchmarks/
bench_learner_speed.py's CPU run reports the same through them.

Usage: python benchmarks/bench_logprob_head.py [--positions 512] [--hidden 896]
           [--vocab 151936] [--chunk 256] [--vocab-chunk 32768] [--threads 2]
           [--repeats 3] [--rounds 2] [--kernel torch|compiled] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

# The repository too: run as a script on a machine where the project is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _old_vocab_logprobs as old
from _timing import print_table
from bench_learner import (
    QWEN25_05B,
    mmap_large_allocations,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    run_forked,
)

from services.learner.distributed import RankGroup
from services.learner.vocab_kernels import LogprobKernel
from services.learner.vocab_logprobs import vocab_chunked_logprobs

MiB = 2**20
GOALS = {"time": 1.0, "peak": 0.5, "bytes": 1.2, "products_over_plain": 1.0}
# aten products: FLOPs / 2 of each, from the operands' shapes.
PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot"}
NO_DATA = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


@dataclass(frozen=True)
class Shape:
    positions: int
    hidden: int
    vocab: int
    chunk: int
    vocab_chunk: int
    seed: int = 0

    @property
    def smallest_block(self) -> int:
        """Elements of the fused head's smallest block (the last chunk x the last block)."""
        rows = self.positions % self.chunk or self.chunk
        columns = self.vocab % self.vocab_chunk or self.vocab_chunk
        return min(rows, self.chunk) * min(columns, self.vocab_chunk)


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


def _product_flops(name: str, args: Sequence[Any]) -> int:
    """Multiply-adds of one product, from its operands (the ones after an addend)."""
    operands = [t for t in args if isinstance(t, Tensor)]
    if name.startswith("add") or name.startswith("baddbmm"):
        operands = operands[1:]
    left, right = operands[0], operands[1]
    if left.dim() == 3:  # bmm: [b, m, k] x [b, k, n]
        return left.shape[0] * left.shape[1] * left.shape[2] * right.shape[2]
    if right.dim() == 1:  # mv, dot
        return left.numel()
    return left.shape[0] * left.shape[1] * right.shape[1]


class HeadTraffic(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts products (multiply-adds) and elementwise bytes of the [positions, vocabulary]
    tensors (module doc) of what runs under it."""

    def __init__(self, threshold: int, hidden: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.threshold, self.hidden = threshold, hidden
        self.product_flops = 0
        self.products = 0
        self.bytes = 0
        self.by_op: dict[str, int] = {}

    def _counted(self, tensor: Tensor) -> int:
        if tensor.numel() < self.threshold or self.hidden in tensor.shape:
            return 0
        return tensor.numel() * tensor.element_size()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__.rstrip("_")
        if name in PRODUCTS:
            self.products += 1
            self.product_flops += _product_flops(name, args)
        elif not func.is_view and name not in NO_DATA:
            inputs = _tensors(args) + _tensors([v for k, v in kwargs.items() if k != "out"])
            moved = sum(self._counted(t) for t in inputs + _tensors(out))
            if moved:
                self.bytes += moved
                self.by_op[name] = self.by_op.get(name, 0) + moved
        return out


def plain_head(shape: Shape, hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    parts = []
    for start in range(0, shape.positions, shape.chunk):
        logits = (hidden[start : start + shape.chunk] @ weight.t()).float()
        picked = targets[start : start + shape.chunk].unsqueeze(-1)
        parts.append(logits.log_softmax(-1).gather(-1, picked).squeeze(-1))
    return torch.cat(parts)


def head_of(path: str, kernel: LogprobKernel) -> Callable[[Shape, Tensor, Tensor, Tensor], Tensor]:
    """One of the heads by name: plain, fused[+entropy], old[+entropy]."""
    if path == "plain":
        return plain_head
    name, _, suffix = path.partition("+")
    entropy = suffix == "entropy"

    def run(shape: Shape, hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
        sizes = (shape.chunk, shape.vocab_chunk, entropy)
        if name == "old":
            logp, _ = old.vocab_chunked_logprobs(hidden, weight, None, targets, 1.0, *sizes)
        else:
            logp, _ = vocab_chunked_logprobs(hidden, weight, None, targets, 1.0, *sizes, kernel)
        return logp

    return run


PATHS = ("plain", "fused+entropy", "fused", "old+entropy", "old")


def inputs(shape: Shape, positions: int) -> tuple[Tensor, Tensor, Tensor]:
    """Hidden states [n, H] and the head [V, H] (both requiring grad), targets [n]."""
    generator = torch.Generator().manual_seed(shape.seed)
    hidden = torch.randn(positions, shape.hidden, generator=generator).requires_grad_()
    weight = (torch.randn(shape.vocab, shape.hidden, generator=generator) * 0.05).requires_grad_()
    targets = torch.randint(0, shape.vocab, (positions,), generator=generator)
    return hidden, weight, targets


def count(shape: Shape, path: str) -> dict[str, Any]:
    """The counts of one eager forward + backward of `path` (module doc)."""
    hidden, weight, targets = inputs(shape, shape.positions)
    weights = torch.randn(shape.positions, generator=torch.Generator().manual_seed(1))
    with HeadTraffic(shape.smallest_block, shape.hidden) as traffic:
        logp = head_of(path, "torch")(shape, hidden, weight, targets)
        torch.autograd.backward((logp * weights).sum())
    elements = shape.positions * shape.vocab
    return {
        "products": traffic.product_flops / (elements * shape.hidden),
        "product_calls": traffic.products,
        "bytes_per_element": traffic.bytes / elements,
        "bytes_by_op": {k: v / elements for k, v in sorted(traffic.by_op.items())},
    }


def measure(
    group: RankGroup, shape: Shape, path: str, kernel: LogprobKernel, repeats: int
) -> dict[str, Any]:
    """One head's seconds and peak RSS in this (forked) process (module doc), its values and
    gradient norms (for the gaps against the plain head), then its counts."""
    del group
    mmap_large_allocations()
    run = head_of(path, kernel)
    warm = inputs(shape, shape.positions)
    torch.autograd.backward(run(shape, *warm).sum())  # compiles, if compiled; warms the pools
    del warm
    hidden, weight, targets = inputs(shape, shape.positions)
    weight.grad, hidden.grad = torch.zeros_like(weight), torch.zeros_like(hidden)
    seconds, peaks, values = [], [], []
    for _ in range(repeats):
        base = rss_bytes()
        reset_peak_rss()
        start = time.perf_counter()
        logp = run(shape, hidden, weight, targets)
        torch.autograd.backward(logp.sum())
        seconds.append(time.perf_counter() - start)
        peaks.append(peak_rss_bytes() - base)
        values = logp.detach().tolist()
        del logp  # before the next pass, whose peak is its own
    assert weight.grad is not None and hidden.grad is not None
    return {
        "path": path,
        "seconds": min(seconds),
        "peak_bytes": max(peaks),
        "logp": values,
        # The gradients accumulated over the repeats: per pass, the norm over `repeats`.
        "grad_weight_norm": float(weight.grad.norm()) / repeats,
        "grad_hidden_norm": float(hidden.grad.norm()) / repeats,
        **count(shape, path),
    }


def goal_checks(record: dict[str, Any]) -> dict[str, bool]:
    """Each goal (`GOALS`) of one head against the plain head: met or not."""
    checks = {k: record[f"vs_plain_{k}"] <= GOALS[k] for k in ("time", "peak", "bytes")}
    checks["products"] = record["products_over_plain"] <= GOALS["products_over_plain"] + 1e-9
    return checks


def compare(records: list[dict[str, Any]]) -> None:
    """Each record's ratios, goals and value / gradient gaps against the plain head (the first);
    the values themselves are dropped once compared (thousands of floats)."""
    plain = records[0]
    for r in records:
        r["vs_plain_time"] = r["seconds"] / plain["seconds"]
        r["vs_plain_peak"] = r["peak_bytes"] / max(plain["peak_bytes"], 1)
        r["vs_plain_bytes"] = r["bytes_per_element"] / plain["bytes_per_element"]
        r["products_over_plain"] = r["products"] - plain["products"]
        r["logp_gap"] = max(abs(a - b) for a, b in zip(r["logp"], plain["logp"], strict=True))
        r["grad_gap"] = abs(r["grad_weight_norm"] / plain["grad_weight_norm"] - 1)
        r["grad_hidden_gap"] = abs(r["grad_hidden_norm"] / plain["grad_hidden_norm"] - 1)
        r["goals"] = goal_checks(r)
        r["meets_goals"] = all(r["goals"].values())
    for r in records:
        del r["logp"]


def measure_heads(
    shape: Shape, paths: Sequence[str], kernel: LogprobKernel, threads: int, repeats: int,
    rounds: int, timeout_s: float,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every head of `paths` (plain first), each in its own forked process, `rounds` times over
    the heads: the least seconds and the largest peak of the rounds; compared (`compare`)."""
    if not paths or paths[0] != "plain" or not set(paths) <= set(PATHS):
        raise ValueError(f"heads are {', '.join(PATHS)}, plain first; got {list(paths)}")
    best: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        for path in paths:
            start = time.perf_counter()
            [record] = run_forked(measure, 1, threads, timeout_s, shape, path, kernel, repeats)
            if path in best:
                record["seconds"] = min(record["seconds"], best[path]["seconds"])
                record["peak_bytes"] = max(record["peak_bytes"], best[path]["peak_bytes"])
            best[path] = record
            print(f"[head] {path}: {record['seconds']:.2f} s ({time.perf_counter() - start:.0f} s)",
                  flush=True)  # fmt: skip
    records = [best[path] for path in paths]
    compare(records)
    return records


def goals_text(record: dict[str, Any]) -> str:
    """The goals' verdict: met, or which were missed ("missed: time")."""
    missed = [name for name, met in record["goals"].items() if not met]
    return "met" if not missed else "missed: " + ", ".join(missed)


def report(shape: Shape, records: list[dict[str, Any]], threads: int, kernel: str) -> None:
    print(
        f"\nLog-prob head, forward + backward: {shape.positions} positions, hidden "
        f"{shape.hidden}, vocabulary {shape.vocab}, float32, {threads} thread(s); chunks of "
        f"{shape.chunk} positions, vocabulary blocks of {shape.vocab_chunk}; fused kernel {kernel}"
    )
    headers = ["head", "s", "vs plain", "peak MiB", "vs plain", "products", "B/elt", "vs plain",
               "logp gap", "grad gap (hidden, head)", "goals"]  # fmt: skip
    rows = [
        [
            r["path"], f"{r['seconds']:.2f}", f"{r['vs_plain_time']:.2f}x",
            f"{r['peak_bytes'] / MiB:.0f}", f"{r['vs_plain_peak']:.2f}x", f"{r['products']:.2f}",
            f"{r['bytes_per_element']:.1f}", f"{r['vs_plain_bytes']:.2f}x",
            f"{r['logp_gap']:.1e}", f"{r['grad_hidden_gap']:.1e}, {r['grad_gap']:.1e}",
            goals_text(r) if r["path"].startswith("fused") else "",
        ]
        for r in records
    ]  # fmt: skip
    print_table(headers, rows)
    print(
        "products: FLOPs / (N V H), 1.0 = one [N, H] x [H, V] product; B/elt: elementwise "
        "bytes read + written per position x vocabulary element (counted, eager); gaps: the "
        "largest |log-prob difference| and the relative difference of the gradients' norms, "
        "against the plain head; goals of the fused head: time <= 1.0x, peak <= 0.5x, "
        "bytes <= 1.2x plain, products <= plain + 1"
    )
    for r in records:
        ops = ", ".join(f"{k} {v:.0f}" for k, v in r["bytes_by_op"].items())
        print(f"  {r['path']}: {ops}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=QWEN25_05B.hidden)
    parser.add_argument("--vocab", type=int, default=QWEN25_05B.vocab)
    parser.add_argument("--chunk", type=int, default=256, help="positions per chunk")
    parser.add_argument("--vocab-chunk", type=int, default=32_768)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per head and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the heads")
    parser.add_argument("--kernel", choices=["torch", "compiled"], default="torch")
    parser.add_argument("--paths", default=",".join(PATHS), help="heads, plain first")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per head")
    parser.add_argument("--json", type=Path, help="write every figure here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    shape = Shape(args.positions, args.hidden, args.vocab, args.chunk, args.vocab_chunk)
    try:
        records = measure_heads(
            shape, args.paths.split(","), args.kernel, args.threads, args.repeats, args.rounds,
            args.timeout_s,
        )  # fmt: skip
    except ValueError as error:
        sys.exit(f"bench_logprob_head: {error}")
    report(shape, records, args.threads, args.kernel)
    result = {"shape": asdict(shape), "kernel": args.kernel, "threads": args.threads,
              "goals": GOALS, "heads": records}  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
