"""A new worker's whole copy of a version with delta publishes, part of `make bench-weight-sync`:
from the learner on another node against from a surviving worker on its own node
(services/weights/sources.py).

A Ray cluster of two nodes runs on this machine: the head holds the learner's copy, the other
a surviving worker's and the new worker. Each holder keeps the version as a delta publish's
sender or receiver does (`DeltaBase`: packed buckets in host memory, of the model's publish
size in bfloat16) and answers `dense_offer` as the learner and the worker do (`put_dense`). The
new worker asks, fetches every bucket and applies it to its own copy (checking each digest), as
`GenerationWorker` does before loading: seconds from the ask until it holds every byte, the
best of `repeats`. The two copies' bytes are equal (the digests check it). The nodes share this
machine's memory, so the learner's buckets cross a loopback socket between two object stores,
not a network: a cluster's network makes the learner's copy slower still.
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch
from ray.cluster_utils import Cluster

from services.weights.base import WeightsManifest, WeightsOffer
from services.weights.buckets import bucket_nbytes
from services.weights.delta import DeltaBase
from services.weights.object_store import fetch_patched, put_dense


class Holder:
    """A copy of version 1 (random bytes of each bucket's size, the same on every holder)."""

    def __init__(self, manifest: WeightsManifest) -> None:
        self.manifest = manifest
        self.base = DeltaBase()
        generator = torch.Generator().manual_seed(0)
        buckets = (
            torch.randint(0, 256, (bucket_nbytes(specs),), dtype=torch.uint8, generator=generator)
            for specs in manifest.buckets
        )
        for _ in self.base.encode(manifest.version, buckets):
            pass

    def dense_offer(self, at_least: int) -> WeightsOffer:
        return put_dense(self.base, self.manifest)


class NewWorker:
    def take(self, holder: Any, version: int) -> float:
        """Seconds to ask `holder` for `version` and hold every byte of it."""
        started = time.perf_counter()
        dense: WeightsOffer = ray.get(holder.dense_offer.remote(version))
        for _ in fetch_patched([dense], DeltaBase()):
            pass
        return time.perf_counter() - started


# Typed as Any: ray's overloads of `remote` hide `.options` from type checkers.
HolderActor: Any = ray.remote(num_cpus=0)(Holder)
NewWorkerActor: Any = ray.remote(num_cpus=0)(NewWorker)


def measure_peer_copy(
    manifest: WeightsManifest, repeats: int, env: dict[str, str]
) -> dict[str, Any]:
    """Seconds for a new worker to hold `manifest`'s version whole: from a holder on the other
    node (the learner's place) and from one on its own (a peer's)."""
    store = max(4 * manifest.nbytes, 128 * 2**20)  # each node's: two copies and room
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"resources": {"learner_node": 1}, "object_store_memory": store},
    )
    cluster.add_node(resources={"generation_node": 2}, object_store_memory=store)
    ray.init(address=cluster.address, runtime_env={"env_vars": env})
    try:
        learner = HolderActor.options(resources={"learner_node": 1}).remote(manifest)
        peer = HolderActor.options(resources={"generation_node": 1}).remote(manifest)
        worker = NewWorkerActor.options(resources={"generation_node": 1}).remote()
        seconds: dict[str, float] = {}
        for name, holder in (("learner", learner), ("peer", peer)):
            times = [ray.get(worker.take.remote(holder, manifest.version)) for _ in range(repeats)]
            seconds[name] = min(times)
        return {
            "bytes": manifest.nbytes,
            "learner_seconds": seconds["learner"],
            "peer_seconds": seconds["peer"],
            "speedup": seconds["learner"] / seconds["peer"],
        }
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]


def print_peer_report(result: dict[str, Any]) -> None:
    print(
        "\nA new worker's whole copy (delta publishes), "
        f"{result['bytes'] / 2**20:.0f} MB: from the learner on another node "
        f"{result['learner_seconds']:.2f} s, from a peer on its node "
        f"{result['peer_seconds']:.2f} s ({result['speedup']:.2f}x faster)"
    )
