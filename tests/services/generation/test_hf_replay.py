"""Truncated-sampling replay, the sampler's half: min-p, and the kept set each sampled token
records for the learner (`SamplingSettings.replay_max_kept`, `Response.kept_ids`).

The learner's half (its log-probs over these sets equal the behaviour log-probs) is
tests/services/learner/test_replay.py.
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from services.generation.base import SamplingSettings
from services.generation.hf_backend import HFBackend
from services.generation.hf_sampling import kept_sets, processed_logprobs, sample_rows
from services.messages import Prompt, Response
from tests.services.generation.test_hf_logprobs import reference_logits

PROMPTS = [Prompt("short", "7", ""), Prompt("long", "99-3=;# 5 + 12", "")]


def kept_mask(logits: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    return torch.isfinite(processed_logprobs(logits, sampling))


def test_min_p_keeps_the_tokens_within_min_p_of_the_most_likely() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, min_p in ((1.0, 0.1), (0.6, 0.02), (1.7, 0.5)):
        probs = (logits / temperature).softmax(-1)
        expected = probs >= min_p * probs.amax(-1, keepdim=True)
        keep = kept_mask(logits, SamplingSettings(temperature=temperature, min_p=min_p))
        assert torch.equal(keep, expected)
        processed = processed_logprobs(logits, SamplingSettings(temperature, min_p=min_p))
        renormalised = (logits / temperature).masked_fill(~expected, -torch.inf).log_softmax(-1)
        torch.testing.assert_close(processed, renormalised, rtol=0, atol=1e-6)
    # min_p 1 keeps the most likely token (and its ties) only; 0 keeps everything.
    assert bool((kept_mask(logits, SamplingSettings(min_p=1.0)).sum(-1) == 1).all())
    assert bool(kept_mask(logits, SamplingSettings(min_p=0.0)).all())


def test_min_p_comes_before_top_p_as_in_vllms_sampler() -> None:
    """Probabilities 0.5, 0.3, 0.15, 0.05: min-p 0.4 keeps the first two (>= 0.2), whose
    renormalised masses are 0.625 and 0.375; top-p 0.6 then keeps the first alone. Top-p over
    the whole distribution first would have kept both (0.5 above the second < 0.6)."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    both = kept_mask(logits, SamplingSettings(min_p=0.4, top_p=0.6))
    assert both.tolist() == [[True, False, False, False]]
    assert kept_mask(logits, SamplingSettings(top_p=0.6)).tolist() == [[True, True, False, False]]


def test_min_p_and_top_k_commute() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1)) * 3
    sampling = SamplingSettings(temperature=0.8, min_p=0.05, top_k=7)
    keep = kept_mask(logits, sampling)
    top_k = kept_mask(logits, SamplingSettings(temperature=0.8, top_k=7))
    min_p = kept_mask(logits, SamplingSettings(temperature=0.8, min_p=0.05))
    assert torch.equal(keep, top_k & min_p)
    assert bool((keep.sum(-1) < 7).any()) and bool((keep.sum(-1) == 7).any())


def test_kept_sets_are_the_finite_ids_ascending_or_empty_over_the_limit() -> None:
    inf = torch.inf
    processed = torch.tensor(
        [
            [-0.1, -inf, -2.0, -inf, -3.0],  # 3 kept
            [-inf, -inf, -inf, 0.0, -inf],  # 1 kept
            [-1.0, -2.0, -3.0, -4.0, -5.0],  # 5 kept: over a limit of 3
        ]
    )
    assert kept_sets(processed, 3) == [[0, 2, 4], [3], []]
    assert kept_sets(processed, 5) == [[0, 2, 4], [3], [0, 1, 2, 3, 4]]


def test_sample_rows_records_the_sets_of_the_rows_that_ask_only() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(4, 1)
    settings = [
        SamplingSettings(top_k=2, replay_max_kept=3),
        SamplingSettings(top_k=4, replay_max_kept=3),  # over the limit
        SamplingSettings(top_k=2),  # no replay
        SamplingSettings(temperature=0.0, replay_max_kept=3),  # greedy: the arg-max alone
    ]
    draws = sample_rows(logits, settings, torch.tensor([0.3, 0.9, 0.5, 0.5]))
    assert draws.kept == {0: [0, 1], 1: [], 3: [0]}
    tokens = draws.tokens.tolist()
    assert tokens[0] in (0, 1) and tokens[3] == 0
    # Recording changes nothing of the draws.
    plain = sample_rows(
        logits,
        [SamplingSettings(top_k=2), SamplingSettings(top_k=4), settings[2], SamplingSettings(0.0)],
        torch.tensor([0.3, 0.9, 0.5, 0.5]),
    )
    assert torch.equal(plain.tokens, draws.tokens) and torch.equal(plain.logprobs, draws.logprobs)
    assert plain.kept == {}


