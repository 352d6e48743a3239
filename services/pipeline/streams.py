"""What the driver knows of each generation worker's stream: the groups it holds, whether it may
take more, and how fast it returns them (for the stall deadline).

A worker holds at most `generation.prompts_per_batch` groups at once (submitted, not returned).
Its groups come back one poll at a time, each as soon as its G responses end, so the driver never
waits for the longest response of a batch.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from services.messages import Prompt, Response

# A worker with groups in flight that returns none for STALL_FACTOR times the time its longest
# possible response takes at its measured speed (plus STALL_MARGIN_S) is taken for hung.
STALL_FACTOR = 4.0
STALL_MARGIN_S = 30.0


@dataclass
class WorkerStream:
    """One generation worker as the driver sees it."""

    actor: Any
    # prompt_id -> (prompt, when it was submitted): the groups the worker holds.
    outstanding: dict[str, tuple[Prompt, float]] = field(default_factory=dict)
    # Deliveries of each version of the weights not yet acknowledged: a count per version, as
    # two versions may be outstanding at once and one may be sent again (a re-formed group).
    unacknowledged: Counter[int] = field(default_factory=Counter)
    newest_delivered: int = -1
    # False for a replacement until it is brought to the run's current version.
    joined: bool = True
    # A warm standby: receives every version, takes no prompts until it is promoted.
    standby: bool = False
    # Its actor answered a call, so its model is loaded: False for one just started (a
    # standby still being built is no standby to promote).
    up: bool = True
    # Of a worker that took a lost one's place: when that one was found lost, and how its place
    # was taken ("standby" or "replacement"); cleared at its first group (the driver reports
    # the time between the two).
    took_over: tuple[float, str] | None = None
    # Leaving an elastic pool: it takes no prompt, and is stopped once its groups came back.
    draining: bool = False
    last_progress: float = field(default_factory=time.perf_counter)
    tokens: int = 0  # response tokens returned
    groups_submitted: int = 0  # prompts handed to it (a standby's stays 0 until promoted)
    row_seconds: float = 0.0  # seconds each returned response was in flight, summed

    @property
    def ready(self) -> bool:
        """Whether it may take prompts: joined, and the newest version delivered to it was
        acknowledged (an older version's acknowledgement does not reopen admission)."""
        return self.joined and self.unacknowledged[self.newest_delivered] == 0

    def delivering(self, version: int) -> None:
        """A delivery of `version` is on its way: no prompt until it is acknowledged."""
        if not self.outstanding and not self.unacknowledged:
            self.last_progress = time.perf_counter()  # an idle worker is not late
        self.joined = True
        self.newest_delivered = max(self.newest_delivered, version)
        self.unacknowledged[version] += 1

    def acknowledged(self, version: int) -> None:
        self.up = True
        self.last_progress = time.perf_counter()
        self.unacknowledged[version] -= 1
        if self.unacknowledged[version] <= 0:
            del self.unacknowledged[version]

    def room(self, limit: int, streaming: bool = True) -> int:
        """Groups it may be handed now: up to `limit` held at once; without streaming, only
        when it holds none (a batch at a time)."""
        if not self.ready or self.draining or (self.outstanding and not streaming):
            return 0
        return max(0, limit - len(self.outstanding))

    def submitted(self, prompts: list[Prompt]) -> None:
        now = time.perf_counter()
        if not self.outstanding:
            self.last_progress = now  # an idle worker is not late
        for prompt in prompts:
            self.outstanding[prompt.prompt_id] = (prompt, now)
        self.groups_submitted += len(prompts)

    def returned(self, groups: list[list[Response]]) -> list[Prompt]:
        """Record groups that came back; their prompts, in the order of `groups`."""
        now = time.perf_counter()
        prompts = []
        for group in groups:
            prompt, submitted = self.outstanding.pop(group[0].prompt_id)
            prompts.append(prompt)
            self.tokens += sum(len(r.response_token_ids) for r in group)
            self.row_seconds += (now - submitted) * len(group)
        if groups:
            self.last_progress = now
        return prompts

    def dropped(self, prompt_id: str) -> Prompt | None:
        """Forget a prompt the worker refused (None if it no longer holds it)."""
        held = self.outstanding.pop(prompt_id, None)
        if held is None:
            return None
        self.last_progress = time.perf_counter()  # an answer, if not a group
        return held[0]

    def take_all(self) -> list[Prompt]:
        """Every prompt the worker held (it died or was taken for hung), oldest first."""
        prompts = [prompt for prompt, _ in self.outstanding.values()]
        self.outstanding.clear()
        return prompts

    def stall_deadline(self, max_new_tokens: int, first_group_timeout_s: float) -> float:
        """Seconds without a returned group after which the worker is taken for hung."""
        if self.tokens == 0:  # nothing measured yet: its engine may still be starting
            return first_group_timeout_s
        tokens_per_row_second = self.tokens / max(self.row_seconds, 1e-9)
        return STALL_FACTOR * max_new_tokens / tokens_per_row_second + STALL_MARGIN_S

    def stalled(self, now: float, max_new_tokens: int, first_group_timeout_s: float) -> bool:
        """Holding prompts or a delivery of weights (a collective receive happens between two
        decoding steps), it answered neither within its deadline."""
        if not self.outstanding and not self.unacknowledged:
            return False
        deadline = self.stall_deadline(max_new_tokens, first_group_timeout_s)
        return now - self.last_progress > deadline
