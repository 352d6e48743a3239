"""Contract checks every `GenerationBackend` must pass, reusable for any backend.

Each check takes a `ContractSubject` (a backend plus what a test must know about its model) and
raises AssertionError on a violation. The first checks are of the blocking `generate`, the
streaming ones (`STREAMING_CHECKS`, part of `CHECKS`) of `submit` / `step` / `in_flight` and of
weights loaded between two steps. A backend's test file runs all of them:

    @pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
    def test_contract(check, subject):
        check(subject)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import pytest
import torch

from services.generation.base import (
    GenerationBackend,
    GroupRequest,
    SamplingSettings,
    group_requests,
)
from services.messages import Prompt, Response


@dataclass(frozen=True)
class ContractSubject:
    """A backend under test with the facts about its model that the checks need."""

    backend: GenerationBackend
    eos_token_ids: frozenset[int]
    decode: Callable[[Sequence[int]], str]  # token ids -> text, special tokens skipped
    prompts: list[Prompt]  # at least two, of different token lengths
    # Settings under which a batch of 16 groups of 4 shows both EOS stops and length cut-offs.
    mixed_finish_sampling: SamplingSettings
    # The weights the backend holds (as `load_weights` takes them), for the in-flight check;
    # None skips it.
    weights: Callable[[], Mapping[str, torch.Tensor]] | None = None


def _flat(groups: list[list[Response]]) -> list[Response]:
    return [response for group in groups for response in group]


def check_groups_in_prompt_order(subject: ContractSubject) -> None:
    """`group_size` responses per prompt, in prompt order, each tagged with its prompt id."""
    prompts = subject.prompts
    groups = subject.backend.generate(prompts, 3, SamplingSettings(max_new_tokens=6, seed=0))
    assert len(groups) == len(prompts)
    for prompt, group in zip(prompts, groups, strict=True):
        assert len(group) == 3
        assert all(response.prompt_id == prompt.prompt_id for response in group)


def check_response_fields(subject: ContractSubject) -> None:
    """Log-probs align with tokens, are finite and <= 0; version and text are filled in."""
    sampling = SamplingSettings(temperature=0.8, top_p=0.9, max_new_tokens=10, seed=1)
    for response in _flat(subject.backend.generate(subject.prompts, 4, sampling)):
        assert 1 <= len(response.response_token_ids) <= sampling.max_new_tokens
        assert len(response.behaviour_logprobs) == len(response.response_token_ids)
        assert all(math.isfinite(lp) and lp <= 1e-6 for lp in response.behaviour_logprobs)
        assert all(isinstance(token, int) for token in response.response_token_ids)
        assert response.policy_version == subject.backend.policy_version
        assert response.text == subject.decode(response.response_token_ids)


def check_finish_reasons(subject: ContractSubject) -> None:
    """ "stop" iff the response ends at its first EOS; "length" iff it used every new token."""
    sampling = subject.mixed_finish_sampling
    responses = _flat(subject.backend.generate((subject.prompts * 16)[:16], 4, sampling))
    for response in responses:
        ids = response.response_token_ids
        eos_positions = [i for i, token in enumerate(ids) if token in subject.eos_token_ids]
        if response.finish_reason == "stop":
            assert eos_positions == [len(ids) - 1], "a stopped response ends at its only EOS"
        else:
            assert response.finish_reason == "length"
            assert eos_positions == [], "a length-limited response holds no EOS"
            assert len(ids) == sampling.max_new_tokens
    reasons = {response.finish_reason for response in responses}
    assert reasons == {"stop", "length"}, f"expected both finish reasons, got {reasons}"


def check_max_new_tokens(subject: ContractSubject) -> None:
    """No response is longer than `max_new_tokens`; with 1, every response is one token."""
    for limit in (1, 3):
        sampling = SamplingSettings(max_new_tokens=limit, seed=2)
        lengths = [
            len(r.response_token_ids)
            for r in _flat(subject.backend.generate(subject.prompts, 4, sampling))
        ]
        assert max(lengths) <= limit
        if limit == 1:
            assert set(lengths) == {1}


def check_seed_determinism(subject: ContractSubject) -> None:
    """The same seed gives the same responses; another seed gives different ones."""

    def run(seed: int) -> list[Response]:
        sampling = SamplingSettings(temperature=1.0, max_new_tokens=12, seed=seed)
        return _flat(subject.backend.generate(subject.prompts, 4, sampling))

    first, again, other = run(7), run(7), run(8)
    assert [r.response_token_ids for r in first] == [r.response_token_ids for r in again]
    for a, b in zip(first, again, strict=True):
        assert a.behaviour_logprobs == pytest.approx(b.behaviour_logprobs, abs=1e-5)
    assert [r.response_token_ids for r in first] != [r.response_token_ids for r in other]


def check_prompt_token_ids(subject: ContractSubject) -> None:
    """Prompt ids are unpadded, the same across a group, and decode back to the prompt."""
    groups = subject.backend.generate(subject.prompts, 2, SamplingSettings(max_new_tokens=2))
    lengths = set()
    for prompt, group in zip(subject.prompts, groups, strict=True):
        ids = group[0].prompt_token_ids
        assert all(response.prompt_token_ids == ids for response in group)
        assert subject.decode(ids) == prompt.text
        lengths.add(len(ids))
    assert len(lengths) > 1, "prompts of different lengths must keep different id lengths"


def check_greedy(subject: ContractSubject) -> None:
    """Temperature 0 is greedy: a group's responses agree and every log-prob is 0.0."""
    sampling = SamplingSettings(temperature=0.0, max_new_tokens=8)
    for group in subject.backend.generate(subject.prompts, 3, sampling):
        assert all(r.response_token_ids == group[0].response_token_ids for r in group)
        assert all(lp == 0.0 for r in group for lp in r.behaviour_logprobs)


