"""The learner's recomputed log-probs against the behaviour log-probs of the `hf` backend.

Same weights on both sides, so the only difference is float32 summation order: a batched,
KV-cached, left-padded sampling loop against one full forward over [prompt | response]. Measured
max errors: 2.9e-6 at temperature 1 and 4.9e-6 at temperature 0.7. The tolerance, 5e-5, is ten
times that; the faults this guards against move log-probs by far more: a temperature left out,
1.2 here (`test_a_missing_temperature_is_detected`); logit columns off by one, 6.7. (Positions
counted from the padded start instead of each row's first token only gave 3.3e-6: this rotary
model sees position differences within a row, which left padding does not change.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.learner.batch import collate
from services.learner.logprobs import reference_logprobs, response_logprobs
from tests.services.learner.conftest import sample_groups

TOLERANCE = 5e-5
PAD = 0


def max_error(model_dir: Path, sample_temperature: float, learner_temperature: float) -> float:
    groups = sample_groups(model_dir, temperature=sample_temperature)
    reasons = {s.response.finish_reason for g in groups for s in g.responses}
    assert reasons == {"stop", "length"}, "want right-padded rows as well as full-length ones"
    batch = collate(groups, PAD, learner_version=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # in eval mode
    with torch.no_grad():
        logp, entropy = response_logprobs(model, batch, learner_temperature, with_entropy=True)
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


def test_reference_logprobs_in_chunks_equal_one_forward(tiny_model_dir: Path) -> None:
    batch = collate(sample_groups(tiny_model_dir), PAD, learner_version=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        whole, _ = response_logprobs(model, batch, 1.0, with_entropy=False)
    chunked = reference_logprobs(model, batch, 1.0, chunks=5)
    assert not chunked.requires_grad
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)


def poison_logits(model: torch.nn.Module, cells: dict[tuple[int, int], float]) -> object:
    """A forward hook on lm_head adding value v to a few logits of each (row, kept column).

    Added, as an overflow would make them: an assignment would also cut the gradient there.
    """

    def hook(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        poison = torch.zeros_like(output)
        for (row, column), value in cells.items():
            poison[row, column, : 1 + (row % 3)] = value  # a few vocabulary entries
        return output + poison

    return model.lm_head.register_forward_hook(hook)


def test_nonfinite_logits_give_nan_logprobs_there_and_a_finite_gradient(
    tiny_model_dir: Path,
) -> None:
    batch = collate(sample_groups(tiny_model_dir), PAD, learner_version=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # Column t of the kept logits predicts response slot t; slot 0 is valid in every row.
    cells = {(0, 0): float("nan"), (1, 0): float("inf"), (2, 1): float("-inf")}
    handle = poison_logits(model, cells)
    logp, entropy = response_logprobs(model, batch, 1.0, with_entropy=True)
    handle.remove()  # type: ignore[attr-defined]
    assert entropy is not None and bool(torch.isfinite(entropy).all())
    # NaN and +inf make the position's log Z non-finite: NaN. -inf in a few entries is an
    # ordinary (zero-probability) logit: the log-prob stays finite unless the token is one.
    assert bool(logp[0, 0].isnan()) and bool(logp[1, 0].isnan())
    bad = torch.zeros_like(batch.response_mask)
    bad[0, 0] = bad[1, 0] = True
    assert bool(torch.isfinite(logp[~bad]).all())
    # The loss drops the NaN tokens with where(); what reaches the weights must be finite.
    torch.where(bad, 0.0, logp).sum().backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and bool(torch.isfinite(parameter.grad).all()), name
