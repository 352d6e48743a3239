"""The weights a learner publishes to generation: full tensors in the compute dtype, in buckets.

Every rank builds the same manifest from its model alone (the names of the Hugging Face model,
each tensor's full shape, the compute dtype for floating tensors; tied aliases are sent once and
named in `aliases`), with no communication: a DTensor knows its global shape. Then every rank
walks the same plan, tensor by tensor (`iter_buckets`): a DTensor (an FSDP2 shard) is gathered
with `full_tensor()`, a collective over the learner's ranks, so all ranks must walk it together.
Rank 0 copies each gathered tensor into its slot of the current bucket (one flat buffer, cast
to the compute dtype on the way) and drops the gathered tensor; it yields the bucket when full
and lets go of it before filling the next. So rank 0 holds, beyond its own shard, one bucket
plus the tensor being gathered; the other ranks hold only that transient tensor and yield
nothing.

What is published of a model is a `WeightView`: by default its own state dict
(`ModuleWeights`); a LoRA learner publishes its base model's with the adapters merged
(`services.learner.lora.MergedWeights`).

An overlapped publish (`overlapped_buckets`, a learner of one unsharded rank) reads the live
weights on a thread of its own while the next step trains: the step's forward and backward only
read the weights, and its first optimiser update waits on the publication's `Fence` (one per
publication, held in the publisher's `WeightsRead`) until every tensor has been copied out. On a GPU
the copies run on a side stream, into pinned host memory (object store) or straight into the
bucket that is broadcast (collective), ordered after the last update by an event, and the update
waits for them on the device (no host sync in the step). A bucket is handed on only once all of
its copies are done, so no reader sees a half-written one.

A sharded learner gathers with a collective of the training group, which must run in the same
order as the step's own on every rank, so its overlapped publish gathers on the training thread
before the next step (`iter_buckets`, on a GPU into pinned host buckets by copies the host does
not wait for) and only hands the buckets to the publish thread (`handed_buckets`), which puts
or broadcasts them while the next step trains. The weights may then change at once: nothing
reads them after the gather. Rank 0 then holds up to one host copy of the published weights
beyond its shard, each bucket until it is put or sent (the object store ends up holding one
anyway).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from queue import SimpleQueue
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from services.learner.distributed import RankGroup
from services.weights.base import TensorSpec, WeightsManifest
from services.weights.buckets import bucket_nbytes, plan_buckets, unpack_bucket

MiB = 2**20
# What `full_weights` gathers with when no bucket size is given: any size works, the result is
# the whole state dict anyway.
DEFAULT_BUCKET_BYTES = 256 * MiB

Gather = Callable[[Tensor], Tensor]


def tied_names(model: nn.Module) -> dict[str, str]:
    """name -> the first name of the same parameter, for every alias of a tied parameter."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        key = id(parameter)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def module_sources(model: nn.Module) -> dict[str, Tensor]:
    """The tensors to send, by name (the state dict's live tensors, aliases left out)."""
    aliases = tied_names(model)
    state = model.state_dict(keep_vars=True)
    return {name: tensor for name, tensor in state.items() if name not in aliases}


class WeightView(Protocol):
    """What a learner publishes: tensors under the names generation loads them by."""

    def tensors(self) -> dict[str, Tensor]:
        """The live tensors by published name, each of its published (full) shape; tied
        aliases left out."""
        ...

    def aliases(self) -> dict[str, str]:
        """alias -> published name, for every other name of a tied tensor."""
        ...

    def whole(self, name: str, tensor: Tensor, gather: Gather) -> Tensor:
        """The whole value of `name` from its live `tensor` (detached), made whole with
        `gather`. Every rank calls it for every tensor, in the same order."""
        ...


class ModuleWeights:
    """A model's own state dict, as it is: the view of a fully trained model."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def tensors(self) -> dict[str, Tensor]:
        return module_sources(self.model)

    def aliases(self) -> dict[str, str]:
        return tied_names(self.model)

    def whole(self, name: str, tensor: Tensor, gather: Gather) -> Tensor:
        return gather(tensor)


def _view(model: nn.Module | WeightView) -> WeightView:
    return ModuleWeights(model) if isinstance(model, nn.Module) else model


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weights_manifest(
    model: nn.Module | WeightView, dtype: torch.dtype, version: int, bucket_bytes: int
) -> WeightsManifest:
    """The manifest of `model`'s weights as published: floating tensors in `dtype`, in state
    dict order, grouped into buckets of at most `bucket_bytes` (a larger tensor alone)."""
    view = _view(model)
    specs = [
        TensorSpec(
            name,
            tuple(tensor.shape),  # a DTensor's is the full shape
            _dtype_name(dtype if tensor.is_floating_point() else tensor.dtype),
        )
        for name, tensor in view.tensors().items()
    ]
    aliases = dict(view.aliases())
    return WeightsManifest(version, plan_buckets(specs, bucket_bytes), aliases)


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole of `tensor`: a DTensor is gathered from every rank (a collective), anything
    else is itself."""
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor


