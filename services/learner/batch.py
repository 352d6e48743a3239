"""Collate scored groups into the padded tensors of one learner step.

Rows are every response of every group, in order. Each row is its prompt LEFT-padded to the
batch's prompt width P, followed by its response RIGHT-padded to the response width T:

    [pad .. pad | prompt tokens] [response tokens | pad .. pad]
     <------- P ------------->   <--------- T ------------->

so every response starts at column P, and the logits at columns P-1 .. P+T-2 predict the T
response slots. Positions count from each row's first real token (`services.positions`, as in the
`hf` generation backend), which is what makes the learner's log-probs reproduce the behaviour
log-probs of the same weights.

A multi-turn (tool) response holds observation tokens between its model turns
(`Response.observation_mask`). They stay in the row, where the model reads them as context for
the model tokens after them, but they are off `response_mask`: no loss, no gradient, no ratio,
and every estimator treats them as masked positions (SPEC.md, "Multi-turn responses").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from services.messages import Response, ScoredGroup
from services.positions import position_ids_for
from services.reward.scoring import is_correct


@dataclass(frozen=True)
class TrainingBatch:
    """The tensors of one batch of B responses. Filled by `collate`; read by the learner step.

    input_ids, attention_mask, position_ids: [B, P+T] int64 (the model's inputs).
    response_ids: [B, T] int64 (every response token, observation tokens included; pad after
    them); response_mask: [B, T] bool, True at the model tokens (sampled, so trained on): False
    at observation tokens and padding.
    behaviour_logp: [B, T] float32, the generation log-probs (0 off the mask).
    rewards: [B] float32 (as scored: may hold NaN/inf, which the step drops); group_ids: [B]
    int64, index of the row's group in the input list; correct: [B] bool (verified correct,
    with a finite reward); versions: [B] int64, policy version that sampled the row (its
    first token); token_versions: [B, T] int64, the version that sampled each response token
    (with in-flight weight updates a response may span several; read on the mask only, for
    KPO's `version_switch`); staleness: [B] int64, learner version minus `versions`;
    truncated: [B] bool
    (ended by a limit: any finish reason but "stop", the token, context, turn and call limits
    of a multi-turn response alike).

    prompt_lengths, response_lengths: [B] Python ints, the rows' real token counts, kept on
    the host: micro-batch plans, crops and packing read them there, so that the step never
    waits on the device to learn a shape. A response length counts its positions (model and
    observation tokens), not the tokens trained on: that count is `response_mask`'s.

    kept: [B, T, K] int64 or None, the responses' `kept_ids` (truncated-sampling replay): each
    response token's kept set, ascending, padded with -1 to K, the largest set of the batch (at
    least 1). A model token whose row is all -1 had a set over the limit (`replay_dropped`).
    None when no response recorded kept sets.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    response_ids: Tensor
    response_mask: Tensor
    behaviour_logp: Tensor
    rewards: Tensor
    group_ids: Tensor
    correct: Tensor
    versions: Tensor
    token_versions: Tensor
    staleness: Tensor
    truncated: Tensor
    prompt_lengths: tuple[int, ...]
    response_lengths: tuple[int, ...]
    kept: Tensor | None = None

    @property
    def num_rows(self) -> int:
        """B, the number of responses."""
        return int(self.input_ids.shape[0])

    @property
    def response_width(self) -> int:
        """T, the padded response length."""
        return int(self.response_ids.shape[1])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def prompt_width(self) -> int:
        """P, the padded prompt length."""
        return int(self.input_ids.shape[1]) - self.response_width

    @property
    def replay_dropped(self) -> Tensor | None:
        """[B, T] bool: the model tokens whose kept set was not recorded (it had more ids than
        `generation.replay_max_kept`), which the learner drops; None without kept sets."""
        if self.kept is None:
            return None
        return self.response_mask & (self.kept < 0).all(dim=-1)

    @property
    def longest_response(self) -> int:
        """The longest response among the rows, in tokens (at least 1)."""
        return max((1, *self.response_lengths))

    def cropped(self) -> TrainingBatch:
        """The batch without the pad columns all its rows share: P and T shrink to the longest
        prompt and response among its rows (at least one response column). A micro-batch of
        short rows is thus padded to its own widths, not to those of the whole batch."""
        width_p = self.prompt_width
        prompt = max((0, *self.prompt_lengths))
        response = self.longest_response
        keep = slice(width_p - prompt, width_p + response)
        return replace(
            self,
            input_ids=self.input_ids[:, keep],
            attention_mask=self.attention_mask[:, keep],
            position_ids=self.position_ids[:, keep],
            response_ids=self.response_ids[:, :response],
            response_mask=self.response_mask[:, :response],
            behaviour_logp=self.behaviour_logp[:, :response],
            token_versions=self.token_versions[:, :response],
            kept=None if self.kept is None else self.kept[:, :response],
        )

    def select(self, rows: Sequence[int]) -> TrainingBatch:
        """The batch restricted to `rows` (indices, on the host); widths P and T are kept."""
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        tensors = {name: tensor[index] for name, tensor in self._tensors().items()}
        return replace(
            self,
            **tensors,
            prompt_lengths=tuple(self.prompt_lengths[r] for r in rows),
            response_lengths=tuple(self.response_lengths[r] for r in rows),
        )

    def to(self, device: torch.device | str) -> TrainingBatch:
        """The batch with every tensor on `device` (copied without waiting where it can)."""
        # Any: `replace` checks keyword types, and these are tensors of several fields.
        moved: dict[str, Any] = {
            name: tensor.to(device, non_blocking=True) for name, tensor in self._tensors().items()
        }
        return replace(self, **moved)

    def _tensors(self) -> dict[str, Tensor]:
        """The batch's tensors by field name (an optional one that is None left out)."""
        host = ("prompt_lengths", "response_lengths")
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in host}
        return {name: value for name, value in values.items() if value is not None}


