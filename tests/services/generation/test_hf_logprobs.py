"""Behaviour log-probs of the `hf` backend against a plain transformers forward pass.

The reference runs one sequence at a time, unpadded and without a KV cache, over prompt +
response, so it shares nothing with the batched, left-padded, cached sampling loop except the
weights. Tolerance: both sides are float32 on CPU, differing only in summation order (padded vs
unpadded attention, cached vs full matmuls, 2 layers); that gives errors of order 1e-6 (measured
max 3.8e-6 at temperature 1, 4.5e-6 at temperature 0.7 with top-k 5). 1e-4 leaves a wide margin
over that, yet real faults move log-probs by far more: decode-step positions taken from the padded
width instead of each row's length gave errors of 4.0, unmasked padding 1.8, and a temperature
left out changes them by a factor of the temperature.
"""

from __future__ import annotations

import torch

from services.generation.base import SamplingSettings
from services.generation.hf_backend import HFBackend
from services.messages import Prompt, Response

TOLERANCE = 1e-4
# Different lengths, so the batch is left-padded and some rows stop (EOS) while others go on.
PROMPTS = [
    Prompt("short", "7", ""),
    Prompt("mid", "1+2=", ""),
    Prompt("long", "99-3=;# 5 + 12", ""),
]


def reference_logits(backend: HFBackend, response: Response) -> torch.Tensor:
    """Raw next-token logits at each response position, from one uncached unpadded forward."""
    ids = torch.tensor([response.prompt_token_ids + response.response_token_ids])
    with torch.no_grad():
        logits = backend.model(input_ids=ids).logits[0].float()
    start = len(response.prompt_token_ids) - 1
    return logits[start : start + len(response.response_token_ids)]


def generate(backend: HFBackend, sampling: SamplingSettings) -> list[Response]:
    groups = backend.generate(PROMPTS, 6, sampling)
    return [response for group in groups for response in group]


def max_error(actual: list[float], expected: torch.Tensor) -> float:
    return float((torch.tensor(actual) - expected).abs().max())


def test_plain_sampling_logprobs_equal_the_model_log_softmax(hf_backend: HFBackend) -> None:
    """Temperature 1, no truncation: behaviour log-probs are the model's plain log-probs."""
    responses = generate(hf_backend, SamplingSettings(max_new_tokens=24, seed=11))
    assert {r.finish_reason for r in responses} == {"stop", "length"}
    worst = 0.0
    for response in responses:
        tokens = torch.tensor(response.response_token_ids)[:, None]
        logprobs = reference_logits(hf_backend, response).log_softmax(-1)
        worst = max(
            worst, max_error(response.behaviour_logprobs, logprobs.gather(-1, tokens)[:, 0])
        )
    print(f"max |behaviour - reference| log-prob error: {worst:.3e}")
    assert worst < TOLERANCE


def test_temperature_and_top_k_logprobs_are_renormalised_over_the_top_k(
    hf_backend: HFBackend,
) -> None:
    """Temperature 0.7, top-k 5: log_softmax(logits / 0.7) restricted to the top 5, renormalised."""
    sampling = SamplingSettings(temperature=0.7, top_k=5, max_new_tokens=20, seed=12)
    worst = 0.0
    for response in generate(hf_backend, sampling):
        scaled = reference_logits(hf_backend, response) / 0.7
        top = scaled.topk(5, dim=-1)
        tokens = torch.tensor(response.response_token_ids)[:, None]
        assert bool((top.indices == tokens).any(-1).all()), "a token outside the top-k was sampled"
        expected = scaled.gather(-1, tokens)[:, 0] - top.values.logsumexp(-1)
        worst = max(worst, max_error(response.behaviour_logprobs, expected))
    print(f"max log-prob error at temperature 0.7, top-k 5: {worst:.3e}")
    assert worst < TOLERANCE


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean mask of the smallest set of most likely tokens with total mass >= top_p."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def test_top_p_logprobs_are_renormalised_over_the_nucleus(hf_backend: HFBackend) -> None:
    """Temperature 1.3, top-p 0.8: log-probs renormalised over the nucleus of the scaled logits."""
    sampling = SamplingSettings(temperature=1.3, top_p=0.8, max_new_tokens=20, seed=13)
    worst = 0.0
    for response in generate(hf_backend, sampling):
        scaled = reference_logits(hf_backend, response) / 1.3
        keep = nucleus(scaled.softmax(-1), 0.8)
        tokens = torch.tensor(response.response_token_ids)[:, None]
        assert bool(keep.gather(-1, tokens).all()), "a token outside the nucleus was sampled"
        renormalised = scaled.masked_fill(~keep, float("-inf")).log_softmax(-1)
        worst = max(
            worst, max_error(response.behaviour_logprobs, renormalised.gather(-1, tokens)[:, 0])
        )
    assert worst < TOLERANCE


def test_greedy_follows_the_arg_max_with_zero_logprobs(hf_backend: HFBackend) -> None:
    """Temperature 0 picks the arg-max of the plain forward at every step."""
    for response in generate(hf_backend, SamplingSettings(temperature=0.0, max_new_tokens=16)):
        argmax = reference_logits(hf_backend, response).argmax(-1).tolist()
        assert response.response_token_ids == argmax
        assert response.behaviour_logprobs == [0.0] * len(argmax)