def iter_buckets(
    model: nn.Module | WeightView,
    manifest: WeightsManifest,
    group: RankGroup,
    device: torch.device | str = "cpu",
    gather: Gather = full_tensor,
    pinned: bool = False,
) -> Iterator[dict[str, Tensor]]:
    """Walk `manifest`'s plan over `model` (module doc); on rank 0 yield each bucket, on
    `device`, as name -> tensor (views of one flat buffer, which `pack_bucket` hands on without
    a copy). Every rank must exhaust it together. `gather` is how a tensor is made whole
    (tests wrap it to see what is held). `pinned` (a GPU model, `device` the host): the
    buckets are pinned and filled by copies the host does not wait for, in order on the current
    stream; a reader must wait for an event recorded after them (`publish_point`)."""
    view = _view(model)
    sources = view.tensors()
    for specs in manifest.buckets:
        bucket: dict[str, Tensor] = {}
        if group.rank == 0:
            flat = torch.empty(
                bucket_nbytes(specs), dtype=torch.uint8, device=device, pin_memory=pinned
            )
            bucket = unpack_bucket(flat, specs)
            del flat  # the views keep it alive for as long as the bucket is
        for spec in specs:
            source = _source(sources, spec)
            # Not torch.no_grad() on the whole generator: its wrapper keeps the bucket it last
            # yielded alive while this one is filled (two buckets held).
            with torch.no_grad():
                whole = view.whole(spec.name, source.detach(), gather)
                if group.rank == 0:
                    # Casts to the compute dtype and moves. A non-blocking copy may let go of
                    # `whole` at once: the allocator reuses its memory in stream order.
                    bucket[spec.name].copy_(whole, non_blocking=pinned)
            del whole
        if group.rank == 0:
            yield bucket
        del bucket


class Fence:
    """One publication's read of the live weights: released once every copy of it is issued
    (`copied`: recorded after them on a GPU), or when the publication failed or was cancelled
    (so that no update waits forever). Each publication has its own: a release that comes late
    (a send's cleanup after its broadcast) can only release its own publication, never the
    next one's. Only the first release counts: a later one must not drop the copies' event."""

    def __init__(self) -> None:
        self._issued = threading.Event()
        self._copied: torch.cuda.Event | None = None
        self._lock = threading.Lock()

    def release(self, copied: torch.cuda.Event | None = None) -> None:
        with self._lock:
            if self._issued.is_set():
                return
            self._copied = copied
            self._issued.set()

    @property
    def released(self) -> bool:
        return self._issued.is_set()

    def wait(self) -> None:
        """Block until every copy is issued; on a GPU, make the current stream wait for them
        (on the device: the host goes on)."""
        self._issued.wait()
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)


class WeightsRead:
    """The fences of the publications that read the live weights while the next step trains;
    a weight update waits for every one of them (`wait`)."""

    def __init__(self) -> None:
        self._fences: list[Fence] = []
        self._lock = threading.Lock()

    def arm(self) -> Fence:
        """A publication is about to read the weights: updates wait for its fence from now on
        (call it on the training thread, between two steps)."""
        fence = Fence()
        with self._lock:
            self._fences.append(fence)
        return fence

    def wait(self) -> None:
        """Wait for every armed fence (module doc); those released are let go of."""
        with self._lock:
            fences = list(self._fences)
        for fence in fences:
            fence.wait()
        with self._lock:
            self._fences = [fence for fence in self._fences if not fence.released]

    @property
    def armed(self) -> int:
        """Fences an update would wait for now (released or not, until an update let go)."""
        with self._lock:
            return len(self._fences)


