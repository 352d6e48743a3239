"""Delta publishes against dense ones (`pipeline.weight_delta`), part of `make bench-weight-sync`.

For each model and learning rate: float32 master weights (random-initialised as Hugging Face
initialises the model's layers), published in the model's publish dtype, move by one update of
Adam's first step (`lr` times the sign of a random gradient: the largest move Adam makes per
step at that rate). Version 1 is published, then version 2, both ways, and version 2 is timed
(the fastest of `--repeats` runs, each from fresh weights):

- `object_store`: the learner casts and packs each bucket and puts it (dense) or diffs it
  against its copy of version 1 and puts the patch (delta); one worker fetches every bucket
  (dense) or fetches and applies every patch to its copy, checking each digest (delta).
  Seconds: from the first cast to the worker holding version 2's bytes (loading them into a
  model costs the same either way and is left out). Bytes: what was put.
- `collective` (gloo, one receiver, threads of this process): rank 0 sends, the receiver takes
  every bucket (delta: applies and checks). Seconds: the send until the receiver is done.
  Bytes: every broadcast of rank 0 (headers and tags included).

After the timed publish the worker's bytes are checked against the learner's, bucket by bucket:
the benchmark fails if any differs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
import torch
from _timing import print_table
from torch import Tensor, nn

from services.weights.base import TensorSpec, WeightsManifest
from services.weights.buckets import pack_bucket, plan_buckets
from services.weights.collective import connect, open_weight_group
from services.weights.delta import DeltaBase
from services.weights.object_store import fetch_buckets, fetch_patched, put_buckets

HOST = "127.0.0.1"


def published_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The model's weights a publish sends: floating-point ones, tied ones once."""
    seen: set[int] = set()
    weights = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen or not tensor.is_floating_point():
            continue
        seen.add(tensor.data_ptr())
        weights[name] = tensor
    return weights


def master_weights(model: nn.Module) -> dict[str, Tensor]:
    """The model's float32 weights, tied ones once (as a publish sends them)."""
    return {name: t.detach().float().clone() for name, t in published_tensors(model).items()}


def adam_first_step(weights: dict[str, Tensor], lr: float, seed: int) -> None:
    """Move every weight by `lr` times the sign of a random gradient, in place."""
    generator = torch.Generator().manual_seed(seed)
    for tensor in weights.values():
        tensor.sub_(torch.randn(tensor.shape, generator=generator).sign_().mul_(lr))


def manifest_of(
    weights: dict[str, Tensor], dtype: torch.dtype, bucket_bytes: int
) -> WeightsManifest:
    name = str(dtype).removeprefix("torch.")
    specs = [TensorSpec(n, tuple(t.shape), name) for n, t in weights.items()]
    return WeightsManifest(1, plan_buckets(specs, bucket_bytes))


def published(
    weights: dict[str, Tensor], manifest: WeightsManifest, dtype: torch.dtype
) -> Iterator[dict[str, Tensor]]:
    """The buckets as a learner reads them: each tensor cast to the publish dtype."""
    for specs in manifest.buckets:
        yield {spec.name: weights[spec.name].to(dtype) for spec in specs}


def check_held(
    held: list[list[Tensor]],
    weights: dict[str, Tensor],
    manifest: WeightsManifest,
    dtype: torch.dtype,
) -> None:
    """AssertionError unless the receiver's buckets are the learner's, bit for bit."""
    sent = published(weights, manifest, dtype)
    for got, want in zip(held, sent, strict=True):
        if not torch.equal(pack_bucket(got), pack_bucket(list(want.values()))):
            raise AssertionError("the worker's bytes differ from the learner's")


def measure_object_store(
    weights: dict[str, Tensor],
    manifest: WeightsManifest,
    dtype: torch.dtype,
    lr: float,
    delta: bool,
) -> dict[str, float]:
    """Publish version 1 then (timed) version 2 through the object store to one worker."""
    sender, receiver = (DeltaBase(), DeltaBase()) if delta else (None, None)
    first = manifest
    offer = put_buckets(first, published(weights, first, dtype), sender)
    if receiver is not None:
        for _ in fetch_patched([offer], receiver):
            pass
    adam_first_step(weights, lr, seed=1)
    second = WeightsManifest(2, manifest.buckets)
    started = time.perf_counter()
    offer = put_buckets(second, published(weights, second, dtype), sender)
    put_seconds = time.perf_counter() - started
    chunks = fetch_buckets(offer) if receiver is None else fetch_patched([offer], receiver)
    held = [list(bucket.values()) for bucket in chunks]  # views: what the worker holds
    seconds = time.perf_counter() - started
    check_held(held, weights, second, dtype)
    return {
        "bytes": float(offer.sent_bytes),
        "seconds": seconds,
        "put_seconds": put_seconds,
        "changed": offer.changed_fraction,
    }


