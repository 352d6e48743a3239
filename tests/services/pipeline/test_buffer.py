"""The rollout buffer: staleness bound, FIFO order, capacity and reservations."""

from __future__ import annotations

import pytest

from services.pipeline.buffer import RolloutBuffer
from tests.services.pipeline.builders import scored_group


def test_batches_leave_oldest_first() -> None:
    buffer = RolloutBuffer(capacity=8, max_staleness=2)
    buffer.add([scored_group(f"p{i}", 0) for i in range(3)], reserved=0)
    batch = buffer.take_batch(2, learner_version=0)
    assert batch is not None and [g.prompt.prompt_id for g in batch] == ["p0", "p1"]
    assert buffer.take_batch(2, learner_version=0) is None  # one left: not a batch
    assert len(buffer) == 1


def test_groups_beyond_the_bound_are_dropped_and_counted_never_handed_out() -> None:
    buffer = RolloutBuffer(capacity=8, max_staleness=2)
    # versions 0, 1, 2, 3 with the learner at 4: staleness 4, 3, 2, 1
    buffer.add([scored_group(f"v{v}", v, (1.0, 0.0, 0.0)) for v in range(4)], reserved=0)
    batch = buffer.take_batch(2, learner_version=4)
    assert batch is not None
    assert [g.policy_version for g in batch] == [2, 3]
    assert (buffer.dropped_groups, buffer.dropped_responses) == (2, 6)


def test_group_staleness_is_that_of_its_stalest_response() -> None:
    fresh, stale = scored_group("a", 5), scored_group("b", 1)
    mixed = type(fresh)(fresh.prompt, [fresh.responses[0], stale.responses[0]])
    assert mixed.policy_version == 1
    buffer = RolloutBuffer(capacity=4, max_staleness=3)
    buffer.add([mixed], reserved=0)
    assert buffer.evict_stale(learner_version=5).groups == 1


def test_bound_zero_keeps_only_the_current_version() -> None:
    buffer = RolloutBuffer(capacity=4, max_staleness=0)
    buffer.add([scored_group("old", 2), scored_group("new", 3)], reserved=0)
    batch = buffer.take_batch(1, learner_version=3)
    assert batch is not None and batch[0].prompt.prompt_id == "new"
    assert buffer.dropped_groups == 1


def test_capacity_counts_reserved_groups_so_generation_waits_when_full() -> None:
    buffer = RolloutBuffer(capacity=5, max_staleness=1)
    buffer.reserve(3)
    assert buffer.free() == 2
    with pytest.raises(ValueError, match="only 2 free"):
        buffer.reserve(3)
    buffer.add([scored_group("a", 0), scored_group("b", 0)], reserved=3)  # one group failed
    assert (len(buffer), buffer.reserved, buffer.free()) == (2, 0, 3)
    buffer.reserve(3)
    assert buffer.free() == 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        RolloutBuffer(capacity=0, max_staleness=1)
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutBuffer(capacity=1, max_staleness=-1)
