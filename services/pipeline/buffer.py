"""The rollout buffer: scored groups waiting for the learner, bounded, with a staleness bound.

Staleness of a group = learner version - the group's policy version (its stalest response). A
batch is only handed out if every group in it is within `max_staleness`; older groups are
dropped and counted, never trained on. Groups leave in arrival order (oldest first), which keeps
drops to a minimum. The capacity counts groups that are buffered *or still being generated and
scored*, so generation is only asked for what the buffer can take: that is the backpressure.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from services.messages import ScoredGroup


@dataclass(frozen=True)
class Dropped:
    """What one eviction threw away."""

    groups: int
    responses: int


class RolloutBuffer:
    """FIFO of scored groups with a capacity (in groups) and a staleness bound."""

    def __init__(
        self, capacity: int, max_staleness: int, groups: Iterable[ScoredGroup] = ()
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self._groups: deque[ScoredGroup] = deque(groups)
        self.reserved = 0  # groups being generated or scored, counted against the capacity
        self.dropped_groups = 0
        self.dropped_responses = 0

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def groups(self) -> list[ScoredGroup]:
        """The buffered groups, oldest first (for checkpoints)."""
        return list(self._groups)

    def free(self) -> int:
        """Groups that may still be requested from generation."""
        return max(0, self.capacity - len(self._groups) - self.reserved)

    def reserve(self, n: int) -> None:
        """Count `n` groups about to be generated against the capacity."""
        if n > self.free():
            raise ValueError(f"cannot reserve {n} groups: only {self.free()} free")
        self.reserved += n

    def release(self, n: int) -> None:
        """Give back reservations of groups that will not arrive (failed or abandoned)."""
        self.reserved = max(0, self.reserved - n)

    def add(self, groups: Iterable[ScoredGroup], reserved: int) -> None:
        """Store scored groups that were reserved (`reserved` of them) before generation."""
        self._groups.extend(groups)
        self.release(reserved)

    def evict_stale(self, learner_version: int) -> Dropped:
        """Drop every group more than `max_staleness` versions behind `learner_version`."""
        keep = [g for g in self._groups if learner_version - g.policy_version <= self.max_staleness]
        stale = [g for g in self._groups if learner_version - g.policy_version > self.max_staleness]
        self._groups = deque(keep)
        dropped = Dropped(len(stale), sum(len(g.responses) for g in stale))
        self.dropped_groups += dropped.groups
        self.dropped_responses += dropped.responses
        return dropped

    def take_batch(self, size: int, learner_version: int) -> list[ScoredGroup] | None:
        """The `size` oldest groups within the bound, or None while fewer than `size` are."""
        self.evict_stale(learner_version)
        if len(self._groups) < size:
            return None
        return [self._groups.popleft() for _ in range(size)]
