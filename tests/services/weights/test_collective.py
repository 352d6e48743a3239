"""The collective transport over real gloo and over ipc (shared-memory handles, what a learner
colocated with its engines on one GPU uses, here with CPU buckets in shared files): an FSDP2
learner of two ranks, two receiving processes.

Learner rank 0 serves the weight group and broadcasts; rank 1 only takes part in gathering the
FSDP2 shards. Everything runs in forked processes (see tests/services/learner/ranks.py): the
receivers first, waiting on a queue for the group rank 0 opens. One run covers a healthy publish
(generation 1) and a re-formed group (generation 2) in which one receiver dies after joining.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import threading
import time
from collections.abc import Iterator
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from services.learner.distributed import RankGroup
from services.learner.publish import drain, full_tensor, iter_buckets
from services.weights.auth import TAG_BYTES
from services.weights.base import (
    TensorSpec,
    WeightGroup,
    WeightGroupBackend,
    WeightGroupError,
    WeightsManifest,
)
from services.weights.buckets import bucket_nbytes
from services.weights.collective import connect, open_weight_group, stop_serving
from services.weights.loading import with_aliases
from services.weights.shared_memory import FILE_PREFIX, shared_dir
from tests.services.learner.conftest import make_core
from tests.services.learner.ranks import run_ranks
from tests.services.weights.models import save_tied_model

LOOPBACK = "127.0.0.1"
# Every collective of the healthy group waits at most this long (a hang fails the test).
TIMEOUT_S = 120.0
# The re-formed group's: the survivor of a dead peer waits this long at most. Gloo sees the dead
# peer's socket close at once; ipc notices only when an acknowledgement does not come.
DEAD_PEER_TIMEOUT_S = {"gloo": 30.0, "ipc": 5.0}
# bfloat16 tiny model: the MLP matrices (16 KiB) are larger than a bucket, attention's fit.
BUCKET_BYTES = 12 * 1024
RECEIVERS = 2


class Holdings:
    """What learner rank 0 holds of full tensors while it publishes: every tensor `gather` made
    whole and every bucket buffer, tracked by weak references to their storage, so `peak` is
    what was really alive at each gather (plus the buffer of the bucket being filled)."""

    def __init__(self, manifest: WeightsManifest) -> None:
        self.manifest = manifest
        self.live: list[tuple[StorageWeakRef, int]] = []
        self.filling: tuple[TensorSpec, ...] = ()
        self.peak = 0
        self.largest_gathered = 0

    def _alive(self) -> int:
        expired = [bool(ref.expired()) for ref, _ in self.live]  # type: ignore[no-untyped-call]
        return sum(nbytes for (_, nbytes), gone in zip(self.live, expired, strict=True) if not gone)

    def _track(self, tensor: Tensor) -> int:
        storage = tensor.untyped_storage()
        ref = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
        self.live.append((ref, storage.nbytes()))
        return int(storage.nbytes())

    def gather(self, tensor: Tensor) -> Tensor:
        whole = full_tensor(tensor)
        self.largest_gathered = max(self.largest_gathered, self._track(whole))
        self.peak = max(self.peak, self._alive() + bucket_nbytes(self.filling))
        return whole

    def watch(self, buckets: Iterator[dict[str, Tensor]]) -> Iterator[dict[str, Tensor]]:
        for specs in self.manifest.buckets:
            self.filling = specs
            bucket = next(buckets)
            self.filling = ()
            self._track(next(iter(bucket.values())))
            self.peak = max(self.peak, self._alive())
            yield bucket
            del bucket


def wait_exited(pid: int) -> None:
    """Block until process `pid` (not ours) has exited: its sockets are closed by then."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([handle], [], [], TIMEOUT_S)
        if not ready:
            raise TimeoutError(f"process {pid} did not exit")
    finally:
        os.close(handle)


