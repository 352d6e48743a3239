"""The learner's recomputed log-probs: against the behaviour log-probs of the `hf` backend, and
chunked against one projection of every position.

Same weights on both sides, so the only difference is float32 summation order: a batched,
KV-cached, left-padded sampling loop against one full forward over [prompt | response]. Measured
max errors: 2.9e-6 at temperature 1 and 4.9e-6 at temperature 0.7. The tolerance, 5e-5, is ten
times that; the faults this guards against move log-probs by far more: a temperature left out,
1.2 here (`test_a_missing_temperature_is_detected`); logit columns off by one, 6.7. (Positions
counted from the padded start instead of each row's first token only gave 3.3e-6: this rotary
model sees position differences within a row, which left padding does not change.)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kpo_core.losses import token_entropy
from services.learner.batch import TrainingBatch, collate
from services.learner.logprobs import ResponseLogProbs, reference_logprobs, response_logprobs
from services.learner.packed_attention import register_learner_attention
from tests.services.learner.conftest import sample_groups

TOLERANCE = 5e-5
PAD = 0


def policy(model_dir: Path, chunk_tokens: int = 1024) -> ResponseLogProbs:
    return ResponseLogProbs(AutoModelForCausalLM.from_pretrained(model_dir), chunk_tokens)


def max_error(model_dir: Path, sample_temperature: float, learner_temperature: float) -> float:
    groups = sample_groups(model_dir, temperature=sample_temperature)
    reasons = {s.response.finish_reason for g in groups for s in g.responses}
    assert reasons == {"stop", "length"}, "want right-padded rows as well as full-length ones"
    batch = collate(groups, PAD, learner_version=0)
    with torch.no_grad():
        logp, entropy = response_logprobs(
            policy(model_dir), batch, learner_temperature, with_entropy=True
        )
    assert logp.shape == batch.response_mask.shape and logp.dtype == torch.float32
    assert entropy is not None and bool(torch.isfinite(entropy).all())
    assert bool((logp[~batch.response_mask] == 0).all())
    return float((logp - batch.behaviour_logp)[batch.response_mask].abs().max())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recomputed_logprobs_equal_the_behaviour_logprobs(
    tiny_model_dir: Path, temperature: float
) -> None:
    error = max_error(tiny_model_dir, temperature, temperature)
    print(f"max |learner - behaviour| log-prob at temperature {temperature}: {error:.2e}")
    assert error < TOLERANCE


def test_a_missing_temperature_is_detected(tiny_model_dir: Path) -> None:
    assert max_error(tiny_model_dir, 0.7, 1.0) > 1e-2


def full_logits_reference(
    model: torch.nn.Module, batch: TrainingBatch, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the learner computed before chunking: every position's [B, T, V] logits at once."""
    width = batch.response_width
    output = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=width + 1,
        use_cache=False,
    )
    logits = output.logits[:, :-1, :] / temperature
    chosen = logits.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(batch.response_mask, chosen - torch.logsumexp(logits, -1), 0.0)
    entropy = torch.where(batch.response_mask, token_entropy(logits.detach()), 0.0)
    return logp, entropy


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("chunk_tokens", [1, 7, 10_000])
def test_chunked_logprobs_equal_one_projection_in_values_and_gradients(
    tiny_model_dir: Path, chunk_tokens: int
) -> None:
    """In float64, so that the comparison sees the computation, not float32 summation order
    (which moves float32 log-probs by up to 2e-6 between a [B, T, V] and an [N, V] matmul)."""
    batch = collate(sample_groups(tiny_model_dir), PAD, learner_version=0)
    assert int(batch.response_mask.sum()) > 7  # several chunks of 7 and of 1
    model = policy(tiny_model_dir, chunk_tokens).double()
    weights = torch.linspace(-1.0, 1.0, batch.response_mask.numel(), dtype=torch.float64)
    weights = weights.reshape(batch.response_mask.shape)
    logp, entropy = model(batch, 0.7, with_entropy=True)
    (logp * weights).sum().backward()
    chunked_grads = gradients(model.policy)
    expected_logp, expected_entropy = full_logits_reference(model.policy, batch, 0.7)
    (expected_logp * weights).sum().backward()
    expected_grads = gradients(model.policy)
    torch.testing.assert_close(logp, expected_logp, rtol=0, atol=1e-9)
    # The reference's entropy is float32 (token_entropy), the chunked one float64 until its end.
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=1e-5)
    assert chunked_grads.keys() == expected_grads.keys() and chunked_grads
    for name, grad in chunked_grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-9, msg=name)


def test_reference_logprobs_in_parts_equal_one_forward(tiny_model_dir: Path) -> None:
    batch = collate(sample_groups(tiny_model_dir), PAD, learner_version=0)
    model = policy(tiny_model_dir)
    with torch.no_grad():
        whole, _ = response_logprobs(model, batch, 1.0, with_entropy=False)
    parts = [p.tolist() for p in torch.tensor_split(torch.arange(batch.num_rows), 5)]
    in_parts = reference_logprobs(model, batch, 1.0, parts)
    assert not in_parts.requires_grad
    torch.testing.assert_close(in_parts, whole, rtol=1e-6, atol=1e-6)


