"""collate: padding, masks and per-row fields of a batch worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from services.learner.batch import collate
from services.messages import FinishReason, Prompt, Response, ScoredGroup, ScoredResponse

PAD = 99


def scored(
    prompt_ids: list[int],
    tokens: list[int],
    logprobs: list[float],
    reason: FinishReason,
    version: int,
    reward: float,
) -> ScoredResponse:
    response = Response("p", prompt_ids, tokens, logprobs, reason, version, "")
    return ScoredResponse(response, reward, verified=True)


def two_groups() -> list[ScoredGroup]:
    """Group 0: prompt [1, 5, 6], responses A (3 tokens, stop) and B (1 token, length).
    Group 1: prompt [1, 4], responses C (empty) and D (4 tokens, format reward only)."""
    g0 = [
        scored([1, 5, 6], [7, 8, 2], [-0.1, -0.2, -0.3], "stop", 3, 1.0),
        scored([1, 5, 6], [9], [-0.4], "length", 2, 0.0),
    ]
    g1 = [
        scored([1, 4], [], [], "length", 3, 0.0),
        scored([1, 4], [5, 6, 7, 8], [-0.5, -0.6, -0.7, -0.8], "length", 1, 0.5),
    ]
    return [ScoredGroup(Prompt("p", "", ""), g0), ScoredGroup(Prompt("q", "", ""), g1)]


def test_two_groups_are_padded_left_for_prompts_and_right_for_responses() -> None:
    batch = collate(two_groups(), PAD, learner_version=4)
    # P = 3 (longest prompt), T = 4 (longest response): rows are [prompt | response], 7 wide.
    assert torch.equal(
        batch.input_ids,
        torch.tensor(
            [
                [1, 5, 6, 7, 8, 2, PAD],  # A
                [1, 5, 6, 9, PAD, PAD, PAD],  # B
                [PAD, 1, 4, PAD, PAD, PAD, PAD],  # C: empty response
                [PAD, 1, 4, 5, 6, 7, 8],  # D
            ]
        ),
    )
    assert torch.equal(
        batch.attention_mask,
        torch.tensor(
            [
                [1, 1, 1, 1, 1, 1, 0],
                [1, 1, 1, 1, 0, 0, 0],
                [0, 1, 1, 0, 0, 0, 0],
                [0, 1, 1, 1, 1, 1, 1],
            ]
        ),
    )
    # cumsum(attention_mask) - 1, clamped at 0: each row counts from its first real token.
    assert torch.equal(
        batch.position_ids,
        torch.tensor(
            [
                [0, 1, 2, 3, 4, 5, 5],
                [0, 1, 2, 3, 3, 3, 3],
                [0, 0, 1, 1, 1, 1, 1],
                [0, 0, 1, 2, 3, 4, 5],
            ]
        ),
    )
    assert torch.equal(batch.response_ids, batch.input_ids[:, 3:])
    assert batch.response_mask.dtype == torch.bool
    assert batch.response_mask.tolist() == [
        [True, True, True, False],
        [True, False, False, False],
        [False, False, False, False],
        [True, True, True, True],
    ]
    assert batch.behaviour_logp.dtype == torch.float32
    expected_logp = [
        [-0.1, -0.2, -0.3, 0.0],
        [-0.4, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],
        [-0.5, -0.6, -0.7, -0.8],
    ]
    assert torch.equal(batch.behaviour_logp, torch.tensor(expected_logp))


def test_per_row_fields() -> None:
    batch = collate(two_groups(), PAD, learner_version=4)
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 0.5]
    assert batch.group_ids.tolist() == [0, 0, 1, 1] and batch.group_ids.dtype == torch.int64
    # Only A is correct: D's 0.5 is a format reward, below the correctness reward of 1.
    assert batch.correct.tolist() == [True, False, False, False]
    assert batch.versions.tolist() == [3, 2, 3, 1]
    assert batch.staleness.tolist() == [1, 2, 1, 3]  # 4 - version
    assert batch.truncated.tolist() == [False, True, True, True]
    assert (batch.num_rows, batch.response_width) == (4, 4)


def test_select_keeps_the_widths() -> None:
    batch = collate(two_groups(), PAD, learner_version=4)
    part = batch.select(torch.tensor([3, 1]))
    assert part.input_ids.shape == (2, 7) and part.response_width == 4
    assert part.rewards.tolist() == [0.5, 0.0] and part.staleness.tolist() == [3, 2]


def test_only_empty_responses_give_a_zero_width_response_block() -> None:
    group = ScoredGroup(Prompt("p", "", ""), [scored([1, 4], [], [], "length", 0, 0.0)] * 2)
    batch = collate([group], PAD, learner_version=0)
    assert batch.input_ids.shape == (2, 2) and batch.response_ids.shape == (2, 0)
    assert batch.response_mask.shape == (2, 0) and batch.behaviour_logp.shape == (2, 0)


def test_nan_behaviour_logprobs_are_kept_for_the_loss_to_mask() -> None:
    group = ScoredGroup(Prompt("p", "", ""), [scored([1], [5, 6], [-0.1, math.nan], "stop", 0, 1)])
    batch = collate([group], PAD, learner_version=0)
    assert math.isnan(float(batch.behaviour_logp[0, 1]))


@pytest.mark.parametrize(
    ("prompt_ids", "tokens", "logprobs", "message"),
    [
        ([1], [5, 6], [-0.1], "2 response tokens but 1 behaviour log-probs"),
        ([], [5], [-0.1], "has no prompt tokens"),
    ],
)
def test_malformed_responses_are_rejected(
    prompt_ids: list[int], tokens: list[int], logprobs: list[float], message: str
) -> None:
    group = ScoredGroup(Prompt("p", "", ""), [scored(prompt_ids, tokens, logprobs, "stop", 0, 0)])
    with pytest.raises(ValueError, match=message):
        collate([group], PAD, learner_version=0)


def test_no_responses_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one response"):
        collate([], PAD, learner_version=0)