def generate(backend: HFBackend, sampling: SamplingSettings) -> list[Response]:
    return [r for group in backend.generate(PROMPTS, 4, sampling) for r in group]


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingSettings(temperature=0.7, top_k=5, max_new_tokens=16, seed=21),
        SamplingSettings(temperature=1.3, top_p=0.8, max_new_tokens=16, seed=22),
        SamplingSettings(temperature=1.0, min_p=0.1, max_new_tokens=16, seed=23),
    ],
    ids=["top_k", "top_p", "min_p"],
)
def test_each_sampled_token_records_its_kept_set(
    hf_backend: HFBackend, sampling: SamplingSettings
) -> None:
    """Every response token has its set: ascending, holding the token, and the set the
    processed distribution of a plain forward keeps (the same weights, another summation
    order). Recording changes nothing of what is sampled."""
    responses = generate(hf_backend, replace(sampling, replay_max_kept=20))
    plain = generate(hf_backend, sampling)
    assert [r.response_token_ids for r in responses] == [r.response_token_ids for r in plain]
    assert all(r.kept_ids == [] for r in plain)
    sizes = set()
    for response in responses:
        assert len(response.kept_ids) == len(response.response_token_ids)
        keep = kept_mask(reference_logits(hf_backend, response), sampling)
        for token, kept, row in zip(
            response.response_token_ids, response.kept_ids, keep, strict=True
        ):
            assert kept == sorted(kept) and token in kept
            assert kept == row.nonzero()[:, 0].tolist()
            sizes.add(len(kept))
    assert max(sizes) < len(hf_backend.tokenizer), "nothing was truncated"


def test_a_set_over_the_limit_is_recorded_empty(hf_backend: HFBackend) -> None:
    sampling = SamplingSettings(temperature=1.3, top_p=0.9, max_new_tokens=16, seed=24)
    full = generate(hf_backend, replace(sampling, replay_max_kept=20))
    sizes = sorted(len(kept) for r in full for kept in r.kept_ids)
    limit = sizes[len(sizes) // 2]
    assert sizes[0] <= limit < sizes[-1], "want sets on both sides of the limit"
    limited = generate(hf_backend, replace(sampling, replay_max_kept=limit))
    for whole, response in zip(full, limited, strict=True):
        assert response.response_token_ids == whole.response_token_ids
        assert response.kept_ids == [s if len(s) <= limit else [] for s in whole.kept_ids]


def top_logprobs(values: dict[int, float], sampled: int) -> dict[int, SimpleNamespace]:
    """What vLLM returns at one position: the top log-probs asked for (ranks 1..n) and the
    sampled token's, ranked among all."""
    order = sorted(values, key=lambda t: -values[t])
    entry = {t: SimpleNamespace(logprob=values[t], rank=r) for r, t in enumerate(order, 1)}
    if sampled not in entry:
        entry[sampled] = SimpleNamespace(logprob=-0.5, rank=len(values) + 3)
    return entry


def test_vllms_top_log_probs_give_the_kept_set_or_over_the_limit() -> None:
    """The parsing half of the vLLM backend's kept sets (the engine's half is in the vLLM
    stage, tests/services/generation/test_vllm_backend.py): asked for limit + 1, a position
    whose asked-for log-probs are all finite kept more than the limit."""
    from services.generation.vllm_backend import VLLM_MAX_LOGPROBS, _kept_sets, _logprobs_asked
    from services.spec.bounds import MAX_REPLAY_KEPT

    # The engine allows the largest set a spec may ask to record, and the one more id.
    assert VLLM_MAX_LOGPROBS == MAX_REPLAY_KEPT + 1

    inf = -math.inf
    sampling = SamplingSettings(top_p=0.9, replay_max_kept=3)
    assert _logprobs_asked(sampling, vocab_size=100) == 4
    assert _logprobs_asked(replace(sampling, top_k=2), vocab_size=100) == 3
    assert _logprobs_asked(replace(sampling, replay_max_kept=None), vocab_size=100) == 0
    assert _logprobs_asked(replace(sampling, replay_max_kept=300), vocab_size=100) == 100
    positions = [
        top_logprobs({7: -0.1, 3: -2.0, 9: inf, 1: inf}, sampled=3),  # {3, 7}
        top_logprobs({5: -0.2, 4: -1.0, 2: -3.0, 8: -4.0}, sampled=5),  # 4 finite: over 3
        top_logprobs({6: -0.01, 0: inf, 1: inf, 2: inf}, sampled=6),  # {6}
    ]
    output = SimpleNamespace(logprobs=positions)
    assert _kept_sets(output, [3, 5, 6], sampling, False, 100) == [[3, 7], [], [6]]  # type: ignore[arg-type]
    assert _kept_sets(output, [3, 5, 6], sampling, True, 100) == [[3], [5], [6]]  # type: ignore[arg-type]
    plain = replace(sampling, replay_max_kept=None)
    assert _kept_sets(output, [3, 5, 6], plain, False, 100) is None  # type: ignore[arg-type]
    # A vocabulary no larger than what was asked for: all finite is the whole set.
    whole = SimpleNamespace(logprobs=[top_logprobs({0: -1.0, 1: -0.5}, sampled=1)])
    wide = replace(sampling, replay_max_kept=8)
    assert _kept_sets(whole, [1], wide, False, 2) == [[0, 1]]  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="no log-probs"):
        _kept_sets(SimpleNamespace(logprobs=None), [1], wide, False, 2)  # type: ignore[arg-type]
