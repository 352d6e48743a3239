"""Continuous batching of the `hf` backend: groups join a running batch and leave it on their own.

The strongest check of a merged KV cache is that a group's responses do not depend on what it
shares the batch with: each group samples from its own seeded stream (hf_engine.GroupNoise), so
alone or merged into a batch that is already decoding, it must give the same tokens, and
log-probs equal to a plain forward over prompt + response (one unpadded sequence, no cache).
Tolerance 1e-4 as in test_hf_logprobs.py (float32 rounding of padded, cached matmuls is ~1e-6;
a wrong position or mask moves log-probs by more than 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.generation.base import GroupRequest, SamplingSettings
from services.generation.hf_backend import HFBackend, NonFiniteLogitsError
from services.generation.hf_sampling import processed_logprobs
from services.messages import Prompt, Response

TOLERANCE = 1e-4


def request(prompt_id: str, text: str, group_size: int, **sampling: float) -> GroupRequest:
    return GroupRequest(Prompt(prompt_id, text, ""), group_size, SamplingSettings(**sampling))  # type: ignore[arg-type]


def drive(
    backend: HFBackend, schedule: dict[int, list[GroupRequest]]
) -> tuple[dict[str, list[Response]], dict[str, int]]:
    """Step until idle, submitting `schedule[s]` just before step s; return the groups by prompt
    id and the step each ended in."""
    groups: dict[str, list[Response]] = {}
    ended_at: dict[str, int] = {}
    step = 0
    while step <= max(schedule) or backend.in_flight:
        backend.submit(schedule.get(step, []))
        for group in backend.step():
            groups[group[0].prompt_id] = group
            ended_at[group[0].prompt_id] = step
        step += 1
    return groups, ended_at


def reference_logprobs(
    model: torch.nn.Module, response: Response, sampling: SamplingSettings
) -> torch.Tensor:
    """Processed log-probs of the response's tokens from one uncached, unpadded forward."""
    ids = torch.tensor([response.prompt_token_ids + response.response_token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    start = len(response.prompt_token_ids) - 1
    logits = logits[start : start + len(response.response_token_ids)]
    if sampling.temperature == 0:
        return torch.zeros(len(response.response_token_ids))
    tokens = torch.tensor(response.response_token_ids)[:, None]
    return processed_logprobs(logits, sampling).gather(-1, tokens)[:, 0]


def max_error(response: Response, expected: torch.Tensor) -> float:
    return float((torch.tensor(response.behaviour_logprobs) - expected).abs().max())


def test_a_short_group_comes_back_while_a_long_group_of_the_same_submit_decodes(
    hf_backend: HFBackend,
) -> None:
    long = request("long", "12+34=", 4, max_new_tokens=12, seed=3)
    short = request("short", "1+2=", 2, max_new_tokens=1, seed=4)
    hf_backend.submit([long, short])
    assert hf_backend.in_flight == 2
    first = hf_backend.step()
    assert [group[0].prompt_id for group in first] == ["short"]
    assert [len(r.response_token_ids) for r in first[0]] == [1, 1]
    assert hf_backend.in_flight == 1  # the long group is still decoding
    rest: list[list[Response]] = []
    while hf_backend.in_flight:
        rest.extend(hf_backend.step())
    assert [group[0].prompt_id for group in rest] == ["long"]
    assert max(len(r.response_token_ids) for r in rest[0]) > 1
    assert hf_backend.step() == []


def test_groups_admitted_mid_decode_match_their_runs_alone(hf_backend: HFBackend) -> None:
    """Three groups with different prompts, lengths and settings (plain, temperature 0.7 with
    top-k 5, greedy) join a batch that is already decoding; each equals its run alone."""
    groups = {
        "a": request("a", "1+2=", 3, max_new_tokens=24, seed=1),
        "b": request("b", "99-3=;# 5 + 12", 4, temperature=0.7, top_k=5, max_new_tokens=20, seed=2),
        "c": request("c", "7", 2, temperature=0.0, max_new_tokens=16),
    }
    alone = {key: drive(hf_backend, {0: [group]})[0][key] for key, group in groups.items()}
    merged, ended_at = drive(hf_backend, {0: [groups["a"]], 3: [groups["b"]], 5: [groups["c"]]})
    # The premise: the later groups were admitted while "a" was decoding, "a" ended after.
    assert ended_at["a"] > 5
    for key, group in groups.items():
        assert [r.response_token_ids for r in merged[key]] == [
            r.response_token_ids for r in alone[key]
        ], key
        for merged_response, alone_response in zip(merged[key], alone[key], strict=True):
            assert merged_response.behaviour_logprobs == pytest.approx(
                alone_response.behaviour_logprobs, abs=1e-5
            )
            error = max_error(
                merged_response,
                reference_logprobs(hf_backend.model, merged_response, group.sampling),
            )
            assert error < TOLERANCE, (key, error)
    finish = {r.finish_reason for key in "ab" for r in merged[key]}
    assert finish == {"stop", "length"}, "rows should both stop and run out while others run"


def test_row_cap_queues_groups_until_rows_free_up(tiny_model_dir: Path) -> None:
    backend = HFBackend(tiny_model_dir, max_batch_rows=4)
    requests = [
        request(f"g{i}", text, 2, max_new_tokens=6 + 4 * i, seed=10 + i)
        for i, text in enumerate(["1+2=", "7", "40-13=", "5"])
    ]
    backend.submit(requests)
    returned: dict[str, list[Response]] = {}
    peak = 0
    while backend.in_flight:
        for group in backend.step():
            returned[group[0].prompt_id] = group
        peak = max(peak, backend.running_rows)
    assert peak == 4
    reference = HFBackend(tiny_model_dir)
    for item in requests:
        alone = drive(reference, {0: [item]})[0][item.prompt.prompt_id]
        assert [r.response_token_ids for r in returned[item.prompt.prompt_id]] == [
            r.response_token_ids for r in alone
        ]
    with pytest.raises(ValueError, match="max_batch_rows"):
        HFBackend(tiny_model_dir, max_batch_rows=0)


def test_a_bad_request_queues_nothing(hf_backend: HFBackend) -> None:
    good = request("good", "1+2=", 2, max_new_tokens=3)
    bad = request("bad", "7", 2, top_p=0.0)
    with pytest.raises(ValueError, match=r"prompt 'bad'.*top_p"):
        hf_backend.submit([good, bad])
    assert hf_backend.in_flight == 0
    with pytest.raises(ValueError, match="group_size"):
        hf_backend.submit([request("empty", "7", 0)])


def test_generate_refuses_while_submitted_groups_are_in_flight(fresh_hf_backend: HFBackend) -> None:
    backend = fresh_hf_backend
    backend.submit([request("a", "1+2=", 2, max_new_tokens=4)])
    with pytest.raises(RuntimeError, match="in flight"):
        backend.generate([Prompt("b", "7", "")], 2, SamplingSettings(max_new_tokens=2))
    while backend.in_flight:
        backend.step()
    assert len(backend.generate([Prompt("b", "7", "")], 2, SamplingSettings(max_new_tokens=2))) == 1


def test_seeded_generate_gives_the_groups_of_one_prompt_different_streams(
    hf_backend: HFBackend,
) -> None:
    prompt = Prompt("same", "1+2=", "")
    sampling = SamplingSettings(max_new_tokens=10, seed=5)
    first, second = hf_backend.generate([prompt, prompt], 4, sampling)
    assert [r.response_token_ids for r in first] != [r.response_token_ids for r in second]
    assert [g[0].prompt_id for g in (first, second)] == ["same", "same"]


def test_non_finite_weights_fail_the_step_naming_the_prompts(fresh_hf_backend: HFBackend) -> None:
    backend = fresh_hf_backend
    broken = {k: torch.full_like(v, float("nan")) for k, v in backend.model.state_dict().items()}
    backend.load_weights(broken, version=1)
    backend.submit([request("p", "1+2=", 2, max_new_tokens=4)])
    with pytest.raises(NonFiniteLogitsError, match=r"version 1 for prompts \['p'\]"):
        backend.step()
