"""How weights and their descriptions cross from the vLLM backend's process into vLLM's workers.

`LLM.collective_rpc` carries control messages only: plain ints, strings, lists and dicts. The
weights themselves never travel as one payload proportional to the model:

- A bucket the backend already holds (a state dict, an `object_store` offer) is written into a
  file in shared memory (`/dev/shm`), one bucket at a time, laid out as a packed bucket
  (`services.weights.buckets`); `collective_rpc` carries the file's path and the bucket's
  specs, and every worker maps the file and loads from views of it (no copy on that side).
  Tensors cannot be `collective_rpc` arguments themselves with the engine core in its own
  process (vLLM's default; seen on vLLM 0.32): the client encodes them out-of-band, but the
  engine core decodes a utility call's arguments without their types, so a tensor reaches it
  as a `[dtype, shape, buffer or buffer index]` list, not a tensor (its out-of-band buffer
  dropped; a small inline one then fails to pickle on its way to the workers: "cannot pickle
  memoryview objects"). A `bytes` argument would pass, and is what this replaces: msgspec
  refuses one over 4 GiB, and it is a whole extra host copy per worker.
- A `collective` publish is received by every worker itself from the learner's process group;
  only the manifest crosses `collective_rpc`.

The shared files themselves are `services.weights.shared_memory`'s; their wire form is here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from services.weights.base import TensorSpec, WeightGroup, WeightsManifest, group_backend
from services.weights.shared_memory import SharedBucket, map_shared_bucket

# --- wire forms (what collective_rpc carries) ---------------------------------------------------


def specs_to_wire(specs: Sequence[TensorSpec]) -> list[list[Any]]:
    return [[spec.name, list(spec.shape), spec.dtype] for spec in specs]


def specs_from_wire(wire: Sequence[Sequence[Any]]) -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(str(name), tuple(int(size) for size in shape), str(dtype))
        for name, shape, dtype in wire
    )


def manifest_to_wire(manifest: WeightsManifest) -> dict[str, Any]:
    return {
        "version": manifest.version,
        "buckets": [specs_to_wire(bucket) for bucket in manifest.buckets],
        "aliases": dict(manifest.aliases),
    }


def manifest_from_wire(wire: Mapping[str, Any]) -> WeightsManifest:
    return WeightsManifest(
        version=int(wire["version"]),
        buckets=tuple(specs_from_wire(bucket) for bucket in wire["buckets"]),
        aliases={str(alias): str(name) for alias, name in wire["aliases"].items()},
    )


def group_to_wire(group: WeightGroup) -> dict[str, Any]:
    return {
        "address": group.address,
        "world_size": group.world_size,
        "backend": group.backend,
        "generation": group.generation,
        "key": group.key.hex(),  # the group's secret, to vLLM's workers on this node
        "delta": group.delta,
    }


def group_from_wire(wire: Mapping[str, Any]) -> WeightGroup:
    return WeightGroup(
        address=str(wire["address"]),
        world_size=int(wire["world_size"]),
        backend=group_backend(str(wire["backend"])),
        generation=int(wire["generation"]),
        key=bytes.fromhex(str(wire["key"])),
        delta=bool(wire.get("delta", False)),
    )


# --- shared-memory buckets ----------------------------------------------------------------------


def shared_bucket_to_wire(shared: SharedBucket) -> dict[str, Any]:
    return {"path": shared.path, "nbytes": shared.nbytes, "specs": specs_to_wire(shared.specs)}


def open_shared_bucket(wire: Mapping[str, Any]) -> dict[str, Tensor]:
    """name -> a view of the shared file `wire` describes (mapped, not copied)."""
    shared = SharedBucket(str(wire["path"]), int(wire["nbytes"]), specs_from_wire(wire["specs"]))
    return map_shared_bucket(shared)