def publish_point(device: torch.device) -> torch.cuda.Event | None:
    """What an overlapped publish's copies wait for on a GPU: an event recorded on the training
    stream after the last update (call it on the training thread); None on CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


def overlapped_buckets(
    model: nn.Module | WeightView,
    manifest: WeightsManifest,
    fence: Fence,
    after: torch.cuda.Event | None = None,
    device: torch.device | str = "cpu",
) -> Iterator[dict[str, Tensor]]:
    """`manifest`'s buckets of an unsharded `model`, on `device` (the host: pinned memory
    under a GPU learner; a GPU: the broadcast buffer itself), read on the calling thread while
    another trains (module doc). `fence` is the publication's own (`WeightsRead.arm`); it is
    released once the last copy is issued, or when the walk stops early. `after` (GPU): the
    `publish_point` the copies wait for. Each bucket is whole when yielded (the host waited for
    its copies), so any stream may read it.

    A GPU bucket is allocated on the side stream that writes it, and marked as used by the
    stream current on the calling thread when it asks for the bucket (`record_stream`): once
    the bucket is dropped, its memory is reused only after all that stream had queued by then.
    A consumer that reads a bucket on yet another stream must, before dropping the bucket,
    either make its current stream wait for that work (as waiting on a collective's work
    does) or `record_stream` that stream on one of the bucket's tensors (they share one
    block): else the next bucket's copies may overwrite the memory while that stream still
    reads it."""
    view = _view(model)
    sources = view.tensors()
    # The actor's one visible GPU: the current device of this thread.
    side = torch.cuda.Stream() if after is not None else None  # type: ignore[no-untyped-call]
    target = torch.device(device)
    last = len(manifest.buckets) - 1
    released = False
    try:
        for index, specs in enumerate(manifest.buckets):
            bucket, copied = _copied_bucket(view, sources, specs, target, side, after)
            if index == last:
                fence.release(copied)
                released = True
            if copied is not None:
                copied.synchronize()  # this thread's wait, not the step's
            yield bucket
            del bucket
    finally:
        if not released:
            fence.release()


def _copied_bucket(
    view: WeightView,
    sources: dict[str, Tensor],
    specs: Sequence[TensorSpec],
    target: torch.device,
    side: torch.cuda.Stream | None,
    after: torch.cuda.Event | None,
) -> tuple[dict[str, Tensor], torch.cuda.Event | None]:
    """A bucket of `specs` on `target`, its copies issued on `side` (after `after`) when given,
    else done on the calling stream; with the event recorded after them on `side`."""
    pinned = side is not None and target.type == "cpu"
    with torch.no_grad(), torch.cuda.stream(side) if side is not None else nullcontext():
        # Allocated on the stream that writes it: the caching allocator hands a freed GPU block
        # back out to allocations on the stream it was allocated on, which is safe in that
        # stream's order; other streams' reads are covered by `record_stream` below.
        flat = torch.empty(
            bucket_nbytes(specs), dtype=torch.uint8, device=target, pin_memory=pinned
        )
        bucket = unpack_bucket(flat, specs)
        if side is not None and after is not None:
            side.wait_event(after)
        for spec in specs:
            whole = view.whole(spec.name, _source(sources, spec).detach(), full_tensor)
            bucket[spec.name].copy_(whole, non_blocking=side is not None)
            del whole
        copied = side.record_event() if side is not None else None
    if side is not None and target.type == "cuda":
        # The caller reads the bucket on its current stream, not `side`: once dropped, its
        # block must wait for that stream's reads too before it is reused (docstring above).
        flat.record_stream(torch.cuda.current_stream(target))
    return bucket, copied


def _source(sources: dict[str, Tensor], spec: TensorSpec) -> Tensor:
    """The live tensor of `spec`, which must have the manifest's shape."""
    source = sources.get(spec.name)
    if source is None or tuple(source.shape) != spec.shape:
        found = "no such tensor" if source is None else f"shape {tuple(source.shape)}"
        raise ValueError(
            f"tensor {spec.name!r} of the manifest has shape {spec.shape}, the model: {found}"
        )
    return source


def full_weights(
    model: nn.Module | WeightView, dtype: torch.dtype, group: RankGroup, version: int = 0
) -> dict[str, Tensor]:
    """The whole published state dict on CPU (rank 0; empty elsewhere; every rank takes part),
    tied aliases as the same tensor under each name. For checks and tests: a publish streams
    buckets instead of holding this."""
    manifest = weights_manifest(model, dtype, version, DEFAULT_BUCKET_BYTES)
    out: dict[str, Tensor] = {}
    for bucket in iter_buckets(model, manifest, group):
        out.update(bucket)
    for alias, name in manifest.aliases.items():
        if name in out:
            out[alias] = out[name]
    return out


# What the training thread hands the publish thread of a sharded overlapped publish: a bucket
# and the event after its copies (None on CPU); None ends the walk.
Handed = tuple[dict[str, Tensor], "torch.cuda.Event | None"] | None


def handed_buckets(handed: SimpleQueue[Handed]) -> Iterator[dict[str, Tensor]]:
    """The buckets handed over through `handed`, each once its copies are done (a GPU's: this
    thread waits for the event, the training thread does not)."""
    while (item := handed.get()) is not None:
        bucket, copied = item
        if copied is not None:
            copied.synchronize()
        yield bucket
        del bucket, item


def drain(buckets: Iterator[dict[str, Tensor]]) -> None:
    """Walk the plan to its end without keeping anything (ranks other than 0)."""
    for _ in buckets:
        pass
