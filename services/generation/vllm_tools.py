"""Multi-turn (tool) rollouts of the `vllm` backend: the bookkeeping of each response.

With tools enabled every response of a group is a vLLM request of its own (`n = 1`): a response
that stops at a call must leave while its siblings keep decoding, and a vLLM request with
`n = G` comes back only once all G sequences ended. The G requests share the prompt's KV blocks
through the prefix cache. A seeded group's response j is seeded `seed + j`, as vLLM seeds the
samples of one request, and each of its later segments k `derive_seed(seed + j, k)` (a fresh
stream, not the first one replayed): a seeded response is reproducible whatever its calls'
durations and whatever else shares the engine (up to the rounding of batched kernels).

A response is decoded in segments, each one vLLM request whose prompt is the whole context so
far (prompt, model and observation tokens, as `TokensPrompt`; the prefix cache makes the
re-prefill cheap where the weights did not change). A segment ends where vLLM stops it:
end-of-sequence, its token budget, or a stop string, the closing marker of the call format
(`</tool_call>`; for fenced calls "```", which also stops at an opening fence). The stop string
stays in the output (`include_stop_str_in_output`). vLLM's stop strings are only where a segment
may end; what the tokens mean is decided here, exactly as the `hf` backend decides it: every
model token of the segment is replayed through the response's `ResponseTurns` (the same
`CallDetector`, limits and finish reasons, on the text decoded by the Hugging Face tokenizer).
The first token whose decision is not "continue" ends the turn there (tokens vLLM sampled after
it are dropped: they were sampled after it, so the kept ones are distributed as if decoding had
stopped there). Then:

- "call": the call runs on the `ToolRollout`'s threads; the response is parked (`ParkedRows`,
  as in `hf`; other requests keep decoding); once the result is in (polled at every step) its
  observation tokens, encoded by the same `ObservationEncoder` as in `hf`, are appended with
  log-prob 0.0 and the previous model token's version, and the next segment is submitted;
- "continue" after a stop string that did not close a call (an opening fence, a stray marker):
  the next segment is submitted at once and decoding goes on;
- otherwise the response ends with that finish reason.

Each segment's `max_tokens` is what is left of the response's budget: `max_new_tokens` minus its
model tokens so far, and at most the room left in the context limit (`tools.max_context_tokens`,
never above the engine's `max_model_len`). Every model token keeps the log-prob and the version
vLLM reported for it; a segment submitted after a load is salted with the new version, so its
re-prefill is computed by the weights that then sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.generation.base import GroupRequest, derive_seed
from services.messages import Response
from services.tools.calls import FENCE_CLOSE, HERMES_CLOSE
from services.tools.rollout import Decision, IncrementalText, ToolRollout
from services.tools.rows import ParkedRows, TurnRow, response_of


@dataclass(eq=False)
class ToolGroup:
    """A submitted group in multi-turn mode."""

    request: GroupRequest
    prompt_ids: list[int]
    greedy: bool  # decoded once, repeated G times
    version: int  # the version loaded when it was submitted
    rows: list[ToolRow] = field(default_factory=list)
    remaining: int = 0  # rows not ended


@dataclass(eq=False)
class ToolRow(TurnRow):
    """One response of a multi-turn group, decoded segment by segment."""

    group: ToolGroup
    index: int  # within its group
    segments: int = 0  # vLLM requests submitted for it
    submitted_version: int = 0  # the version loaded when its current segment was submitted


@dataclass(frozen=True)
class Segment:
    """What vLLM reported for one ended segment of a response."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]
    versions: Sequence[int]
    eos: bool  # its last token ended it as end-of-sequence (not a stop string, not a budget)
    stop_string: bool  # it ended at a stop string
    kept: Sequence[list[int]] | None = None  # per token, its kept set (None: not recorded)


class MultiTurn:
    """Turn logic of the vLLM backend's multi-turn responses (no vLLM here: the backend talks to
    the engine, this decides what each segment's tokens mean)."""

    def __init__(
        self,
        tools: ToolRollout,
        decode_text: Callable[[Sequence[int]], str],
        context_limit: int,
    ) -> None:
        """`decode_text`: one sequence's text, special tokens kept (call markers may be special
        tokens); `context_limit`: the engine's `max_model_len`."""
        self.tools = tools
        self.parked: ParkedRows[ToolRow] = ParkedRows(tools)
        self._decode_text = decode_text
        self._context_limit = context_limit

    @property
    def stop_strings(self) -> list[str]:
        """Where vLLM must stop a segment: the closing marker of a call."""
        return [FENCE_CLOSE if self.tools.call_format == "fenced" else HERMES_CLOSE]

    def new_group(
        self, request: GroupRequest, prompt_ids: list[int], greedy: bool, version: int
    ) -> ToolGroup:
        group = ToolGroup(request, prompt_ids, greedy, version)
        count = 1 if greedy else request.group_size
        limit = request.sampling.max_new_tokens
        group.rows = [
            ToolRow(
                group,
                index,
                prompt_ids=prompt_ids,
                chat=bool(request.prompt.messages),
                turns=self.tools.turns(limit, self._context_limit),
                text=IncrementalText(self._decode_text),
                kept=[] if request.sampling.replay_max_kept is not None else None,
            )
            for index in range(count)
        ]
        group.remaining = count
        return group

    def next_segment(self, row: ToolRow) -> tuple[list[int], int, int | None]:
        """The next segment's prompt, `max_tokens` and seed (None: unseeded)."""
        sampling = row.group.request.sampling
        assert row.turns is not None
        model_tokens = row.turns.model_tokens
        budget = sampling.max_new_tokens - model_tokens
        room = self._limit(row) - row.context_length
        max_tokens = max(1, min(budget, room))
        seed = sampling.seed
        if seed is not None:
            seed = seed + row.index
            if row.segments:  # a stream of its own per segment, not the first one replayed
                seed = derive_seed(seed, row.segments)
        row.segments += 1
        return row.context, max_tokens, seed

    def _limit(self, row: ToolRow) -> int:
        limit = self.tools.settings.max_context_tokens
        return self._context_limit if limit is None else min(limit, self._context_limit)

    def segment_ended(self, row: ToolRow, segment: Segment) -> Decision | None:
        """Append the segment's model tokens up to the first that decides something; return
        that decision ("call": its call is `row.turns.call`; a finish reason: the response
        ended), or "continue" when the segment stopped at a stop string that closed no call (the
        next segment goes on), or None when vLLM ended it for a reason the turns do not know
        (an aborted request)."""
        count = len(segment.token_ids)
        for position, token in enumerate(segment.token_ids):
            row.append_model_token(
                int(token),
                float(segment.logprobs[position]),
                int(segment.versions[position]),
                None if segment.kept is None else segment.kept[position],
            )
            decision = row.turn_decision(eos=segment.eos and position == count - 1)
            if decision != "continue":
                return decision
        return "continue" if segment.stop_string else None

    def retire(self, row: ToolRow, decode: Callable[[list[int]], str]) -> list[Response] | None:
        """Record an ended row; its group's G responses when it was the group's last."""
        group = row.group
        group.remaining -= 1
        if group.remaining:
            return None
        texts = [decode(r.tokens) for r in group.rows]
        rows = len(group.rows)  # 1 for a greedy group, repeated G times
        prompt_id = group.request.prompt.prompt_id
        return [
            response_of(group.rows[i % rows], prompt_id, texts[i % rows], group.version)
            for i in range(group.request.group_size)
        ]
