"""The `collective` weight transport: buckets broadcast from learner rank 0 over a process group.

Learner rank 0 serves a TCPStore (`open_weight_group`, which returns at once) and every
receiving process of the generation workers joins it (`connect`, which blocks until all have).
The group is a standalone process group built on that store, not torch.distributed's default
group: learner rank 0 already has one (its FSDP group), and a generation worker may have its
own (vLLM's tensor parallelism). Gloo on CPU, NCCL with CUDA tensors; where every rank sits on
one GPU, which NCCL refuses, `connect` gives an `ipc` channel instead (`services.weights.ipc`:
CUDA IPC handles through the same store, behind the same `Channel`). Every key is under a
prefix naming the group's generation, so a group re-formed after a worker was replaced never
reads a key of an earlier one.

Per publish, rank 0 first broadcasts a header (version, buckets, bytes) that every receiver
checks against the manifest it got through Ray, then each bucket, packed into one flat byte
tensor: no message is larger than one bucket (or one tensor larger than a bucket). Joining has
its own, shorter deadline: every rank posts `joined/<rank>` and waits for all the others' before
the process group is built, so a member that dies or never comes while the group forms costs at
most the join deadline (`WeightGroupError` naming the missing ranks), not a broadcast's timeout.
After that every collective waits at most the group's timeout, so a dead or stuck peer raises
instead of hanging (`WeightGroupError`). Under NCCL, torch's default error handling would end
the process whose collective failed or timed out (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, read when
a group is built): a weight group is built with 2, which aborts its communicator and raises, so
a dead receiver costs a re-formed group, not a learner restart. The variable is set for that
construction alone, under a lock every NCCL process group construction here takes
(`process_group_construction`), so the learner's training group keeps torch's default.

Neither the store nor gloo/NCCL authenticate anyone, so every message a member acts on is
authenticated with the group's key (`services.weights.auth`; the key travels inside the
`WeightGroup`, through Ray, never through the store): `joined/<rank>` and `gpu/<rank>` are
sealed store values, the header carries a tag, and each bucket of host memory (gloo) is
followed by a tag that commits to its content digest (the sender's, computed where the bytes
are); a receiver checks both before it yields anything, and refuses
(`WeightAuthenticationError`) otherwise. NCCL's buckets, in GPU memory the host does not read,
carry no tag: the header's alone is checked. The store
listens only on the address it announces (`services.weights.stores`): loopback for a group on
one node.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import (
    BroadcastOptions,
    PrefixStore,
    ProcessGroupGloo,
    Store,
    TCPStore,
)

from services.weights import auth
from services.weights.base import (
    HEADER_BYTES,
    PATCH_ENCODINGS,
    Channel,
    PatchHeader,
    WeightAuthenticationError,
    WeightGroup,
    WeightGroupBackend,
    WeightGroupError,
    WeightsManifest,
    check_header,
    group_backend,
    header_values,
)
from services.weights.buckets import (
    bucket_nbytes,
    checked_buckets,
    pack_bucket,
    packed_buckets,
    unpack_bucket,
)
from services.weights.delta import BucketPatch, DeltaBase, DeltaMismatchError, check_patch_specs
from services.weights.stores import member_host, node_address, serve_store, serving_host

DEFAULT_TIMEOUT_S = 600.0
# Every rank joins between two engine steps (the learner's between two training steps), so a
# live member is in within seconds; 120 s is generous for a slow node (a cold TCP connection
# across the cluster, an engine finishing a long step) and bounds what a member that died while
# the group formed holds learner rank 0, which takes no step meanwhile.
DEFAULT_JOIN_TIMEOUT_S = 120.0
STORE_PREFIX = auth.STORE_PREFIX
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_ABORT_AND_RAISE = "2"
# The header as it is broadcast: its three int64 values, then their tag.
_HEADER = struct.Struct("<3q")
# A delta publish's patch header, before each bucket's payload: encoding, base version, payload
# bytes, bucket bytes, changed fraction, digest (XXH3-128); then its tag.
_PATCH = struct.Struct("<4qd16s")


@dataclass(frozen=True)
class _Served:
    store: TCPStore
    key: bytes


# The store each group's rank 0 serves, by address, with the group's key: it lives as long as
# the group (the process group holds it too, but the address must stay served until every
# receiver has joined).
_SERVED: dict[str, _Served] = {}


def open_weight_group(
    world_size: int,
    backend: WeightGroupBackend,
    generation: int,
    *,
    host: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    delta: bool = False,
) -> WeightGroup:
    """Serve the group's store on a free port of `host` (learner rank 0); return at once with
    the group, which holds its new key: hand it to every member through Ray.

    `world_size` counts learner rank 0 and every receiving process. `host` (default
    `stores.serving_host`: loopback on a one-node Ray cluster, else this node's address) is
    the only address the store listens on. `delta`: sends after the first are patches
    (`WeightGroup.delta`).
    """
    if world_size < 2:
        raise ValueError(f"a weight group needs rank 0 and a receiver: world_size {world_size}")
    backend = group_backend(backend)
    host = host or serving_host()
    timeout = timedelta(seconds=timeout_s)
    store = serve_store(host, 0, world_size, timeout, wait_for_workers=False)
    address = f"{host}:{store.port}"
    key = auth.new_key()
    _SERVED[address] = _Served(store, key)
    return WeightGroup(address, world_size, backend, generation, key, delta)


def stop_serving(group: WeightGroup) -> None:
    """Stop serving `group`'s store (its rank 0; idempotent). Joined ranks are unaffected."""
    _SERVED.pop(group.address, None)


def _client_store(group: WeightGroup, rank: int, timeout: timedelta) -> Store:
    served = _SERVED.get(group.address)
    if rank == 0:
        if served is None:
            raise ValueError(
                f"rank 0 of weight group {group.address} must be the process that opened it"
            )
        if group.key != served.key:
            raise ValueError(
                f"weight group {group.address}: this is not the group this process opened there "
                "(its key differs)"
            )
        served.store.set_timeout(timeout)
        return served.store
    if len(group.key) != auth.KEY_BYTES:
        raise ValueError(
            f"weight group {group.address} has no key: a member must be given the WeightGroup "
            "that open_weight_group returned (through Ray), key included"
        )
    host, _, port = group.address.rpartition(":")
    return TCPStore(host, int(port), is_master=False, timeout=timeout)


def _backend(
    group: WeightGroup, store: Store, rank: int, timeout: timedelta, host: str | None
) -> tuple[Any, torch.device]:
    """The process group's backend object and the device its tensors live on."""
    if group.backend == "nccl":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None or not torch.cuda.is_available():
            raise RuntimeError("weight group backend 'nccl' needs a CUDA build of torch and a GPU")
        options = nccl.Options()
        options._timeout = timeout
        options.is_high_priority_stream = False
        device = torch.device("cuda", torch.cuda.current_device())
        # A receiver that dies must fail this group's collectives, not end the learner: torch's
        # default (3) tears the process down when a collective fails or times out, 2 aborts
        # the communicator and raises. Read when a group is built, so the learner's own
        # training group (built under the same lock) keeps the default.
        with process_group_construction({NCCL_ERROR_HANDLING: NCCL_ABORT_AND_RAISE}):
            backend = nccl(store, rank, group.world_size, options)
        return backend, device
    # The options overload (not in torch's stubs) lets gloo bind to this node's address, not
    # whatever the hostname resolves to (often a loopback address other nodes cannot reach).
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=host or node_address())]
    gloo = ProcessGroupGloo(store, rank, group.world_size, options)
    return gloo, torch.device("cpu")


