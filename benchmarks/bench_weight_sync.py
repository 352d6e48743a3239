"""Weight sync: from the end of a learner step to every generation worker holding the new weights.

A random-initialised Qwen2 model (default: Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes, tied
embeddings; `--quick`: a small one) is saved once with the tiny model's tokenizer. On a local
Ray instance one learner rank (the real `LearnerImpl`, float32 master weights, publishing in
`--compute-dtype`) and `--receivers` generation workers' backends (`HFBackend` in the compute
dtype, in Ray actors of their own) then time each transport, `--repeats` times:

- `object_store`: the learner gathers the weights bucket by bucket and puts each bucket into
  Ray's object store (what `step` does after training); the driver hands the offer to every
  worker, which fetches one bucket at a time and loads it (`load_weight_buckets`);
- `collective`: the learner returns the manifest; every worker receives the broadcast buckets
  and loads them (`receive_weights(apply=True)`) while the learner sends them (`send_weights`)
  over a gloo group formed once beforehand (its set-up time is printed, not counted).

Before each publish the learner's weights are negated in place (a new version, cheaper than a
training step, whose cost does not depend on the transport), and after the last one every
worker's weights are checked against the learner's (sha256 of every tensor's bytes): the
benchmark fails if any differs.

Then the learner's idle time per step, with and without the overlapped publish
(`pipeline.overlap_publish`), over each transport, in one run: the learner trains `--idle-steps`
steps on a synthetic batch, each followed by a publish that the workers load, as the driver
orders them: without overlap the next step is sent once the offer is in (object_store) or the
send is done (collective); with it, right after the publish is started (collective: its send
armed, and started while the workers receive, each version once the last is acknowledged).
Idle time is the learner's own `learner_idle_seconds` (from the end of one step to the start of
the next), its mean over the steps after the first; seconds per step are the loop's wall time
over its steps. The workers' weights are checked against the
learner's after the last publish (sha256), as above.

Seconds: the best of the repeats, from the publish call to every worker done. Extra host
memory: per process, peak RSS during the publish minus RSS before it (VmHWM reset first;
allocations of 128 KiB and more are mmapped, so RSS follows the live tensors); the maximum
over the repeats, and over the workers. With object_store the learner's RSS includes the
object-store pages it wrote (shared memory, `object_store_bytes` in all, freed when the offer
is dropped) and a worker's the pages of the bucket it reads. Ratios are against object_store
in the same run. Linux only (reads /proc/self/status). On CPU and gloo: NCCL and CUDA copies
are what a GPU run measures (scripts/gpu_check.sh).

Then delta against dense publishes (benchmarks/weight_delta.py) and, on a Ray cluster of two
nodes of its own, a new worker's whole copy of a delta publish's version from the learner's node
against from a peer on its own (benchmarks/peer_weights.py).

Usage: python benchmarks/bench_weight_sync.py [--quick] [--bucket-mb 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray
import torch
import yaml
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import print_table
from bench_learner import (
    QWEN25_05B,
    SIZING_SHAPES,
    ModelShape,
    mmap_large_allocations,
    param_counts,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    run_forked,
    save_model,
    synthetic_groups,
)
from peer_weights import measure_peer_copy, print_peer_report
from weight_delta import manifest_of, measure_case, print_delta_report, published_tensors

from kpo_core.config import AlgorithmConfig
from services.generation.hf_backend import HFBackend
from services.learner.actor import CONCURRENCY_GROUPS, LearnerImpl
from services.spec import LearnerConfig
from services.tasks.tiny_model import DEFAULT_MODEL_DIR
from services.weights.base import WeightGroup, WeightsManifest, WeightsOffer, WeightTransportName
from services.weights.object_store import fetch_buckets

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
TRANSPORTS: tuple[WeightTransportName, ...] = ("object_store", "collective")
QUICK = ModelShape("quick", 256, 4, 4, 2, 1024, 32000, tied=True)
QWEN25_15B = SIZING_SHAPES[0]
QUICK_BUCKET_MB = 4
# The response limit KPO's `reference_length: auto` resolves to.
RESPONSE_LENGTH = 256
# The synthetic batch the idle-time measurement trains on: rows x response tokens.
IDLE_BATCH_ROWS, IDLE_BATCH_TOKENS, IDLE_PROMPT_TOKENS = 4, 64, 16


def fingerprint(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> sha256 of the tensor's bytes (exact, any dtype)."""
    return {
        name: hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().data).hexdigest()
        for name, t in state.items()
    }


