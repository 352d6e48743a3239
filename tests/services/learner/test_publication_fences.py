"""Armed collective sends with two publications in flight: every send delivers, bit for bit,
the weights of the version it is labelled with, whatever the order of arm, send, cancel, the
end of an earlier send's broadcast, the next step's update, a step whose update is skipped and a
broken weight group.

One learner rank (`LearnerImpl`, no Ray) over the tiny model, whose weights fit one bucket (the
widest window: its walk ends at the first bucket). Its weight group is an in-memory channel
whose sends walk their buckets and then hold their last broadcast. A seeded schedule decides,
for each version, whether it is sent or cancelled, whether its broadcast breaks the group, and
how its send runs, and for each step whether its update is skipped:

- `deferred`: it reads at once and holds its last broadcast until the next version has been
  published; the test then ends it and waits for the send to return, before the next step;
- `late`: it reads only once the next update has decided (it waits on an armed fence, or it
  ran) and holds until then;
- a skipped update: the step's gradients are NaN, so the core applies none of its updates (a
  non-finite gradient norm), as a step of bad numbers does: its `before_update` fence wait never
  happens, the weights stay as they were, and the version still advances. The fences armed
  before it are then waited on, and the released ones let go of, only by the next update that
  runs, in a later step: with the step after a late send skipped, that update waits on two
  publications' unreleased fences at once (the late send's and the next one's), and the late
  send reads only once it has decided. A deferred send queued on the publish thread behind such
  a late send can only end after that update: its broadcast is ended as usual, and the send is
  waited for once the update ran (or the schedule ended).

What this catches: one publication's late release freeing the next one's fence. With one flag
for every publication, send N's cleanup after its broadcast released the fence publication
N + 1 had just armed; the next step's update went ahead, and send N + 1 then read the updated
weights under version N + 1's label. Here, a deferred send N followed by a late send N + 1 is
that interleaving, deterministically (a change that releases the newest fence at the end of a
send fails this test on its first such schedule).
"""

from __future__ import annotations

import math
import random
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from pathlib import Path

import pytest
import torch
from torch import Tensor

from kpo_core.config import AlgorithmConfig
from services.learner.actor import LearnerImpl
from services.learner.publish import Fence, WeightsRead
from services.messages import ScoredGroup
from services.spec import LearnerConfig
from services.weights.base import WeightGroupError, WeightsManifest

SCHEDULES = 200
STEPS_PER_SCHEDULE = 4
SKIP_PROBABILITY = 0.3
WAIT_S = 60.0


class Signals:
    """What the updates say, by publication version: `decided[v]`, the first update after
    version v was published has decided (it waits on an armed fence, or it ran; the steps
    skipped in between say nothing); `may_read[v]`, a late send of version v may read (an
    update waits on v's own fence, or one ran after v was published). `updates`: the updates
    that ran; `since_update`: the publications since the last one. Called on the training
    thread; a send's thread only waits on the events of its version, made when it was
    published."""

    def __init__(self) -> None:
        self.decided: dict[int, threading.Event] = {}
        self.may_read: dict[int, threading.Event] = {}
        self.fence_versions: dict[int, int] = {}  # id(fence) -> its publication's version
        self.updates = 0
        self.since_update = 0
        self._undecided: list[int] = []
        self._unread: list[int] = []

    def published(self, version: int) -> None:
        self.decided[version] = threading.Event()
        self.may_read[version] = threading.Event()
        self._undecided.append(version)
        self._unread.append(version)
        self.since_update += 1

    def decide(self) -> None:
        """An update decided: the first since every publication not yet decided."""
        for version in self._undecided:
            self.decided[version].set()
        self._undecided = []

    def let_read(self, versions: Iterable[int]) -> None:
        for version in versions:
            self.may_read[version].set()

    def update_ran(self) -> None:
        """An update ran: what waits on it may go on (and reads the updated weights)."""
        self.no_more_updates()
        self.updates += 1
        self.since_update = 0

    def no_more_updates(self) -> None:
        """Nothing is held back for an update any more (one ran, or the schedule ended)."""
        self.decide()
        self.let_read(self._unread)
        self._unread = []

    def open(self, version: int) -> bool:
        """Both of version's gates are open: a late send of it no longer waits for an update."""
        return self.may_read[version].is_set() and self.decided[version].is_set()


class ObservedRead(WeightsRead):
    """The core's fences, saying which publications an update waits for (before it waits)."""

    def __init__(self, signals: Signals) -> None:
        super().__init__()
        self._signals = signals

    def newest(self) -> Fence:
        with self._lock:
            return self._fences[-1]

    def wait(self) -> None:
        with self._lock:
            unreleased = [fence for fence in self._fences if not fence.released]
        versions = self._signals.fence_versions
        self._signals.let_read(versions[id(f)] for f in unreleased if id(f) in versions)
        if unreleased:
            self._signals.decide()
        super().wait()


