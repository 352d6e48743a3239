"""Continuous batching for the `hf` backend: groups join and leave one running batch.

Every `step`:

1. recompute the running rows' KV cache if the weights changed and that was asked for;
2. decode: feed each running row the token it sampled last (one forward over the batch);
3. admit queued groups while there is room: prefill their prompts (G rows per group, left-
   padded among themselves) and merge that cache into the running batch's (`RunningBatch`);
4. sample one token for every row, old and new, under its group's settings;
5. rows that sampled EOS or reached their group's `max_new_tokens` leave the batch; a group
   whose G rows all ended is returned as G Responses.

Multi-turn rollouts (with `tools`, services/tools/rollout.py): after each sampled token a row's
new text is checked for a tool call (`ResponseTurns`). A row that stops at a call leaves the
batch (its KV cache with it) and is parked while the call runs on the tool threads; the other
rows keep decoding. Once the call's result is in (polled at each step, never waited on while
any row can decode), its observation tokens are appended to the row and the row is admitted
again like a new one: one prefill of its whole context (prompt, model and observation tokens)
under the weights loaded then, and decoding continues. Re-prefilling rather than extending
the old cache keeps the batch's one-token-per-step layout, at the cost of a prefill per turn.
Observation tokens get log-prob 0.0, the version of the model token before them, and True in
the response's `observation_mask`; `max_new_tokens` counts model tokens only. A seeded group
that calls tools is reproducible only up to when its calls return: its rows draw from the group's
stream at every step any of them decodes, and a call's duration decides how many steps that is.

Every sampled token records the policy version passed to that `step` and the log-prob of the
distribution it was drawn from, which the weights loaded at that step computed: a token's
behaviour log-prob is that of the weights that sampled it by construction, whatever was loaded
before or after. A group sampled with `replay_max_kept` also records each token's kept set
(`hf_sampling.kept_sets`; `Response.kept_ids`), [] for its observation tokens.

Randomness (`GroupNoise`): each group owns a torch.Generator seeded with its request's seed
(a fresh random seed when it has none) and draws G uniform numbers from it at every step it is
in the batch, one per row, whether the row still runs or not; a row samples by inverse CDF with
its number. A group's draws therefore depend only on its seed and its own tokens, not on the
groups it shares the batch with nor on when it was admitted: a seeded group gives the same
responses alone or merged (up to float rounding of the batched forward, which moves a token only
when its uniform falls within rounding distance of a CDF boundary).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from services.generation.base import GroupRequest, check_prompt_lengths, validate_requests
from services.generation.hf_batch import RunningBatch, left_pad
from services.generation.hf_sampling import sample_rows
from services.messages import Response
from services.positions import position_ids_for
from services.tools.rollout import Decision, IncrementalText, ToolRollout
from services.tools.rows import ParkedRows, TurnRow, response_of

# (input_ids, attention_mask, position_ids, cache) -> next-token logits (B, V); extends cache.
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache], torch.Tensor]


class NonFiniteLogitsError(FloatingPointError):
    """The model produced NaN or infinite logits: its weights (or dtype) are broken."""


class GroupNoise:
    """The uniform numbers a group's rows sample with: G per step, from the group's own stream."""

    def __init__(self, group_size: int, seed: int | None, device: torch.device) -> None:
        self._size = group_size
        self._generator = torch.Generator(device=device)
        if seed is None:
            self._generator.seed()  # a fresh nondeterministic seed
        else:
            self._generator.manual_seed(seed)

    def draw(self) -> torch.Tensor:
        """(G,) uniforms in [0, 1), one per row of the group."""
        return torch.rand(self._size, generator=self._generator, device=self._generator.device)


@dataclass(eq=False)
class _Group:
    request: GroupRequest
    prompt_ids: list[int]
    noise: GroupNoise
    ended: list[_Row | None]
    remaining: int


@dataclass(eq=False)
class _Row(TurnRow):
    group: _Group
    index: int  # within its group


class ContinuousBatcher:
    """Queue, running batch and sampling loop of the `hf` backend (one thread drives it)."""

    def __init__(
        self,
        *,
        forward: Forward,
        new_cache: Callable[[], DynamicCache],
        encode: Callable[[Sequence[GroupRequest]], list[list[int]]],
        decode: Callable[[list[list[int]]], list[str]],
        eos_ids: Sequence[int],
        pad_id: int,
        device: torch.device,
        max_rows: int | None = None,
        tools: ToolRollout | None = None,
        decode_text: Callable[[Sequence[int]], str] | None = None,
        context_limit: int | None = None,
    ) -> None:
        """`tools`: multi-turn rollouts, with `decode_text` (one sequence's text, special
        tokens kept: call markers may be special tokens) and `context_limit` (the model's
        context length) both needed then."""
        if tools is not None and (decode_text is None or context_limit is None):
            raise ValueError("multi-turn rollouts need decode_text and context_limit")
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1 (or None: no limit), got {max_rows}")
        self._forward, self._new_cache = forward, new_cache
        self._encode, self._decode = encode, decode
        self._eos = frozenset(eos_ids)
        self._pad_id, self._device, self._max_rows = pad_id, device, max_rows
        self._queue: deque[_Group] = deque()
        self._rows: list[_Row] = []  # running rows, in batch order
        self._batch: RunningBatch | None = None
        self._pending = torch.empty(0, dtype=torch.long, device=device)  # sampled, not yet fed
        self._running_groups = 0
        self._stale_cache = False
        self._tools, self._decode_text = tools, decode_text
        self._context_limit = context_limit or 0
        # Rows waiting on a tool call, in the order they stopped (multi-turn only).
        self._parked: ParkedRows[_Row] | None = None if tools is None else ParkedRows(tools)

    @property
    def in_flight(self) -> int:
        """Groups submitted and not yet returned."""
        return len(self._queue) + self._running_groups

    @property
    def running_rows(self) -> int:
        return len(self._rows)

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        """Validate and encode every request, then queue them (a bad one queues nothing)."""
        validate_requests(requests)
        if not requests:
            return
        prompt_ids = self._encode(requests)
        if self._context_limit:
            check_prompt_lengths(requests, prompt_ids, self._context_limit)
        for request, ids in zip(requests, prompt_ids, strict=True):
            size = request.group_size
            noise = GroupNoise(size, request.sampling.seed, self._device)
            self._queue.append(_Group(request, ids, noise, [None] * size, size))

    def invalidate_cache(self) -> None:
        """The weights changed: recompute the running rows' cache before the next decode."""
        self._stale_cache = bool(self._rows)

    @torch.inference_mode()
    def step(self, version: int) -> list[list[Response]]:
        """One decoding step (see the module docstring); tokens are tagged with `version`."""
        if self._stale_cache:
            self._recompute_cache()
        logits: list[torch.Tensor] = []
        if self._batch is not None:
            batch = self._batch
            logits.append(
                self._forward(
                    self._pending[:, None],
                    batch.mask_with_next(),
                    batch.next_positions(),
                    batch.cache,
                )
            )
            batch.fed_one()
        ended, resumed = self._resume_parked()
        admitted = self._admit(resumed)
        if admitted is not None:
            new_rows, new_batch, new_logits = admitted
            logits.append(new_logits)
            self._rows.extend(new_rows)
            if self._batch is None:
                self._batch = new_batch
            else:
                self._batch.merge(new_batch)
        if not self._rows:
            if self._parked is not None and not ended:
                self._parked.wait_for_a_call()
            return ended
        return ended + self._sample_and_retire(torch.cat(logits), version)

    def _resume_parked(self) -> tuple[list[list[Response]], list[_Row]]:
        """Take the parked rows whose call ended: the groups that ended (a row whose
        observation does not fit its context ends there) and the rows ready to decode again,
        oldest first; the others stay parked."""
        if self._parked is None:
            return [], []
        done, ready = self._parked.take_ready()
        ended = [group for row in done if (group := self._retire(row)) is not None]
        return ended, ready

    def _admit(self, resumed: list[_Row]) -> tuple[list[_Row], RunningBatch, torch.Tensor] | None:
        """Prefill the rows that fit: resumed rows first (their whole context; those that do
        not fit stay parked), then queued groups (their prompts). None when none does."""
        room = None if self._max_rows is None else self._max_rows - len(self._rows)
        rows: list[_Row] = []
        for row in resumed:
            if room is None or room > 0:
                rows.append(row)
                room = None if room is None else room - 1
            else:
                assert self._parked is not None
                self._parked.put_back(row)
        groups: list[_Group] = []
        while self._queue:
            size = self._queue[0].request.group_size
            fits = room is None or size <= room or (not self._rows and not rows and not groups)
            if not fits:
                break
            groups.append(self._queue.popleft())
            room = None if room is None else room - size
        rows += [
            self._new_row(group, index)
            for group in groups
            for index in range(group.request.group_size)
        ]
        if not rows:
            return None
        input_ids, mask = left_pad([row.context for row in rows], self._pad_id, self._device)
        cache = self._new_cache()
        logits = self._forward(input_ids, mask, position_ids_for(mask), cache)
        self._running_groups += len(groups)
        return rows, RunningBatch(cache, mask), logits

    def _new_row(self, group: _Group, index: int) -> _Row:
        prompt = group.request.prompt
        records = group.request.sampling.replay_max_kept is not None
        row = _Row(
            group,
            index,
            prompt_ids=group.prompt_ids,
            chat=bool(prompt.messages),
            kept=[] if records else None,
        )
        if self._tools is not None and prompt.takes_tools:
            assert self._decode_text is not None
            limit = group.request.sampling.max_new_tokens
            row.turns = self._tools.turns(limit, self._context_limit)
            row.text = IncrementalText(self._decode_text)
        return row

    def _recompute_cache(self) -> None:
        """Rebuild the cache of the running rows under the current weights: one prefill of
        prompt + generated tokens, all but the last (pending) one, which the next step feeds."""
        self._stale_cache = False
        sequences = [row.context[:-1] for row in self._rows]
        input_ids, mask = left_pad(sequences, self._pad_id, self._device)
        cache = self._new_cache()
        self._forward(input_ids, mask, position_ids_for(mask), cache)
        self._batch = RunningBatch(cache, mask)

    def _uniforms(self) -> torch.Tensor:
        """One uniform per running row: each group present draws G once, in batch order."""
        draws: list[torch.Tensor] = []
        offsets: dict[int, int] = {}
        index: list[int] = []
        for row in self._rows:
            key = id(row.group)
            if key not in offsets:
                offsets[key] = sum(len(d) for d in draws)
                draws.append(row.group.noise.draw())
            index.append(offsets[key] + row.index)
        return torch.cat(draws)[torch.tensor(index, device=self._device)]

    def _sample_and_retire(self, logits: torch.Tensor, version: int) -> list[list[Response]]:
        finite = torch.isfinite(logits).all(dim=-1)
        if not bool(finite.all()):
            bad = sorted(
                {
                    self._rows[i].group.request.prompt.prompt_id
                    for i in (~finite).nonzero()[:, 0].tolist()
                }
            )
            raise NonFiniteLogitsError(
                f"non-finite logits at policy version {version} for prompts {bad}: the loaded "
                "weights hold NaN or inf values (or overflow their dtype)"
            )
        settings = [row.group.request.sampling for row in self._rows]
        draws = sample_rows(logits, settings, self._uniforms())
        tokens = draws.tokens
        ended: list[list[Response]] = []
        keep: list[int] = []
        for position, (row, token, logprob) in enumerate(
            zip(self._rows, tokens.tolist(), draws.logprobs.tolist(), strict=True)
        ):
            row.append_model_token(token, logprob, version, draws.kept.get(position))
            decision = self._decide(row, token)
            if decision == "continue":
                keep.append(position)
            elif decision == "call":
                assert self._parked is not None
                self._parked.park(row)
            else:
                row.finish = decision
                group = self._retire(row)
                if group is not None:
                    ended.append(group)
        if len(keep) < len(self._rows):
            self._rows = [self._rows[i] for i in keep]
            if not keep:
                self._batch, self._pending = None, tokens[:0]
                return ended
            keep_index = torch.tensor(keep, device=self._device)
            assert self._batch is not None
            self._batch.select(keep_index)
            tokens = tokens[keep_index]
        self._pending = tokens
        return ended

    def _decide(self, row: _Row, token: int) -> Decision:
        """What the token just sampled means for its row."""
        if row.turns is None:  # single-turn
            if token in self._eos:
                return "stop"
            if len(row.tokens) >= row.group.request.sampling.max_new_tokens:
                return "length"
            if self._context_limit and row.context_length >= self._context_limit:
                return "length"  # the model's positions end here (vLLM ends it the same way)
            return "continue"
        return row.turn_decision(eos=token in self._eos)

    def _retire(self, row: _Row) -> list[Response] | None:
        """Record an ended row; return its group's responses when it was the group's last."""
        group = row.group
        group.ended[row.index] = row
        group.remaining -= 1
        if group.remaining:
            return None
        self._running_groups -= 1
        rows = [r for r in group.ended if r is not None]
        texts = self._decode([r.tokens for r in rows])
        prompt_id = group.request.prompt.prompt_id
        return [
            response_of(r, prompt_id, text, version=r.versions[0])
            for r, text in zip(rows, texts, strict=True)
        ]