class Memory:
    """Peak RSS of this process above where a measurement started."""

    def start_measure(self) -> None:
        reset_peak_rss()
        self._base = rss_bytes()

    def extra_peak(self) -> int:
        return peak_rss_bytes() - self._base


class SyncLearner(LearnerImpl, Memory):
    """The learner rank, plus what the benchmark needs: a transport switch (both transports
    from one loaded model), a new version without training, and its memory."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        mmap_large_allocations()
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        super().__init__(*args, **kwargs)

    def use_transport(self, transport: WeightTransportName) -> None:
        self.publisher.switch(transport=transport)

    def use_overlap(self, overlap: bool) -> None:
        """Publish as `overlap_publish` would have it (this one rank)."""
        self.publisher.switch(overlap=overlap)

    @torch.no_grad()
    def new_version(self) -> None:
        for parameter in self.core.model.parameters():
            parameter.neg_()

    def fingerprint(self) -> dict[str, str]:
        return fingerprint(self.published_state_dict())


class SyncReceiver(Memory):
    """A generation worker's backend in its own process, loading what is published."""

    def __init__(self, model_dir: str, dtype: str, threads: int) -> None:
        mmap_large_allocations()
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        torch.set_num_threads(threads)
        self.backend = HFBackend(model_dir, dtype=dtype)

    def fetch(self, wrapped: list[WeightsOffer]) -> int:
        offer = wrapped[0]
        self.backend.load_weight_buckets(fetch_buckets(offer), offer.manifest)
        return self.backend.policy_version

    def join(self, group: WeightGroup, rank: int) -> None:
        self.backend.join_weight_group(group, rank)

    def receive(self, manifest: WeightsManifest) -> int:
        self.backend.receive_weights(manifest, apply=True)
        return self.backend.policy_version

    def fingerprint(self) -> dict[str, str]:
        return fingerprint(dict(self.backend.model.state_dict()))


def measure_transport(
    args: argparse.Namespace,
    learner: Any,
    receivers: list[Any],
    transport: WeightTransportName,
) -> dict[str, Any]:
    """`args.repeats` publishes over `transport`: best seconds, peak extra memory."""
    timeout = args.timeout_s
    ray.get(learner.use_transport.remote(transport), timeout=timeout)
    setup_s = 0.0
    if transport == "collective":
        start = time.perf_counter()
        group = ray.get(learner.open_weight_group.remote(1 + len(receivers), 1))
        joins = [r.join.remote(group, rank) for rank, r in enumerate(receivers, start=1)]
        ray.get([learner.connect_weight_group.remote(group), *joins], timeout=timeout)
        setup_s = time.perf_counter() - start
    seconds: list[float] = []
    learner_extra, receiver_extra = 0, 0
    stored = 0
    everyone = [learner, *receivers]
    for _ in range(args.repeats):
        ray.get(learner.new_version.remote(), timeout=timeout)
        ray.get([actor.start_measure.remote() for actor in everyone], timeout=timeout)
        start = time.perf_counter()
        # new_version changes the weights, not the version number (still 0).
        learner.publish.remote(0)
        offer: WeightsOffer = ray.get(learner.offer.remote(0), timeout=timeout)
        if transport == "object_store":
            # In a list, as the driver does: each worker gets the refs, not the buckets.
            ray.get([r.fetch.remote([offer]) for r in receivers], timeout=timeout)
            stored = offer.manifest.nbytes
        else:
            loads = [r.receive.remote(offer.manifest) for r in receivers]
            ray.get([learner.send_weights.remote(), *loads], timeout=timeout)
        seconds.append(time.perf_counter() - start)
        del offer  # the object store frees the buckets
        extras = ray.get([actor.extra_peak.remote() for actor in everyone], timeout=timeout)
        learner_extra = max(learner_extra, extras[0])
        receiver_extra = max(receiver_extra, *extras[1:])
    check_workers_hold_the_learners_weights(learner, receivers, transport, timeout)
    return {
        "transport": transport,
        "seconds": min(seconds),
        "seconds_mean": sum(seconds) / len(seconds),
        "learner_extra_peak_bytes": learner_extra,
        "receiver_extra_peak_bytes": receiver_extra,
        "object_store_bytes": stored,
        "group_setup_seconds": setup_s,
    }


