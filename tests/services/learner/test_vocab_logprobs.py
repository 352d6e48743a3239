"""The head's log-probs and entropy chunked over positions and vocabulary (a log-sum-exp per block)
against the per-position-chunk path it replaced (`chunk_logprobs`: [n, V] logits at once), in
float32: values and gradients of the hidden states, the head weight and its bias, within 1e-5.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from services.learner.batch import collate
from services.learner.logprobs import ResponseLogProbs, chunk_logprobs
from services.learner.vocab_logprobs import vocab_chunked_logprobs
from tests.services.generation.tiny_model import build_model, build_tokenizer
from tests.services.learner.conftest import sample_groups

TOLERANCE = 1e-5
VOCAB, HIDDEN, POSITIONS = 509, 48, 67  # primes: no chunk size below divides them


def head_inputs(bias: bool, seed: int = 0) -> tuple[nn.Linear, Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    head = nn.Linear(HIDDEN, VOCAB, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator) * 0.3)
        if bias:
            head.bias.copy_(torch.randn(VOCAB, generator=generator))
            head.bias[7] = -torch.inf  # a token of probability 0: an ordinary logit
    hidden = torch.randn(POSITIONS, HIDDEN, generator=generator, requires_grad=True)
    targets = torch.randint(0, VOCAB, (POSITIONS,), generator=generator)
    targets[targets == 7] = 8
    weights = torch.randn(POSITIONS, generator=generator)
    return head, hidden, targets, weights


def grads_of(*tensors: Tensor) -> list[Tensor]:
    out = []
    for tensor in tensors:
        assert tensor.grad is not None
        out.append(tensor.grad.clone())
        tensor.grad = None
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
# Down to one-entry vocabulary blocks (509 steps of the online sum).
@pytest.mark.parametrize(
    ("position_chunk", "vocab_chunk"), [(1, 509), (7, 100), (64, 33), (500, 1)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_equal_the_unchunked_vocabulary(
    temperature: float, position_chunk: int, vocab_chunk: int, bias: bool
) -> None:
    head, hidden, targets, weights = head_inputs(bias)
    params = [hidden, head.weight] + ([head.bias] if bias else [])
    logp, entropy = chunk_logprobs(hidden, head, targets, temperature, with_entropy=True)
    (logp * weights).sum().backward()
    expected = grads_of(*params)
    new_logp, new_entropy = vocab_chunked_logprobs(
        hidden, head.weight, head.bias, targets, temperature, position_chunk, vocab_chunk, True
    )
    assert new_logp.dtype == torch.float32 and not new_entropy.requires_grad
    (new_logp * weights).sum().backward()
    got = grads_of(*params)
    torch.testing.assert_close(new_logp, logp, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(new_entropy, entropy, rtol=0, atol=TOLERANCE)
    for name, grad, want in zip(("hidden", "weight", "bias"), got, expected, strict=False):
        torch.testing.assert_close(grad, want, rtol=0, atol=TOLERANCE, msg=name)


def test_entropy_is_left_out_unless_asked() -> None:
    head, hidden, targets, _ = head_inputs(False)
    _, entropy = vocab_chunked_logprobs(
        hidden, head.weight, None, targets, 1.0, 16, 128, with_entropy=False
    )
    assert bool((entropy == 0).all())


def test_a_nonfinite_state_gives_nan_there_and_no_gradient_to_the_rest() -> None:
    head, hidden, targets, weights = head_inputs(True)
    poison = torch.zeros_like(hidden)
    poison[3, 0], poison[40, 5] = torch.nan, torch.inf
    logp, _ = vocab_chunked_logprobs(
        hidden + poison, head.weight, head.bias, targets, 1.0, 16, 100, True
    )
    bad = torch.zeros(POSITIONS, dtype=torch.bool)
    bad[[3, 40]] = True
    assert bool(logp[bad].isnan().all()) and bool(torch.isfinite(logp[~bad]).all())
    torch.where(bad, 0.0, logp * weights).sum().backward()
    grad_hidden, grad_weight, grad_bias = grads_of(hidden, head.weight, head.bias)
    assert bool(torch.isfinite(grad_weight).all()) and bool(torch.isfinite(grad_bias).all())
    assert bool((grad_hidden[bad] == 0).all()) and bool(torch.isfinite(grad_hidden).all())


class LargestTensor(TorchDispatchMode):
    """The most elements any operation's output had, and that output's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: tuple[int, tuple[int, ...]] = (0, ())

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, Tensor) and tensor.numel() > self.largest[0]:
                self.largest = (tensor.numel(), tuple(tensor.shape))
        return out


def test_no_pass_holds_more_than_one_block_of_logits() -> None:
    """Forward and backward: nothing larger than a block of logits [16, 100], the head weight
    (and its gradient) [V, H], or the hidden states [N, H]. One projection of every position
    would be [N, V] = 67 x 509."""
    head, hidden, targets, weights = head_inputs(False)
    with LargestTensor() as seen:
        logp, _ = vocab_chunked_logprobs(hidden, head.weight, None, targets, 1.0, 16, 100, True)
        (logp * weights).sum().backward()
    allowed = max(16 * 100, VOCAB * HIDDEN, POSITIONS * HIDDEN)
    assert seen.largest[0] <= allowed, seen.largest
    with LargestTensor() as unchunked:
        chunk_logprobs(hidden, head, targets, 1.0, with_entropy=False)
    assert unchunked.largest[0] == POSITIONS * VOCAB  # the check can see [N, V]


def old_path(model: ResponseLogProbs) -> ResponseLogProbs:
    """The same model through `chunk_logprobs` (the head behind a module that is not a plain
    linear layer takes that path)."""

    class Head(nn.Module):
        def __init__(self, linear: nn.Module) -> None:
            super().__init__()
            self.linear = linear

        def forward(self, hidden: Tensor) -> Tensor:
            out: Tensor = self.linear(hidden)
            return out

    wrapped = ResponseLogProbs(model.policy, model.chunk_tokens)
    original = model.policy.get_output_embeddings()  # type: ignore[operator]
    wrapped.policy.get_output_embeddings = lambda: Head(original)  # type: ignore[method-assign]
    return wrapped


def test_a_tied_head_with_masked_tokens_gets_the_gradients_of_the_old_path(
    tmp_path: Path,
) -> None:
    tokenizer = build_tokenizer()
    build_model(tokenizer, tied=True).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    policy = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert policy.lm_head.weight is policy.model.embed_tokens.weight
    batch = collate(sample_groups(tmp_path), 0, learner_version=0)
    mask = batch.response_mask.clone()
    mask[0, 1::2] = False  # every other token of a row masked
    batch = replace(batch, response_mask=mask)
    results = []
    for model in (
        ResponseLogProbs(policy, 5, vocab_chunk=7),
        old_path(ResponseLogProbs(policy, 5)),
    ):
        logp, entropy = model(batch, 0.7, with_entropy=True)
        logp.sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        policy.zero_grad(set_to_none=True)
        results.append((logp, entropy, grads))
    (logp, entropy, grads), (old_logp, old_entropy, old_grads) = results
    assert bool((logp[~mask] == 0).all())
    torch.testing.assert_close(logp, old_logp, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(entropy, old_entropy, rtol=0, atol=TOLERANCE)
    assert grads.keys() == old_grads.keys() and "model.embed_tokens.weight" in grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, old_grads[name], rtol=0, atol=TOLERANCE, msg=name)
