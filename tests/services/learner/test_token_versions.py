"""Per-token policy versions reach KPO's version-aware filter through collate and the step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from services.learner.batch import collate
from services.messages import Response, ScoredGroup
from tests.services.learner.conftest import make_core

# The filter's options that make a switch visible: a diffuse prior (reset needs one) and a
# process noise large enough for the gains to differ within a dozen tokens.
KALMAN = {"name": "kalman", "p0": "diffuse", "q": 1e-3, "reference_length": None}


def two_version(response: Response, switch_at: int, shift: float) -> Response:
    """The response as if the weights changed at token `switch_at` (in-flight): the tokens
    from it on carry version 1, and their behaviour log-probs are a different policy's."""
    count = len(response.response_token_ids)
    versions = [0] * switch_at + [1] * (count - switch_at)
    logprobs = [
        lp + (shift if index >= switch_at else 0.0)
        for index, lp in enumerate(response.behaviour_logprobs)
    ]
    return dataclasses.replace(response, token_versions=versions, behaviour_logprobs=logprobs)


def with_switch(groups: list[ScoredGroup], switch_at: int) -> list[ScoredGroup]:
    first = groups[0].responses[1]
    assert len(first.response.response_token_ids) > switch_at + 2
    response = two_version(first.response, switch_at, shift=-0.3)
    responses = list(groups[0].responses)
    responses[1] = dataclasses.replace(first, response=response)
    return [ScoredGroup(groups[0].prompt, responses), *groups[1:]]


def test_collate_carries_each_tokens_version(groups: list[ScoredGroup]) -> None:
    switched = with_switch(groups, switch_at=4)
    batch = collate(switched, pad_id=0, learner_version=3)
    response = switched[0].responses[1].response
    count = len(response.response_token_ids)
    assert batch.token_versions[1, :count].tolist() == [0] * 4 + [1] * (count - 4)
    # Responses of one version carry theirs on every token; the row's version is its first.
    assert bool(
        (
            batch.token_versions[0, : len(groups[0].responses[0].response.response_token_ids)] == 0
        ).all()
    )
    assert batch.versions[1] == 0 and batch.staleness[1] == 3
    cropped = batch.cropped()
    assert cropped.token_versions.shape == cropped.response_mask.shape


def test_a_length_mismatch_of_token_versions_is_rejected(groups: list[ScoredGroup]) -> None:
    first = groups[0].responses[0]
    response = dataclasses.replace(first.response, token_versions=[0])
    bad = [ScoredGroup(groups[0].prompt, [dataclasses.replace(first, response=response)])]
    with pytest.raises(ValueError, match="token versions"):
        collate(bad, pad_id=0, learner_version=0)


def step(model_dir: Path, groups: list[ScoredGroup], mode: str) -> tuple[dict, dict]:
    core = make_core(model_dir, algorithm={"estimator": {**KALMAN, "version_switch": mode}})
    metrics = core.train_step(groups)
    weights = {name: p.detach().clone() for name, p in core.model.named_parameters()}
    return metrics, weights


def test_the_filter_sees_the_versions_of_a_two_version_response(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    switched = with_switch(groups, switch_at=4)
    off, off_weights = step(tiny_model_dir, switched, "off")
    reset, reset_weights = step(tiny_model_dir, switched, "reset")
    # The reset raises the gains after the switch (back to ~1) and the filtered ratio follows
    # the new policy's log-ratio there.
    assert reset["kalman_gain_mean"] > off["kalman_gain_mean"] + 1e-3
    assert reset["filtered_ratio_mean"] != off["filtered_ratio_mean"]
    assert any(not torch.equal(reset_weights[k], off_weights[k]) for k in off_weights)
    # Without a switch in the batch the two configurations train identically, bit for bit.
    same_off, same_off_weights = step(tiny_model_dir, groups, "off")
    same_reset, same_reset_weights = step(tiny_model_dir, groups, "reset")
    assert same_reset["kalman_gain_mean"] == same_off["kalman_gain_mean"]
    assert same_reset["policy_loss"] == same_off["policy_loss"]
    assert all(torch.equal(same_reset_weights[k], same_off_weights[k]) for k in same_off_weights)