def check_workers_hold_the_learners_weights(
    learner: Any, receivers: list[Any], what: str, timeout: float
) -> None:
    want = ray.get(learner.fingerprint.remote(), timeout=timeout)
    for index, got in enumerate(ray.get([r.fingerprint.remote() for r in receivers])):
        differing = sorted(name for name in want if got.get(name) != want[name])
        if differing or got.keys() != want.keys():
            raise RuntimeError(
                f"{what}: worker {index} does not hold the learner's weights: {differing[:5]}"
            )


def measure_idle(
    args: argparse.Namespace,
    learner: Any,
    receivers: list[Any],
    vocab: int,
    transport: WeightTransportName,
    overlap: bool,
) -> dict[str, Any]:
    """`args.idle_steps` learner steps, each published over `transport` and loaded by every
    worker, ordered as the driver orders them (module doc)."""
    timeout = args.timeout_s
    ray.get(
        [learner.use_transport.remote(transport), learner.use_overlap.remote(overlap)],
        timeout=timeout,
    )
    batch = ray.put(
        synthetic_groups(IDLE_BATCH_ROWS, IDLE_BATCH_TOKENS, IDLE_PROMPT_TOKENS, vocab, seed=0)
    )
    version = int(ray.get(learner.version.remote(), timeout=timeout))
    idle: list[float] = []
    loads: list[Any] = []
    start = time.perf_counter()
    step = learner.step.remote(batch)
    for index in range(args.idle_steps):
        record = ray.get(step, timeout=timeout)
        if index > 0:  # the first waited for this loop to begin
            idle.append(float(record["learner_idle_seconds"]))
        version += 1
        more = index + 1 < args.idle_steps
        learner.publish.remote(version, overlap and transport == "collective")
        offer_ref = learner.offer.remote(version)
        if overlap and more:
            step = learner.step.remote(batch)  # the publish goes on beside it
        offer: WeightsOffer = ray.get(offer_ref, timeout=timeout)
        if transport == "object_store":
            if not overlap and more:
                step = learner.step.remote(batch)  # the offer is in: the learner may go on
            loads += [r.fetch.remote([offer]) for r in receivers]
        else:
            # One version at a time, each once the last is acknowledged (as the driver sends).
            ray.get(loads, timeout=timeout)
            loads = [r.receive.remote(offer.manifest) for r in receivers]
            if overlap:
                loads.append(learner.send.remote(version))  # the armed send: the step goes on
            else:
                ray.get(learner.send_weights.remote(), timeout=timeout)  # the learner is held
                if more:
                    step = learner.step.remote(batch)
        del offer
    ray.get(loads, timeout=timeout)
    seconds = time.perf_counter() - start
    check_workers_hold_the_learners_weights(learner, receivers, "idle", timeout)
    return {
        "transport": transport,
        "overlap": overlap,
        "steps": args.idle_steps,
        "idle_seconds_mean": sum(idle) / len(idle) if idle else float("nan"),
        "idle_seconds": idle,
        "seconds_per_step": seconds / args.idle_steps,
    }


