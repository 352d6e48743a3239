"""A response as both generation backends decode it, and the responses parked on tool calls.

`TurnRow` is one response in flight: its tokens with their log-probs, versions and observation
flags, its prompt, and, in a multi-turn rollout, its turn bookkeeping and the call it waits on.
`ParkedRows` holds the rows waiting on calls: the decoding thread polls it between steps, takes
the rows whose call ended (their observation appended), and waits briefly only when nothing else
can decode. `response_of` turns an ended row into the `Response` the pipeline trains on.

What a backend keeps for itself is what talks to its engine: how a row's next tokens are
sampled (one running batch for `hf`, one request per segment for `vllm`) and how a resumed row
re-enters it (a prefill of its whole context, or a new request over it).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from services.messages import FinishReason, Response
from services.tools.rollout import Decision, IncrementalText, ResponseTurns, ToolRollout
from services.tools.sandbox import ToolResult

# Longest the decoding thread waits for a tool call when every response in flight waits on one:
# short, so that the backend's owner gets control back soon (to hand over groups, load weights).
TOOL_WAIT_S = 0.05


@dataclass(eq=False, kw_only=True)
class TurnRow:
    """One response being decoded. Per token: its log-prob, the weights version that sampled it
    and whether it is an observation token; each call's `ToolResult.status`; the finish reason
    once it ended. `turns` and `text` are None for a single-turn response."""

    prompt_ids: Sequence[int]
    chat: bool = False  # the prompt is a chat (observations then go through its template)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    observed: list[bool] = field(default_factory=list)  # per token: an observation token
    call_statuses: list[str] = field(default_factory=list)  # each call's ToolResult.status
    finish: FinishReason | None = None
    turns: ResponseTurns | None = None
    text: IncrementalText | None = None
    call: Future[ToolResult] | None = None  # the call it is parked on
    # Per token, its sampler's kept set (`Response.kept_ids`); None: not recorded.
    kept: list[list[int]] | None = None

    @property
    def context(self) -> list[int]:
        """Prompt and response tokens so far: what the model conditions on next."""
        return [*self.prompt_ids, *self.tokens]

    @property
    def context_length(self) -> int:
        """len(context), without building it (read after every token)."""
        return len(self.prompt_ids) + len(self.tokens)

    def append_model_token(
        self, token: int, logprob: float, version: int, kept: list[int] | None = None
    ) -> None:
        """`kept`: the token's kept set, for a row that records them ([] over the limit)."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        self.observed.append(False)
        if self.kept is not None:
            self.kept.append([] if kept is None else kept)

    def turn_decision(self, eos: bool) -> Decision:
        """What the model token just appended means for a multi-turn response (`eos`: it is an
        end-of-sequence token): go on, stop at the call it closed, or end (a finish reason)."""
        assert self.turns is not None and self.text is not None, "a single-turn row"
        piece = self.text.push(self.tokens)
        return self.turns.after_model_token(piece, eos, self.context_length)

    def append_observation(self, tools: ToolRollout, result: ToolResult) -> None:
        """Append the observation of the call this row stopped at: log-prob 0.0, the version of
        the model token before it, flagged observed. When it would leave no room for another
        model token it is not appended and the response ends ("max_context")."""
        assert self.turns is not None and self.text is not None, "a single-turn row"
        self.call_statuses.append(result.status)
        ids = tools.encoder.encode(tools.calls.observation(result), chat=self.chat)
        if not self.turns.fits(self.context_length, len(ids)):
            self.finish = "max_context"
            return
        version = self.versions[-1]
        self.tokens.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([version] * len(ids))
        self.observed.extend([True] * len(ids))
        if self.kept is not None:
            self.kept.extend([] for _ in ids)
        self.turns.observed()
        self.text.restart(len(self.tokens))


RowT = TypeVar("RowT", bound=TurnRow)


class ParkedRows(Generic[RowT]):
    """The rows of one backend that wait on a tool call (or, resumed, for room to decode), in
    the order they stopped. Used by the decoding thread only."""

    def __init__(self, tools: ToolRollout) -> None:
        self._tools = tools
        self._rows: list[RowT] = []

    def __len__(self) -> int:
        return len(self._rows)

    def park(self, row: RowT) -> None:
        """`row` stopped at a call (`row.turns.call`): start it and wait for its result."""
        assert row.turns is not None and row.turns.call is not None
        row.call = self._tools.calls.submit(row.turns.call)
        self._rows.append(row)

    def put_back(self, row: RowT) -> None:
        """A row whose observation is in but which found no room to decode: it goes first next
        time (it is older than every row parked after it)."""
        self._rows.append(row)

    def take_ready(self) -> tuple[list[RowT], list[RowT]]:
        """Append the observation of every row whose call ended and take those rows out:
        (rows that ended there, the observation leaving no room; rows ready to decode, oldest
        first). Rows whose call still runs stay parked."""
        ended: list[RowT] = []
        ready: list[RowT] = []
        waiting: list[RowT] = []
        for row in self._rows:
            if row.call is not None and not row.call.done():
                waiting.append(row)
                continue
            if row.call is not None:
                row.append_observation(self._tools, row.call.result())
                row.call = None
            (ended if row.finish is not None else ready).append(row)
        self._rows = waiting
        return ended, ready

    def wait_for_a_call(self) -> None:
        """Every row in flight waits on a call: block until one ends, at most TOOL_WAIT_S."""
        calls = [row.call for row in self._rows if row.call is not None]
        if calls:
            wait(calls, TOOL_WAIT_S, FIRST_COMPLETED)


def response_of(row: TurnRow, prompt_id: str, text: str, version: int) -> Response:
    """The Response of an ended row; `version`: its policy version when it has no token (the
    version loaded when it was submitted)."""
    assert row.finish is not None
    spans = any(v != row.versions[0] for v in row.versions)
    return Response(
        prompt_id=prompt_id,
        prompt_token_ids=list(row.prompt_ids),
        response_token_ids=list(row.tokens),
        behaviour_logprobs=list(row.logprobs),
        finish_reason=row.finish,
        policy_version=row.versions[0] if row.versions else version,
        text=text,
        token_versions=list(row.versions) if spans else [],
        observation_mask=list(row.observed) if any(row.observed) else [],
        tool_calls=list(row.call_statuses),
        kept_ids=[] if row.kept is None else list(row.kept),
    )