def measure_collective(
    weights: dict[str, Tensor],
    manifest: WeightsManifest,
    dtype: torch.dtype,
    lr: float,
    delta: bool,
) -> dict[str, float]:
    """Send version 1 then (timed) version 2 over a gloo group to one receiver."""
    group = open_weight_group(2, "gloo", 1, host=HOST, timeout_s=600, delta=delta)
    ends: dict[int, Any] = {}
    joining = threading.Thread(target=lambda: ends.update({1: connect(group, 1, host=HOST)}))
    joining.start()
    ends[0] = connect(group, 0, host=HOST)
    joining.join()
    try:
        _send(ends, weights, manifest, dtype)
        adam_first_step(weights, lr, seed=1)
        second = WeightsManifest(2, manifest.buckets)
        before = sum(ends[0].messages)
        started = time.perf_counter()
        held = _send(ends, weights, second, dtype)
        seconds = time.perf_counter() - started
        check_held(held, weights, second, dtype)
        return {"bytes": float(sum(ends[0].messages) - before), "seconds": seconds}
    finally:
        for end in ends.values():
            end.close()


def _send(
    ends: dict[int, Any], weights: dict[str, Tensor], manifest: WeightsManifest, dtype: torch.dtype
) -> list[list[Tensor]]:
    held: list[list[Tensor]] = []

    def receive() -> None:
        held.extend(list(bucket.values()) for bucket in ends[1].receive(manifest))

    receiving = threading.Thread(target=receive)
    receiving.start()
    ends[0].send(manifest, published(weights, manifest, dtype))
    receiving.join()
    return held


def measure_case(
    model: nn.Module, lr: float, dtype: torch.dtype, bucket_bytes: int, repeats: int = 1
) -> dict[str, Any]:
    """Dense and delta, over both transports, for `model` at `lr` (fresh weights each time):
    the fastest of `repeats` runs of each."""
    base = master_weights(model)
    manifest = manifest_of(base, dtype, bucket_bytes)
    result: dict[str, Any] = {
        "lr": lr,
        "dtype": str(dtype).removeprefix("torch."),
        "weights_bytes": manifest.nbytes,
    }
    for transport, measure in (
        ("object_store", measure_object_store),
        ("collective", measure_collective),
    ):
        for delta in (False, True):
            runs = []
            for _ in range(repeats):
                weights = {name: tensor.clone() for name, tensor in base.items()}
                runs.append(measure(weights, manifest, dtype, lr, delta))
                del weights
            fastest = min(runs, key=lambda run: run["seconds"])
            result[f"{transport}_{'delta' if delta else 'dense'}"] = fastest
    return result


def print_delta_report(cases: list[dict[str, Any]]) -> None:
    print("\nDelta publishes (pipeline.weight_delta: auto) against dense: version 2, one step on")
    headers = ["model", "lr", "dtype", "transport", "changed", "dense MB", "delta MB"]
    headers += ["bytes", "dense s", "delta s", "time"]
    rows = []
    for case in cases:
        changed = case["object_store_delta"]["changed"]
        for transport in ("object_store", "collective"):
            dense, delta = case[f"{transport}_dense"], case[f"{transport}_delta"]
            rows.append(
                [
                    case["model"],
                    f"{case['lr']:.0e}",
                    case["dtype"],
                    transport,
                    f"{changed:.4f}",
                    f"{dense['bytes'] / 2**20:.1f}",
                    f"{delta['bytes'] / 2**20:.2f}",
                    f"{dense['bytes'] / max(delta['bytes'], 1):.1f}x fewer",
                    f"{dense['seconds']:.2f}",
                    f"{delta['seconds']:.2f}",
                    f"{delta['seconds'] / dense['seconds']:.2f}x",
                ]
            )
    print_table(headers, rows)
    print("goals: at 1e-6, >= 10x fewer bytes and a publish of <= 0.5x the dense one's time")


def ensure_ray() -> None:
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