class HeldChannel:
    """Rank 0's end of an in-memory weight group: a send of a `late` version reads once the
    next update allows it; every send walks its buckets (a receiver's copy of each), then holds
    its last broadcast (`end[version]`, or the next update's decision for a late one); a
    version in `breaks` then fails as a dead receiver would."""

    def __init__(self, signals: Signals) -> None:
        self.delivered: dict[int, dict[str, Tensor]] = {}
        self.end: defaultdict[int, threading.Event] = defaultdict(threading.Event)
        self.breaks: set[int] = set()
        self.late: set[int] = set()
        self._signals = signals
        self.group, self.rank, self.messages = None, 0, []
        self.changed_fraction = 1.0

    def send(self, manifest: WeightsManifest, buckets: Iterable[dict[str, Tensor]]) -> None:
        version = manifest.version
        if version in self.late:
            assert self._signals.may_read[version].wait(WAIT_S)
        received: dict[str, Tensor] = {}
        for bucket in buckets:
            received.update({name: tensor.clone() for name, tensor in bucket.items()})
        held = self._signals.decided[version] if version in self.late else self.end[version]
        assert held.wait(WAIT_S)
        if version in self.breaks:
            raise WeightGroupError(f"a receiver of version {version} died")
        self.delivered[version] = received

    def receive(self, manifest: WeightsManifest, device: object = None) -> Iterator[dict]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def in_thread(call: Callable[[], object]) -> threading.Thread:
    """`call` on a thread of its own; a cancelled or broken send raises, as it should: what
    was delivered is checked instead."""

    def run() -> None:
        with suppress(Exception):
            call()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@contextmanager
def nan_gradients(impl: LearnerImpl) -> Iterator[None]:
    """Within it, a parameter's gradient is NaN (a hook makes it so): every minibatch's
    gradient norm is not finite, so the core skips each of its updates."""
    parameter = next(p for p in impl.core.model.parameters() if p.requires_grad)
    handle = parameter.register_hook(lambda grad: torch.full_like(grad, math.nan))
    try:
        yield
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def learner(tiny_model_dir: Path) -> Iterator[tuple[LearnerImpl, Signals]]:
    impl = LearnerImpl(
        str(tiny_model_dir),
        LearnerConfig(lr=1e-2),
        AlgorithmConfig.model_validate({"estimator": {"name": "token"}}),
        temperature=1.0,
        seed=0,
        weight_transport="collective",
        weight_bucket_mb=1,
        overlap_publish=True,
    )
    impl.setup("")
    signals = Signals()
    # The core's updates wait on these fences, and the publisher arms them.
    read = ObservedRead(signals)
    impl.core.before_update = read.wait
    impl.publisher.fences = read
    optimizer_step = impl.core.optimizer.step

    def step_and_say(*args: object, **kwargs: object) -> object:
        result = optimizer_step(*args, **kwargs)
        signals.update_ran()  # what waits on it may go on
        return result

    impl.core.optimizer.step = step_and_say  # type: ignore[method-assign]
    yield impl, signals


def join(thread: threading.Thread) -> None:
    thread.join(WAIT_S)
    assert not thread.is_alive()


@pytest.mark.parametrize("seed", range(SCHEDULES))
def test_every_armed_send_delivers_the_weights_of_its_version(
    learner: tuple[LearnerImpl, Signals], groups: list[ScoredGroup], seed: int
) -> None:
    impl, signals = learner
    read = impl.publisher.fences
    assert isinstance(read, ObservedRead)
    rng = random.Random(seed)
    # The skips have a stream of their own: each version's choices are drawn as before they
    # were added.
    skips = random.Random(f"skip {seed}")
    channel = HeldChannel(signals)
    expected: dict[int, dict[str, Tensor]] = {}
    deferred: list[tuple[int, threading.Thread]] = []
    late: list[threading.Thread] = []
    behind_late: list[threading.Thread] = []  # deferred sends queued behind a waiting late one
    sent: set[int] = set()
    for _ in range(STEPS_PER_SCHEDULE):
        impl.publisher.attach_channel(channel)  # (re)formed between steps, as after a break
        skipped = skips.random() < SKIP_PROBABILITY
        updates = signals.updates
        skipping: AbstractContextManager[None] = nan_gradients(impl) if skipped else nullcontext()
        with skipping:
            impl.step(groups)
        assert (signals.updates == updates) == skipped, (seed, skipped)
        version = impl.core.version
        expected[version] = impl.published_state_dict()
        if rng.random() < 0.25:
            channel.breaks.add(version)
        is_late = rng.random() < 0.5
        if is_late:
            channel.late.add(version)
        signals.published(version)
        impl.publish(version, send=True)
        signals.fence_versions[id(read.newest())] = version
        if rng.random() < 0.75:
            sent.add(version)
            thread = in_thread(lambda v=version: impl.send(v))
        else:
            thread = in_thread(lambda v=version: impl.cancel_send(v))
        # The broadcasts deferred so far end now, after this publication armed its fence and
        # before the next step: a late release would land on this one. A send queued behind a
        # late one that still waits for an update (the steps since were skipped) runs after
        # that update: it is waited for then.
        waiting = [v for v in channel.late & sent if not signals.open(v)]
        for held, held_thread in deferred:
            channel.end[held].set()
            if any(v < held for v in waiting):
                behind_late.append(held_thread)
            else:
                join(held_thread)
        deferred = []
        if is_late:
            late.append(thread)
        else:
            deferred.append((version, thread))
    signals.no_more_updates()  # no step follows the last publication
    for held, held_thread in deferred:
        channel.end[held].set()
        join(held_thread)
    for thread in behind_late + late:
        join(thread)
    assert set(channel.delivered) <= sent - channel.breaks
    for version, received in channel.delivered.items():
        want = expected[version]
        assert received and received.keys() <= want.keys()
        for name, tensor in received.items():
            assert torch.equal(tensor, want[name]), (seed, version, name)
    # Released fences are let go of at the next update that runs: only those armed since stay.
    assert read.armed <= signals.since_update