def _check_response(response: Response, row: int) -> None:
    """Reject a response the learner cannot score consistently with generation."""
    if not response.prompt_token_ids:
        # The first response token is predicted from the last prompt position.
        raise ValueError(f"row {row} (prompt {response.prompt_id!r}) has no prompt tokens")
    if len(response.behaviour_logprobs) != len(response.response_token_ids):
        raise ValueError(
            f"row {row} (prompt {response.prompt_id!r}) has "
            f"{len(response.response_token_ids)} response tokens but "
            f"{len(response.behaviour_logprobs)} behaviour log-probs"
        )
    observed = response.observation_mask
    # Empty means "no observation token"; otherwise one flag per response token, or which
    # tokens are trained on would be a guess.
    if observed and len(observed) != len(response.response_token_ids):
        raise ValueError(
            f"row {row} (prompt {response.prompt_id!r}) has "
            f"{len(response.response_token_ids)} response tokens but an observation mask of "
            f"{len(observed)}"
        )
    versions = response.token_versions
    if versions and len(versions) != len(response.response_token_ids):
        raise ValueError(
            f"row {row} (prompt {response.prompt_id!r}) has "
            f"{len(response.response_token_ids)} response tokens but {len(versions)} token versions"
        )
    kept = response.kept_ids
    if kept and len(kept) != len(response.response_token_ids):
        raise ValueError(
            f"row {row} (prompt {response.prompt_id!r}) has "
            f"{len(response.response_token_ids)} response tokens but {len(kept)} kept sets"
        )