def receiver_main(rank: int, inbox: Queue[Any], out: str, die: bool, deaths: Queue[Any]) -> None:
    """Join the group rank 0 posts, receive one version and save it (or the error)."""
    torch.set_num_threads(1)
    group, manifest = inbox.get(timeout=TIMEOUT_S)
    channel = connect(group, rank, timeout_s=TIMEOUT_S, host=LOOPBACK)
    if die:
        deaths.put(os.getpid())
        deaths.close()
        deaths.join_thread()  # the pid is written before the process ends
        os._exit(0)  # dies holding its place in the group
    result: dict[str, Any] = {}
    try:
        got: dict[str, Tensor] = {}
        for bucket in channel.receive(manifest):
            got.update(with_aliases({n: t.clone() for n, t in bucket.items()}, manifest.aliases))
        result = {"weights": got, "messages": channel.messages}
    except WeightGroupError as error:
        result = {"error": str(error)}
    torch.save(result, Path(out) / f"receiver-{group.generation}-{rank}.pt")
    channel.close()


def learner_main(
    group: RankGroup,
    model_dir: str,
    inboxes: list[Queue[Any]],
    deaths: Queue[Any],
    backend: WeightGroupBackend,
) -> dict[str, Any]:
    core = make_core(Path(model_dir), group=group, compute_dtype="bfloat16")
    manifest = core.weights_manifest(BUCKET_BYTES)
    policy = core.model.policy
    result: dict[str, Any] = {"manifest": manifest}

    # Generation 1: both receivers healthy.
    channel = None
    if group.rank == 0:
        weights = open_weight_group(1 + RECEIVERS, backend, 1, host=LOOPBACK, timeout_s=TIMEOUT_S)
        for _ in range(RECEIVERS):
            inboxes[0].put((weights, manifest))
        channel = connect(weights, 0, timeout_s=TIMEOUT_S, host=LOOPBACK)
    holdings = Holdings(manifest)
    buckets = iter_buckets(policy, manifest, group, "cpu", gather=holdings.gather)
    if channel is None:
        drain(buckets)
    else:
        channel.send(manifest, holdings.watch(buckets))
        result.update(
            messages=channel.messages,
            peak=holdings.peak,
            largest_gathered=holdings.largest_gathered,
        )

    # Generation 2: re-formed, and one receiver dies once it has joined.
    failing = None
    if group.rank == 0:
        timeout_s = DEAD_PEER_TIMEOUT_S[backend]
        weights = open_weight_group(1 + RECEIVERS, backend, 2, host=LOOPBACK, timeout_s=timeout_s)
        for _ in range(RECEIVERS):
            inboxes[1].put((weights, manifest))
        failing = connect(weights, 0, timeout_s=timeout_s, host=LOOPBACK)
        wait_exited(deaths.get(timeout=TIMEOUT_S))
    buckets = iter_buckets(policy, manifest, group, "cpu")
    if failing is not None:
        try:
            failing.send(manifest, buckets)
            result["dead_peer_error"] = None
        except WeightGroupError as error:
            result["dead_peer_error"] = str(error)
        failing.close()
    drain(buckets)  # rank 0: what is left after the failure; both ranks stay in step

    result["full"] = core.state_dict_for_publish()
    if channel is not None:
        channel.close()
    return result