def check_rejects_bad_settings(subject: ContractSubject) -> None:
    """Settings that describe no distribution raise ValueError; no prompts give no groups."""
    bad = [
        SamplingSettings(temperature=-0.1),
        SamplingSettings(top_p=0.0),
        SamplingSettings(top_p=1.5),
        SamplingSettings(top_k=-1),
        SamplingSettings(min_p=-0.1),
        SamplingSettings(min_p=1.5),
        SamplingSettings(replay_max_kept=0),
        SamplingSettings(max_new_tokens=0),
    ]
    for sampling in bad:
        with pytest.raises(ValueError):
            subject.backend.generate(subject.prompts, 1, sampling)
    with pytest.raises(ValueError):
        subject.backend.generate(subject.prompts, 0, SamplingSettings())
    assert subject.backend.generate([], 2, SamplingSettings()) == []


def _drain(backend: GenerationBackend) -> list[list[Response]]:
    """Step until nothing is in flight; every group that ended, in the order they ended."""
    groups: list[list[Response]] = []
    for _ in range(10_000):
        if not backend.in_flight:
            return groups
        groups.extend(backend.step())
    raise AssertionError(f"{backend.in_flight} groups still in flight after 10000 steps")


def check_idle_backend_steps_to_nothing(subject: ContractSubject) -> None:
    """With nothing submitted, `step` returns no groups and nothing is in flight."""
    assert subject.backend.in_flight == 0
    assert subject.backend.step() == []
    subject.backend.submit([])
    assert subject.backend.in_flight == 0


def check_short_group_streams_back_first(subject: ContractSubject) -> None:
    """A group of one-token responses comes back, alone, while a longer group of the same
    submit still decodes. (The long group ends at its first token only if all 4 of its rows
    sample EOS first: a chance below 1e-4 on these models.)"""
    backend = subject.backend
    long, short = subject.prompts[0], subject.prompts[1]
    backend.submit(
        [
            GroupRequest(long, 4, SamplingSettings(max_new_tokens=12, seed=31)),
            GroupRequest(short, 2, SamplingSettings(max_new_tokens=1, seed=32)),
        ]
    )
    assert backend.in_flight == 2
    first: list[list[Response]] = []
    while not first:
        first = backend.step()
    assert [group[0].prompt_id for group in first] == [short.prompt_id]
    assert [len(r.response_token_ids) for r in first[0]] == [1, 1]
    assert backend.in_flight == 1
    rest = _drain(backend)
    assert [group[0].prompt_id for group in rest] == [long.prompt_id]
    assert len(rest[0]) == 4 and max(len(r.response_token_ids) for r in rest[0]) > 1