# Held by whoever builds an NCCL process group in this process (one owner:
# `process_group_construction`).
_CONSTRUCTION = threading.Lock()


@contextmanager
def process_group_construction(environment: Mapping[str, str] | None = None) -> Iterator[None]:
    """Build an NCCL process group inside this block (every one this codebase builds: the weight
    group's here, the learner's training group in `RankGroup.join`, which takes it for gloo
    too): it holds this process's one construction lock, with `environment`'s variables set for
    the block and restored after (also where one was set before).

    torch's ProcessGroupNCCL reads some of its settings (TORCH_NCCL_ASYNC_ERROR_HANDLING among
    them) from the environment when it is constructed, with no option for them, so the weight
    group sets the variable around its own construction. Without one lock taken by every
    construction, another thread's (the learner's training group: `RankGroup.join`) could read
    the weight group's value, or two changes could interleave and one restore put back the
    other's value for good. Threads that read the environment without the lock (a subprocess
    started meanwhile inherits it) can still see the value for the block's short span."""
    with _CONSTRUCTION, ExitStack() as settings:
        for name, value in (environment or {}).items():
            settings.enter_context(_environment(name, value))
        yield


@contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """`name` set to `value` in this process's environment for the block."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _rendezvous(group: WeightGroup, rank: int, store: Store, join_timeout_s: float) -> None:
    """Announce `rank` and wait until every rank of `group` has (`store`: the group's,
    prefixed); WeightGroupError naming the ranks still missing after `join_timeout_s`."""
    keys = [f"joined/{other}" for other in range(group.world_size)]
    auth.post(store, group, keys[rank], b"1")
    try:
        store.wait(keys, timedelta(seconds=join_timeout_s))
    except RuntimeError as error:  # torch's DistStoreError: a timeout, or the store went away
        missing = [other for other, key in enumerate(keys) if not store.check([key])]
        raise WeightGroupError(
            f"{group.member(rank)}: could not connect: ranks {missing} did not join within "
            f"{join_timeout_s:g} s"
        ) from error
    for key in keys:  # a stranger's `joined/<rank>` is refused, not counted
        auth.read(store, group, rank, key)


def connect(
    group: WeightGroup,
    rank: int,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
    host: str | None = None,
) -> Channel:
    """Join `group` as `rank` (0: the learner rank that opened it); blocks until every rank has
    joined, or raises after `join_timeout_s`, naming the ranks that did not. Every collective
    after that waits at most `timeout_s`. `host`: this process's address for gloo (default:
    loopback for a group served on loopback, else the node's).

    An `ipc` group gives an `ipc.IpcChannel`. So does an NCCL group whose ranks all sit on one
    GPU (every rank posts its GPU's UUID to the store first, so all ranks decide alike); NCCL
    refuses such a group, and the bytes need not leave the device anyway. An NCCL group where
    some ranks share rank 0's GPU and others do not is refused by name.
    """
    from services.weights import ipc

    if not 0 <= rank < group.world_size:
        raise ValueError(f"rank {rank} is outside weight group of size {group.world_size}")
    timeout = timedelta(seconds=timeout_s)
    join_timeout = timedelta(seconds=join_timeout_s)
    host = host or member_host(group.address)
    try:
        # The store's own timeout bounds connecting to it and every wait that names none (NCCL's
        # exchange of its unique id at the hello): all of them are part of joining.
        served = _client_store(group, rank, join_timeout)
        store = PrefixStore(auth.store_prefix(group), served)
        _rendezvous(group, rank, store, join_timeout_s)
        if group.backend == "ipc" or (
            group.backend == "nccl" and _one_gpu(group, rank, store, join_timeout)
        ):
            return ipc.IpcChannel(group, rank, store, timeout)
        backend, device = _backend(group, store, rank, timeout, host)
    except RuntimeError as error:  # torch's store and gloo errors (a peer that went away)
        if isinstance(error, WeightGroupError):
            raise
        raise WeightGroupError(f"{group.member(rank)}: could not connect: {error}") from error
    channel = WeightChannel(group, rank, backend, device, timeout)
    channel.delta = DeltaBase() if group.delta else None
    # Gloo connects in its constructor, NCCL at the first collective: one tiny broadcast makes
    # both return only once every rank is in.
    hello = torch.tensor([group.generation], dtype=torch.int64, device=device)
    channel._broadcast(hello)
    if int(hello.item()) != group.generation:
        raise RuntimeError(f"weight group {group.address}: generation {int(hello.item())} answered")
    return channel


def _one_gpu(group: WeightGroup, rank: int, store: Store, timeout: timedelta) -> bool:
    """Whether every rank of an NCCL group sits on one GPU (rank 0's). Each rank posts its
    GPU's UUID and reads everyone's, so all ranks decide alike."""
    from services.weights.ipc import cuda_device_uuid

    if not torch.cuda.is_available():
        raise RuntimeError("weight group backend 'nccl' needs a CUDA build of torch and a GPU")
    auth.post(store, group, f"gpu/{rank}", cuda_device_uuid(torch.cuda.current_device()).encode())
    keys = [f"gpu/{other}" for other in range(group.world_size)]
    store.wait(keys, timeout)
    gpus = [auth.read(store, group, rank, key).decode() for key in keys]
    sharing = [other for other in range(1, group.world_size) if gpus[other] == gpus[0]]
    if not sharing:
        return False
    if len(sharing) == group.world_size - 1:
        return True
    raise WeightGroupError(
        f"weight group {group.address}: ranks {sharing} share learner rank 0's GPU and the "
        "others do not; NCCL refuses two ranks on one GPU and CUDA IPC reaches only that GPU. "
        "Place every generation engine on the learner's GPU, or none"
    )


@dataclass
class WeightChannel:
    """One rank's end of a weight group: rank 0 sends, the others receive.

    Per publish (n counts this end's publishes): the header (three int64 and their tag), then
    for each bucket its bytes and, over gloo (buckets in host memory), a tag over its content
    digest, each tag made with the group's key in the context (group generation, n, version,
    bucket index) it belongs to. Over NCCL a bucket has no tag of its own (services/weights/
    auth.py: checking GPU bytes would cost a synchronising copy to the host per bucket, on each
    side); the header's tag covers the publish.
    """

    group: WeightGroup
    rank: int
    backend: Any  # a torch.distributed Backend (ProcessGroupGloo or ProcessGroupNCCL)
    device: torch.device
    timeout: timedelta
    # Bytes of every broadcast this end took part in, in order (the header's and tags included).
    messages: list[int] = field(default_factory=list)
    publishes: int = 0
    # Delta publishes (`WeightGroup.delta`): the last version this end sent or received whole.
    delta: DeltaBase | None = None
    changed_fraction: float = 1.0

    def _broadcast(self, tensor: Tensor, alongside: Callable[[], bytes] | None = None) -> bytes:
        """Broadcast `tensor` from rank 0; `alongside` (rank 0: the bucket's digest) runs
        while the bytes travel, and its result is returned (b"" without one)."""
        if self.backend is None:
            raise RuntimeError(f"weight group {self.group.address} is closed")
        options = BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = self.timeout
        nbytes = tensor.numel() * tensor.element_size()
        try:
            result = self._run_broadcast(tensor, options, alongside)
        except RuntimeError as error:
            failure = (
                f"{self.group.member(self.rank)}: broadcast {len(self.messages)} of {nbytes} "
                f"bytes failed: {error}"
            )
        else:
            self.messages.append(nbytes)
            return result
        # Raised outside the handler, with no cause: the torch error's traceback holds the
        # failed work, and through it the group's connections, which stay open (the peers
        # waiting in their part of this broadcast until their timeout) for as long as anything
        # keeps that error alive. Closing the group then closes them at once.
        raise WeightGroupError(failure)

    def _run_broadcast(
        self, tensor: Tensor, options: BroadcastOptions, alongside: Callable[[], bytes] | None
    ) -> bytes:
        work = self.backend.broadcast([tensor], options)
        try:
            # Only reads the tensor, as the broadcast does (gloo's thread, NCCL's stream).
            return alongside() if alongside is not None else b""
        finally:
            # With a timeout, wait blocks this thread (NCCL included) and raises when it passes.
            work.wait(self.timeout)

    def _on_device(self, raw: bytes) -> Tensor:
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)

    def _header_context(self, publish: int) -> list[str | int]:
        return ["header", self.group.generation, publish]

    def _bucket_context(self, publish: int, version: int, index: int) -> list[str | int]:
        return ["bucket", self.group.generation, publish, version, index]

    def _patch_context(self, publish: int, version: int, index: int) -> list[str | int]:
        return ["patch", self.group.generation, publish, version, index]

    @property
    def _tags_buckets(self) -> bool:
        """Whether each bucket is followed by its content tag: only where it lies in host memory."""
        return self.device.type == "cpu"

    def _next_publish(self) -> int:
        publish, self.publishes = self.publishes, self.publishes + 1
        return publish

    def send(self, manifest: WeightsManifest, buckets: Iterable[dict[str, Tensor]]) -> None:
        """Broadcast `manifest`'s version bucket by bucket (rank 0; buckets in manifest order).

        Each bucket is packed on this group's device, its content digest taken where it lies,
        and dropped before the next is taken.
        """
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} of a weight group receives, only rank 0 sends")
        publish, key = self._next_publish(), self.group.key
        header = _HEADER.pack(*header_values(manifest))
        tag = auth.tag(key, self._header_context(publish), header)
        self._broadcast(self._on_device(header + tag))
        self.changed_fraction = 1.0
        if self.delta is not None:
            self._send_patches(publish, manifest, buckets, self.delta)
            return
        for index, tensors, _ in checked_buckets(manifest, buckets):
            flat = pack_bucket(tensors).to(self.device)
            del tensors
            self._send_bytes(flat, publish, manifest.version, index)
            del flat  # (it may be the bucket itself) before the next is gathered

    def _send_bytes(self, flat: Tensor, publish: int, version: int, index: int) -> None:
        """Broadcast one bucket's bytes (or patch payload), with its tag where it is tagged."""
        if not self._tags_buckets:
            self._broadcast(flat)
            return
        # The digest is taken while the bucket travels; its tag follows the bucket.
        digest = self._broadcast(flat, alongside=partial(auth.content_digest, flat))
        del flat
        context = self._bucket_context(publish, version, index)
        self._broadcast(self._on_device(auth.tag(self.group.key, context, digest)))

    def _send_patches(
        self,
        publish: int,
        manifest: WeightsManifest,
        buckets: Iterable[dict[str, Tensor]],
        delta: DeltaBase,
    ) -> None:
        """Each bucket as its patch against the version this group sent before (host memory:
        a GPU bucket is read back to diff it), its header then its payload."""
        packed = packed_buckets(manifest, buckets, lambda tensors: pack_bucket(tensors).to("cpu"))
        changed = 0.0
        for patch in delta.encode(manifest.version, packed):
            header = patch.header
            changed += header.changed * header.nbytes / max(manifest.nbytes, 1)
            raw = _PATCH.pack(
                PATCH_ENCODINGS.index(header.encoding),
                header.base_version,
                header.payload_bytes,
                header.nbytes,
                header.changed,
                bytes.fromhex(header.digest),
            )
            context = self._patch_context(publish, manifest.version, header.index)
            self._broadcast(self._on_device(raw + auth.tag(self.group.key, context, raw)))
            if header.payload_bytes:  # an unchanged bucket sends its header alone
                payload = patch.payload.to(self.device)
                self._send_bytes(payload, publish, manifest.version, header.index)
                del payload
            del patch  # (a dense patch's payload is the bucket) before the next is gathered
        self.changed_fraction = changed

    def receive(
        self, manifest: WeightsManifest, device: torch.device | str | None = None
    ) -> Iterator[dict[str, Tensor]]:
        """The buckets rank 0 sends for `manifest`, one at a time, on `device` (default: the
        group's), each once its tag verified. The header is received (and checked) before
        this returns; every bucket must then be taken (a receiver that stops early leaves rank
        0 waiting until the timeout). A message that fails its authentication check closes
        this end and raises `WeightAuthenticationError`; nothing of it is yielded."""
        if self.rank == 0:
            raise RuntimeError("rank 0 of a weight group sends; receivers are ranks >= 1")
        publish = self._next_publish()
        received = torch.empty(HEADER_BYTES + auth.TAG_BYTES, dtype=torch.uint8, device=self.device)
        self._broadcast(received)
        raw = received.cpu().numpy().tobytes()
        header, tag = raw[:HEADER_BYTES], raw[HEADER_BYTES:]
        if not auth.verify(self.group.key, self._header_context(publish), header, tag):
            raise self._refuse(f"the header of publish {publish} (broadcast)")
        check_header(list(_HEADER.unpack(header)), manifest)
        target = torch.device(device) if device is not None else self.device
        return self._buckets(publish, manifest, target)

    def _refuse(self, what: str) -> WeightAuthenticationError:
        """Close this end (the group can no longer be trusted) and give the error to raise."""
        self.close()
        return auth.refused(self.group, self.rank, what)

    def _buckets(
        self, publish: int, manifest: WeightsManifest, target: torch.device
    ) -> Iterator[dict[str, Tensor]]:
        if self.delta is not None:
            yield from self._patched_buckets(publish, manifest, target, self.delta)
            return
        for index, specs in enumerate(manifest.buckets):
            flat = torch.empty(bucket_nbytes(specs), dtype=torch.uint8, device=self.device)
            self._broadcast(flat)
            if self._tags_buckets:
                self._verify_bucket(flat, publish, manifest.version, index)
            bucket = unpack_bucket(flat if target == self.device else flat.to(target), specs)
            del flat
            yield bucket
            del bucket

    def _patched_buckets(
        self, publish: int, manifest: WeightsManifest, target: torch.device, delta: DeltaBase
    ) -> Iterator[dict[str, Tensor]]:
        """Each bucket built from its patch and this end's copy of the version before. A patch
        that does not apply (or fails its digest) stops the yielding, but the rest of the
        publish is still received (rank 0 would wait for this end until its timeout), then
        `DeltaMismatchError` is raised: the group is re-formed, and a new group sends dense."""
        delta.begin()
        failure: DeltaMismatchError | None = None
        for index, specs in enumerate(manifest.buckets):
            header = self._receive_patch_header(publish, manifest.version, index)
            payload = torch.empty(header.payload_bytes, dtype=torch.uint8)
            if header.payload_bytes:
                flat = torch.empty(header.payload_bytes, dtype=torch.uint8, device=self.device)
                self._broadcast(flat)
                if self._tags_buckets:
                    self._verify_bucket(flat, publish, manifest.version, index)
                payload = flat.cpu()
            if failure is not None:
                continue
            try:
                check_patch_specs(header, specs)
                built = delta.apply([BucketPatch(header, payload)])
            except DeltaMismatchError as error:
                failure = error
                continue
            bucket = unpack_bucket(built if target.type == "cpu" else built.to(target), specs)
            yield bucket
            del bucket
        if failure is not None:
            delta.invalidate()
            raise failure
        delta.end(manifest.version, len(manifest.buckets))

    def _receive_patch_header(self, publish: int, version: int, index: int) -> PatchHeader:
        received = torch.empty(_PATCH.size + auth.TAG_BYTES, dtype=torch.uint8, device=self.device)
        self._broadcast(received)
        raw = received.cpu().numpy().tobytes()
        context = self._patch_context(publish, version, index)
        if not auth.verify(self.group.key, context, raw[: _PATCH.size], raw[_PATCH.size :]):
            raise self._refuse(f"the patch header of bucket {index} of version {version}")
        code, base, payload_bytes, nbytes, changed, digest = _PATCH.unpack(raw[: _PATCH.size])
        if not 0 <= code < len(PATCH_ENCODINGS) or payload_bytes < 0:
            raise DeltaMismatchError(f"bucket {index}: a malformed patch header")
        encoding = PATCH_ENCODINGS[code]
        return PatchHeader(
            index, encoding, version, base, nbytes, digest.hex(), changed, payload_bytes
        )

    def _verify_bucket(self, flat: Tensor, publish: int, version: int, index: int) -> None:
        """Receive the tag that follows a bucket and check it against the bytes received;
        a mismatch closes this end and raises (the bucket is never unpacked)."""
        received = torch.empty(auth.TAG_BYTES, dtype=torch.uint8, device=self.device)
        self._broadcast(received)
        context = self._bucket_context(publish, version, index)
        digest = auth.content_digest(flat)
        if not auth.verify(self.group.key, context, digest, received.numpy().tobytes()):
            raise self._refuse(
                f"bucket {index} of version {version} (publish {publish}, broadcast)"
            )

    def close(self) -> None:
        """Leave the group (rank 0 also stops serving its store); idempotent."""
        if self.backend is not None:
            try:
                self.backend.shutdown()
            finally:
                self.backend = None
        if self.rank == 0:
            stop_serving(self.group)