@pytest.fixture(scope="module", params=["gloo", "ipc"])
def run(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    backend: WeightGroupBackend = request.param
    root = tmp_path_factory.mktemp(f"collective-{backend}")
    model_dir = save_tied_model(root / "model")
    context = mp.get_context("fork")
    inboxes = [context.Queue(), context.Queue()]
    deaths = context.Queue()
    receivers = [
        context.Process(
            target=receiver_main,
            args=(rank, inboxes[generation - 1], str(root), generation == 2 and rank == 2, deaths),
        )
        for generation in (1, 2)
        for rank in range(1, 1 + RECEIVERS)
    ]
    for process in receivers:
        process.start()
    try:
        ranks = run_ranks(learner_main, 2, str(model_dir), inboxes, deaths, backend)
    finally:
        for process in receivers:
            process.join(TIMEOUT_S)
            if process.is_alive():
                process.kill()
    received = {
        (generation, rank): torch.load(root / f"receiver-{generation}-{rank}.pt")
        for generation, rank in ((1, 1), (1, 2), (2, 1))
    }
    leftover = sorted(Path(shared_dir()).glob(f"{FILE_PREFIX}*"))
    return {
        "backend": backend,
        "learner": ranks[0],
        "rank1": ranks[1],
        "received": received,
        "leftover_files": leftover,
    }


def test_every_receiver_holds_the_learners_full_weights_bitwise(run: dict[str, Any]) -> None:
    full = run["learner"]["full"]
    manifest: WeightsManifest = run["learner"]["manifest"]
    assert run["rank1"]["full"] == {}
    assert manifest.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert len(manifest.buckets) > 4
    for rank in (1, 2):
        got = run["received"][(1, rank)]["weights"]
        assert got.keys() == full.keys()
        for name, tensor in full.items():
            assert got[name].dtype == torch.bfloat16 == tensor.dtype, name
            assert torch.equal(got[name], tensor), name
        # The tied head arrived once, as the embedding under both names.
        assert got["lm_head.weight"] is got["model.embed_tokens.weight"]


def test_rank_zero_holds_at_most_one_bucket_and_the_tensor_being_gathered(
    run: dict[str, Any],
) -> None:
    learner = run["learner"]
    manifest: WeightsManifest = learner["manifest"]
    largest_bucket = max(bucket_nbytes(bucket) for bucket in manifest.buckets)
    assert learner["peak"] <= largest_bucket + learner["largest_gathered"]
    # ... which is far from the whole model (float32 gathered: twice the bfloat16 bytes).
    assert learner["peak"] < 0.25 * 2 * manifest.nbytes


def test_no_message_is_larger_than_a_bucket_or_its_one_tensor(run: dict[str, Any]) -> None:
    manifest: WeightsManifest = run["learner"]["manifest"]
    messages = run["learner"]["messages"]
    largest_tensor = max(spec.nbytes for bucket in manifest.buckets for spec in bucket)
    assert largest_tensor > BUCKET_BYTES  # a bucket of one tensor was sent
    if run["backend"] == "gloo":
        hello, header, *sent = messages
        assert hello == 8  # the broadcast that makes connect wait for every rank
        # Each bucket is followed by its authentication tag, the header carries its own.
        buckets, tags = sent[0::2], sent[1::2]
        assert header == 24 + TAG_BYTES
        assert tags == [TAG_BYTES] * len(manifest.buckets)
    else:
        header, *buckets = messages
        assert header == 24
    assert buckets == [bucket_nbytes(bucket) for bucket in manifest.buckets]
    assert max(buckets) <= max(BUCKET_BYTES, largest_tensor) < manifest.nbytes / 4
    for rank in (1, 2):
        assert run["received"][(1, rank)]["messages"] == messages


def test_a_dead_receiver_makes_send_raise_and_the_group_fail(run: dict[str, Any]) -> None:
    error = run["learner"]["dead_peer_error"]
    survivor = run["received"][(2, 1)]["error"]
    # Raised instead of hanging, naming the group; the survivor raises too (the closed group,
    # or at the latest its timeout).
    assert error is not None and "(generation 2), rank 0: " in error
    assert "(generation 2), rank 1: " in survivor
    if run["backend"] == "gloo":
        assert "broadcast" in error and "Connection closed by peer" in error  # the socket closed
        assert "broadcast" in survivor
    else:
        assert "bucket 0 of version 0 not acknowledged within 5 s" in error
        assert "no bucket 1 of publish 0 within" in survivor  # its timeout, or the store closed


def test_no_shared_file_outlives_its_publish(run: dict[str, Any]) -> None:
    assert run["leftover_files"] == []


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_a_receiver_that_never_joins_makes_connect_raise(backend: WeightGroupBackend) -> None:
    group = open_weight_group(2, backend, 9, host=LOOPBACK, timeout_s=1.0)
    expected = r"\(generation 9\), rank 0: could not connect: ranks \[1\] did not join within 1 s"
    with pytest.raises(WeightGroupError, match=expected):
        connect(group, 0, timeout_s=1.0, join_timeout_s=1.0, host=LOOPBACK)
    stop_serving(group)


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_a_member_missing_while_the_group_forms_costs_the_join_deadline(
    backend: WeightGroupBackend,
) -> None:
    """Ranks 0 and 1 of a group of three join, rank 2 never comes: both raise after the join
    deadline, naming rank 2, though every broadcast of the group could wait 600 s."""
    group = open_weight_group(3, backend, 10, host=LOOPBACK, timeout_s=600.0)
    errors: dict[int, str] = {}

    def join(rank: int) -> None:
        try:
            connect(group, rank, timeout_s=600.0, join_timeout_s=2.0, host=LOOPBACK)
        except WeightGroupError as error:
            errors[rank] = str(error)

    started = time.monotonic()
    receiver = threading.Thread(target=join, args=(1,))
    receiver.start()
    join(0)
    receiver.join(TIMEOUT_S)
    elapsed = time.monotonic() - started
    stop_serving(group)
    assert not receiver.is_alive()
    assert elapsed < 30.0  # the join deadline (2 s) and slack, far from the 600 s timeout
    assert errors.keys() == {0, 1}
    for rank, error in errors.items():
        assert f"(generation 10), rank {rank}: could not connect: ranks [2] did not join " in error
        assert "within 2 s" in error


def test_bad_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="needs rank 0 and a receiver"):
        open_weight_group(1, "gloo", 1, host=LOOPBACK)
    with pytest.raises(ValueError, match=r"must be one of \('nccl', 'gloo', 'ipc'\), got 'mpi'"):
        open_weight_group(2, "mpi", 1, host=LOOPBACK)  # type: ignore[arg-type]
    group = open_weight_group(2, "gloo", 1, host=LOOPBACK)
    with pytest.raises(ValueError, match="rank 2 is outside weight group of size 2"):
        connect(group, 2)
    stranger = WeightGroup("127.0.0.1:1", 2, "gloo", 1)
    with pytest.raises(ValueError, match=r"rank 0 of weight group 127\.0\.0\.1:1 must be"):
        connect(stranger, 0)