def check_streamed_groups_equal_generate(subject: ContractSubject) -> None:
    """`generate` is `submit` + `step`: the seeded requests of `group_requests` give the same
    responses either way."""
    sampling = SamplingSettings(temperature=0.9, max_new_tokens=8, seed=41)
    blocking = subject.backend.generate(subject.prompts, 3, sampling)
    subject.backend.submit(group_requests(subject.prompts, 3, sampling))
    streamed = {group[0].prompt_id: group for group in _drain(subject.backend)}
    for group in blocking:
        assert [r.response_token_ids for r in streamed[group[0].prompt_id]] == [
            r.response_token_ids for r in group
        ]


def check_groups_join_a_running_batch(subject: ContractSubject) -> None:
    """Groups submitted while others decode are admitted and come back whole and valid."""
    backend = subject.backend
    first, *others = subject.prompts
    backend.submit([GroupRequest(first, 3, SamplingSettings(max_new_tokens=16, seed=51))])
    groups = backend.step() + backend.step()
    later = [
        GroupRequest(p, 2, SamplingSettings(temperature=0.7, top_k=5, max_new_tokens=10, seed=i))
        for i, p in enumerate(others)
    ]
    backend.submit(later)
    groups += _drain(backend)
    sizes = {group[0].prompt_id: len(group) for group in groups}
    assert sizes == {first.prompt_id: 3, **{p.prompt_id: 2 for p in others}}
    for group in groups:
        limit = 16 if group[0].prompt_id == first.prompt_id else 10
        for response in group:
            assert 1 <= len(response.response_token_ids) <= limit
            assert len(response.behaviour_logprobs) == len(response.response_token_ids)
            assert all(math.isfinite(lp) and lp <= 1e-6 for lp in response.behaviour_logprobs)
            assert response.text == subject.decode(response.response_token_ids)


def check_submit_refuses_bad_requests_whole(subject: ContractSubject) -> None:
    """A bad request raises ValueError naming its prompt and queues nothing of its submit."""
    good = GroupRequest(subject.prompts[0], 2, SamplingSettings(max_new_tokens=2))
    bad_prompt = replace(subject.prompts[1], prompt_id="the-bad-one")
    bad = GroupRequest(bad_prompt, 2, SamplingSettings(top_k=-1))
    with pytest.raises(ValueError, match="the-bad-one"):
        subject.backend.submit([good, bad])
    assert subject.backend.in_flight == 0


def check_weights_loaded_mid_flight_tag_tokens(subject: ContractSubject) -> None:
    """Weights loaded between two steps with groups in flight: the following tokens carry the
    new version; a response keeps the version of its first token and lists every token's
    version when it spans two."""
    if subject.weights is None:
        pytest.skip("the subject gives no weights to load")
    backend = subject.backend
    old = backend.policy_version
    weights = subject.weights()
    sampling = SamplingSettings(max_new_tokens=16, seed=61)
    backend.submit([GroupRequest(p, 4, sampling) for p in subject.prompts])
    groups = backend.step() + backend.step()
    backend.load_weights(weights, old + 1)
    assert backend.policy_version == old + 1
    groups += _drain(backend)
    spanning = 0
    for response in (r for group in groups for r in group):
        versions = response.versions()
        assert len(versions) == len(response.response_token_ids)
        assert response.policy_version == versions[0] == old
        assert versions == sorted(versions) and set(versions) <= {old, old + 1}
        if len(set(versions)) == 2:
            spanning += 1
            assert response.token_versions == versions and response.version_span == 2
        else:
            assert response.token_versions == [] and response.version_span == 1
    assert spanning > 0, "no response was in flight across the load"


STREAMING_CHECKS: list[Callable[[ContractSubject], None]] = [
    check_idle_backend_steps_to_nothing,
    check_short_group_streams_back_first,
    check_streamed_groups_equal_generate,
    check_groups_join_a_running_batch,
    check_submit_refuses_bad_requests_whole,
    check_weights_loaded_mid_flight_tag_tokens,
]


CHECKS: list[Callable[[ContractSubject], None]] = [
    check_groups_in_prompt_order,
    check_response_fields,
    check_finish_reasons,
    check_max_new_tokens,
    check_seed_determinism,
    check_prompt_token_ids,
    check_greedy,
    check_rejects_bad_settings,
    *STREAMING_CHECKS,
]