def collate_kept(responses: Sequence[Response], width: int) -> Tensor | None:
    """The responses' kept sets as [B, width, K] int64, -1 padded (`TrainingBatch.kept`); None
    when none recorded any. Every response with tokens must have recorded them: a batch that
    replays some tokens' truncation and not others' would train them under two rules."""
    recorded = [bool(r.kept_ids) for r in responses if r.response_token_ids]
    if not any(recorded):
        return None
    if not all(recorded):
        missing = [r.prompt_id for r in responses if r.response_token_ids and not r.kept_ids]
        raise ValueError(
            f"responses of prompts {sorted(set(missing))} have no kept sets while others of the "
            "batch have: a batch is replayed whole or not at all"
        )
    largest = max((len(s) for r in responses for s in r.kept_ids), default=0)
    kept = torch.full((len(responses), width, max(largest, 1)), -1, dtype=torch.long)
    for row, response in enumerate(responses):
        sizes = [len(s) for s in response.kept_ids]
        flat = [token for s in response.kept_ids for token in s]
        if not flat:
            continue
        size = torch.tensor(sizes, dtype=torch.long)
        position = torch.repeat_interleave(torch.arange(len(sizes)), size)
        # Each id's place within its set: its index in `flat` less its set's start.
        slot = torch.arange(len(flat)) - torch.repeat_interleave(torch.cumsum(size, 0) - size, size)
        kept[row, position, slot] = torch.tensor(flat, dtype=torch.long)
    return kept


def collate(groups: Sequence[ScoredGroup], pad_id: int, learner_version: int) -> TrainingBatch:
    """Pad every response of `groups` into one `TrainingBatch` (layout in the module docstring).

    `learner_version` is the learner's current version, against which staleness is measured.
    An empty response (0 tokens) gets an all-False mask row; observation tokens are in the row
    but off the mask, their behaviour log-probs 0; kept sets, where recorded, become `kept`
    (`collate_kept`). Raises ValueError for no responses, a response without prompt tokens,
    log-probs, an observation mask or kept sets that do not match the response length, or kept
    sets recorded for some responses only.
    """
    rows = [(index, scored) for index, group in enumerate(groups) for scored in group.responses]
    if not rows:
        raise ValueError("collate needs at least one response")
    responses = [scored.response for _, scored in rows]
    for row, response in enumerate(responses):
        _check_response(response, row)
    batch = len(rows)
    width_p = max(len(r.prompt_token_ids) for r in responses)
    width_t = max(len(r.response_token_ids) for r in responses)
    input_ids = torch.full((batch, width_p + width_t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width_p + width_t), dtype=torch.long)
    behaviour_logp = torch.zeros((batch, width_t), dtype=torch.float32)
    model_tokens = torch.zeros((batch, width_t), dtype=torch.bool)
    token_versions = torch.zeros((batch, width_t), dtype=torch.long)
    for row, response in enumerate(responses):
        prompt, tokens = response.prompt_token_ids, response.response_token_ids
        start, end = width_p - len(prompt), width_p + len(tokens)
        input_ids[row, start:width_p] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, start:end] = 1
        if tokens:
            input_ids[row, width_p:end] = torch.tensor(tokens, dtype=torch.long)
            sampled = torch.tensor(response.is_model_token(), dtype=torch.bool)
            model_tokens[row, : len(tokens)] = sampled
            # An observation's log-prob is meaningless (not even necessarily finite): 0, as
            # everywhere off the mask.
            logprobs = torch.tensor(response.behaviour_logprobs, dtype=torch.float32)
            behaviour_logp[row, : len(tokens)] = torch.where(sampled, logprobs, 0.0)
            token_versions[row, : len(tokens)] = torch.tensor(response.versions())
    versions = torch.tensor([r.policy_version for r in responses], dtype=torch.long)
    return TrainingBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_for(attention_mask),
        response_ids=input_ids[:, width_p:].clone(),
        response_mask=model_tokens,
        behaviour_logp=behaviour_logp,
        rewards=torch.tensor([s.reward for _, s in rows], dtype=torch.float32),
        group_ids=torch.tensor([index for index, _ in rows], dtype=torch.long),
        correct=torch.tensor(
            [is_correct(s) and math.isfinite(s.reward) for _, s in rows], dtype=torch.bool
        ),
        versions=versions,
        token_versions=token_versions,
        staleness=learner_version - versions,
        truncated=torch.tensor([r.finish_reason != "stop" for r in responses]),
        prompt_lengths=tuple(len(r.prompt_token_ids) for r in responses),
        response_lengths=tuple(len(r.response_token_ids) for r in responses),
        kept=collate_kept(responses, width_t),
    )