def join_and_die(group: WeightGroup) -> None:
    """Rank 2: join, then end without a word (as a killed worker does)."""
    connect(group, 2, timeout_s=TIMEOUT_S, host=LOOPBACK)
    os._exit(0)


def test_a_failed_send_frees_the_survivors_at_once_though_its_error_is_kept() -> None:
    """Rank 2 dies, rank 1 waits in its receive, rank 0's send fails. The error is kept alive
    (as a future holding it does) and rank 0 closes the group: rank 1's receive must fail
    then, not at its timeout (the failed work in the error's traceback held the connections
    open)."""
    group = open_weight_group(3, "gloo", 11, host=LOOPBACK, timeout_s=TIMEOUT_S)
    dying = mp.get_context("fork").Process(target=join_and_die, args=(group,))
    dying.start()
    manifest = WeightsManifest(1, ((TensorSpec("w", (4096,), "float32"),),))
    survivor: dict[str, Any] = {}

    def receive() -> None:
        channel = connect(group, 1, timeout_s=TIMEOUT_S, host=LOOPBACK)
        try:
            for _ in channel.receive(manifest):
                pass
        except WeightGroupError as error:
            survivor["error"], survivor["at"] = str(error), time.monotonic()

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    sender = connect(group, 0, timeout_s=TIMEOUT_S, host=LOOPBACK)
    assert dying.pid is not None
    wait_exited(dying.pid)
    with pytest.raises(WeightGroupError, match=r"\(generation 11\), rank 0: broadcast") as failed:
        sender.send(manifest, [{"w": torch.ones(4096)}])
    kept = failed.value  # alive, with its traceback, until the end of this test
    closed = time.monotonic()
    sender.close()
    receiver.join(TIMEOUT_S)
    assert not receiver.is_alive()
    assert "(generation 11), rank 1: broadcast" in survivor["error"]
    assert survivor["at"] - closed < 20.0, "the survivor waited for its timeout"
    assert kept.__cause__ is None