def measure_shape(args: argparse.Namespace, shape: ModelShape) -> dict[str, Any]:
    """Save a model of `shape`, start the learner and the workers, measure both transports."""
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as model_dir:
        start = time.perf_counter()
        [saved] = run_forked(save_model, 1, args.threads, args.timeout_s, shape, model_dir, 0)
        learner_config = LearnerConfig(
            lr=1e-6, num_cpus=args.threads, compute_dtype=args.compute_dtype
        )
        # No CPUs reserved: the processes share the machine's cores, as a run's would.
        learner_class = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(SyncLearner)  # type: ignore[call-overload]
        learner: Any = learner_class.options(num_cpus=0)
        learner = learner.remote(
            model_dir,
            learner_config,
            AlgorithmConfig().with_response_length(RESPONSE_LENGTH),
            1.0,
            0,
            weight_bucket_mb=args.bucket_mb,
        )
        receiver: Any = ray.remote(SyncReceiver).options(num_cpus=0)
        receivers = [
            receiver.remote(model_dir, args.compute_dtype, args.threads)
            for _ in range(args.receivers)
        ]
        ray.get(
            [learner.setup.remote(""), *[r.start_measure.remote() for r in receivers]],
            timeout=args.timeout_s,
        )
        print(
            f"[{shape.name}] {saved['params'] / 1e6:.1f}M parameters, learner and "
            f"{len(receivers)} workers up ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        results = []
        try:
            for transport in TRANSPORTS:
                start = time.perf_counter()
                result = measure_transport(args, learner, receivers, transport)
                results.append(result)
                print(
                    f"[{shape.name}] {transport}: {result['seconds']:.2f} s, learner +"
                    f"{result['learner_extra_peak_bytes'] / MiB:.0f} MiB, worker +"
                    f"{result['receiver_extra_peak_bytes'] / MiB:.0f} MiB "
                    f"({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
            idle = []
            for transport in TRANSPORTS:
                for overlap in (False, True):
                    result = measure_idle(args, learner, receivers, shape.vocab, transport, overlap)
                    idle.append(result)
                    print(
                        f"[{shape.name}] {transport}, "
                        f"{'overlapped' if overlap else 'sequential'} publish: learner idle "
                        f"{result['idle_seconds_mean']:.3f} s per step, "
                        f"{result['seconds_per_step']:.2f} s per step",
                        flush=True,
                    )
        finally:
            for actor in (learner, *receivers):
                ray.kill(actor)
    for result in idle:
        [sequential] = [
            other
            for other in idle
            if other["transport"] == result["transport"] and not other["overlap"]
        ]
        result["vs_sequential"] = {
            key: ratio(result[key], sequential[key])
            for key in ("idle_seconds_mean", "seconds_per_step")
        }
    base = results[0]
    for result in results:
        result["vs_object_store"] = {
            key: ratio(result[key], base[key])
            for key in ("seconds", "learner_extra_peak_bytes", "receiver_extra_peak_bytes")
        }
    publish_bytes = param_counts(shape).total * (2 if args.compute_dtype == "bfloat16" else 4)
    return {
        "model": {**asdict(shape), "params": saved["params"], "publish_bytes": publish_bytes},
        "transports": results,
        "idle": idle,
    }


def ratio(value: float, baseline: float) -> float:
    return value / baseline if baseline > 0 else float("nan")


def print_report(shapes: list[dict[str, Any]]) -> None:
    rows = []
    for measured in shapes:
        for result in measured["transports"]:
            vs = result["vs_object_store"]
            rows.append(
                [
                    measured["model"]["name"],
                    result["transport"],
                    f"{result['seconds']:.2f}",
                    f"{vs['seconds']:.2f}x",
                    f"{result['learner_extra_peak_bytes'] / MiB:.1f}",
                    f"{vs['learner_extra_peak_bytes']:.2f}x",
                    f"{result['receiver_extra_peak_bytes'] / MiB:.1f}",
                    f"{vs['receiver_extra_peak_bytes']:.2f}x",
                    f"{result['object_store_bytes'] / MiB:.1f}",
                ]
            )
    headers = [
        "model", "transport", "seconds", "vs obj", "learner +MiB", "vs obj", "worker +MiB",
        "vs obj", "object store MiB",
    ]  # fmt: skip
    print()
    print_table(headers, rows)
    rows = [
        [
            measured["model"]["name"],
            result["transport"],
            "overlapped" if result["overlap"] else "sequential",
            f"{result['idle_seconds_mean']:.3f}",
            f"{result['vs_sequential']['idle_seconds_mean']:.2f}x",
            f"{result['seconds_per_step']:.2f}",
            f"{result['vs_sequential']['seconds_per_step']:.2f}x",
        ]
        for measured in shapes
        for result in measured["idle"]
    ]
    print()
    headers = ["model", "transport", "publish", "learner idle s/step", "vs seq", "s/step", "vs seq"]
    print_table(headers, rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"one small model ({QUICK.name}) instead"
    )
    model = parser.add_argument_group("one model of this shape instead (all six needed)")
    for flag in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab"):
        model.add_argument(f"--{flag}", type=int)
    parser.add_argument("--bucket-mb", type=int, help="pipeline.weight_bucket_mb (256; quick: 4)")
    parser.add_argument("--receivers", type=int, default=2, help="generation workers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--idle-steps", type=int, default=4, help="learner steps of each idle-time loop"
    )
    parser.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per call")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument(
        "--delta-only", action="store_true", help="only delta against dense publishes"
    )
    args = parser.parse_args(argv)
    flags = [args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab]
    if any(flag is not None for flag in flags) and not all(flag is not None for flag in flags):
        parser.error("a custom shape needs all of --layers --hidden --heads --kv-heads "
                     "--intermediate --vocab")  # fmt: skip
    if args.bucket_mb is None:
        args.bucket_mb = QUICK_BUCKET_MB if args.quick else 256
    if args.receivers < 1 or args.repeats < 1:
        parser.error("--receivers and --repeats must be at least 1")
    if args.idle_steps < 2:
        parser.error("--idle-steps must be at least 2 (the first step has no idle time)")
    return args


def shapes_of(args: argparse.Namespace) -> list[ModelShape]:
    if args.layers is not None:
        name = f"Qwen2 {args.layers}L/{args.hidden}H/V{args.vocab}"
        dims = (args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab)
        return [ModelShape(name, *dims, tied=True)]
    if args.quick:
        return [QUICK]
    return [QWEN25_05B, QWEN25_15B]


def measure_deltas(args: argparse.Namespace) -> tuple[list[dict[str, Any]], WeightsManifest]:
    """Delta against dense publishes (benchmarks/weight_delta.py): the demo's model at the
    demo's rate and publish dtype (float32), and a model of Qwen2.5-0.5B's shape (`--quick`: a
    small one; or the shape given) in bfloat16 at 1e-6 and 1e-5; with that model's bf16
    manifest (what `measure_peer_copy` moves)."""
    bucket_bytes = args.bucket_mb * MiB
    demo_lr = float(yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())["learner"]["lr"])
    demo = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR)
    repeats = args.repeats
    demo_case = measure_case(demo, demo_lr, torch.float32, bucket_bytes, repeats)
    cases = [{"model": "demo (tiny)", **demo_case}]
    del demo
    shape = shapes_of(args)[0]  # Qwen2.5-0.5B's, unless --quick or a shape is given
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(shape.hf_config(), dtype=torch.float32)  # type: ignore[no-untyped-call]
    for lr in (1e-6, 1e-5):
        case = measure_case(model, lr, torch.bfloat16, bucket_bytes, repeats)
        cases.append({"model": shape.name, **case})
    return cases, manifest_of(published_tensors(model), torch.bfloat16, bucket_bytes)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    started_ray = not ray.is_initialized()
    python_path = os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")) if p
    )
    env = {
        "PYTHONPATH": python_path,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    if started_ray:
        ray.init(
            num_cpus=os.cpu_count() or 1,
            include_dashboard=False,
            runtime_env={"env_vars": env},
        )
    try:
        shapes = [] if args.delta_only else shapes_of(args)
        measured = [measure_shape(args, shape) for shape in shapes]
        deltas, manifest = measure_deltas(args)
    finally:
        if started_ray:
            ray.shutdown()
    # A cluster of two nodes of its own: only where this run started (and stopped) its Ray.
    peer = measure_peer_copy(manifest, args.repeats, env) if started_ray else None
    result = {
        "settings": {key: value for key, value in vars(args).items() if key != "json"},
        "shapes": measured,
        "delta": deltas,
        "peer_copy": peer,
    }
    if measured:
        print_report(measured)
    print_delta_report(deltas)
    if peer is not None:
        print_peer_report(peer)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