def test_a_batch_without_response_tokens_keeps_the_head_in_the_graph(tiny_model_dir: Path) -> None:
    batch = collate(sample_groups(tiny_model_dir), PAD, learner_version=0)
    empty = TrainingBatch(
        **{**batch.__dict__, "response_mask": torch.zeros_like(batch.response_mask)}
    )
    model = policy(tiny_model_dir)
    logp, _ = model(empty, 1.0, with_entropy=False)
    assert bool((logp == 0).all()) and logp.requires_grad
    logp.sum().backward()
    head = model.policy.lm_head.weight
    assert head.grad is not None and bool((head.grad == 0).all())


def poison_hidden(
    model: ResponseLogProbs, batch: TrainingBatch, cells: dict[tuple[int, int], float]
) -> torch.utils.hooks.RemovableHandle:
    """A forward hook on the decoder's final norm adding v to one feature of the hidden state
    that scores response slot (r, j) (padded column P - 1 + j of row r), for each ((r, j), v)
    of `cells`: its logits are then NaN (v NaN) or +-inf (v inf), as an overflow would make
    them. Added, not assigned: an assignment would also cut the gradient there."""

    def hook(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        poison = torch.zeros_like(output)
        for (row, column), value in cells.items():
            poison[row, batch.prompt_width - 1 + column, 0] = value
        return output + poison

    return model.policy.model.norm.register_forward_hook(hook)


def test_nonfinite_logits_give_nan_logprobs_there_and_a_finite_gradient(
    tiny_model_dir: Path,
) -> None:
    batch = collate(sample_groups(tiny_model_dir), PAD, learner_version=0)
    model = policy(tiny_model_dir)
    (first, second) = [(r, c) for r, c in batch.response_mask.nonzero().tolist()[:2]]
    handle = poison_hidden(model, batch, {first: float("nan"), second: float("inf")})
    positions = (first, second)
    logp, entropy = response_logprobs(model, batch, 1.0, with_entropy=True)
    assert entropy is not None
    bad = torch.zeros_like(batch.response_mask)
    for row, column in positions:
        assert bool(logp[row, column].isnan()) and bool(entropy[row, column].isnan())
        bad[row, column] = True
    assert bool(torch.isfinite(logp[~bad]).all()) and bool(torch.isfinite(entropy[~bad]).all())
    # The loss drops the NaN tokens with where(); what reaches the weights must be finite.
    torch.where(bad, 0.0, logp).sum().backward()
    handle.remove()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and bool(torch.isfinite(parameter.grad).all()), name


def packed_policy(model_dir: Path) -> ResponseLogProbs:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation=register_learner_attention()
    )
    return ResponseLogProbs(model, 1024, packed=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_rows_give_the_log_probs_and_gradients_of_padded_rows(
    tiny_model_dir: Path, dtype: torch.dtype
) -> None:
    """Rows concatenated without padding (`learner.pack_rows`; varlen attention on CUDA, each
    row's own causal attention here) against padded rows, with rows of very different lengths
    (a 2-token response beside 40-token ones) and a masked row. float64 sees the computation
    itself; float32 is what the learner runs (tolerance 1e-5)."""
    long_groups = sample_groups(tiny_model_dir, max_new_tokens=40, seed=5)
    short_groups = sample_groups(tiny_model_dir, max_new_tokens=2, seed=6)
    batch = collate(long_groups[:2] + short_groups[:1], PAD, learner_version=0)
    lengths = sorted(set(batch.response_lengths))
    assert lengths[0] <= 2 and lengths[-1] >= 20, lengths
    mask = batch.response_mask.clone()
    mask[1] = False  # a masked row (a NaN reward) is scored, then zeroed
    batch = replace(batch, response_mask=mask)
    padded = policy(tiny_model_dir).to(dtype)
    packed = packed_policy(tiny_model_dir).to(dtype)
    weights = torch.linspace(-1.0, 1.0, mask.numel(), dtype=dtype).reshape(mask.shape)
    results = []
    for model in (padded, packed):
        logp, entropy = model(batch, 0.7, with_entropy=True)
        (logp * weights).sum().backward()
        results.append((logp, entropy, gradients(model.policy)))
    (logp, entropy, grads), (packed_logp, packed_entropy, packed_grads) = results
    atol = 1e-9 if dtype == torch.float64 else 1e-5
    assert bool((packed_logp[1] == 0).all()) and bool((packed_logp[0] != 0).any())
    torch.testing.assert_close(packed_logp, logp, rtol=0, atol=atol)
    torch.testing.assert_close(packed_entropy, entropy, rtol=0, atol=1e-5)
    assert grads.keys() == packed_grads.keys() and grads
    for name, grad in grads.items():
        # Relative to the gradient's own scale: float32 sums of many tokens' contributions (the
        # embedding's rows) differ in their last bits between the two attention layouts.
        scale = float(grad.abs().max())
        error = float((packed_grads[name] - grad).abs().max())
        print(f"{name}: max |packed - padded| {error:.2e} of a max |grad| {scale:.2e}")
        assert error <= atol * max(scale, 1.0), name
