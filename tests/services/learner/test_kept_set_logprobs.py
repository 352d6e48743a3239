"""Truncated sampling replayed: the head's log-probs over each position's kept set (`kept`), the
renormalised distribution top-k / top-p / min-p sampled from, against a dense float64 reference
(the full logits, -inf outside the set, log_softmax, gather): values and the gradients of the
hidden states, the head weight and its bias, with sets that straddle many vocabulary blocks.

The entropy stays the full vocabulary's; a taken token outside its set is a non-finite position
(log-prob and entropy NaN, no gradient).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from services.learner import vocab_logprobs
from services.learner.batch import collate
from services.learner.logprobs import ResponseLogProbs, chunk_logprobs
from services.learner.vocab_kernels import LogprobKernel
from services.learner.vocab_logprobs import vocab_chunked_logprobs
from tests.services.generation.tiny_model import build_model, build_tokenizer
from tests.services.learner.conftest import sample_groups
from tests.services.learner.test_vocab_logprobs import LargestTensor, old_path

VOCAB, HIDDEN, POSITIONS = 53, 12, 23  # primes: no block size below divides them
WIDEST = 30  # K: the largest kept set of a batch, apart from the whole vocabulary
# float32 against the float64 reference; float64 against it.
TOLERANCES = {torch.float32: 1e-5, torch.float64: 1e-12}
# The backward's two ways (`GATHER_RATIO`): the kept ids' rows gathered (the way of a real
# vocabulary's small sets; 0 makes every set small enough), or every block multiplied (sets
# near the vocabulary's size, as here: a ratio no set reaches).
BACKWARDS = {"gathered": 0, "blocked": 10**9}


@pytest.fixture(params=list(BACKWARDS))
def backward(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(vocab_logprobs, "GATHER_RATIO", BACKWARDS[request.param])
    return str(request.param)


def kept_sets(targets_from: torch.Generator, count: int = POSITIONS) -> tuple[Tensor, Tensor]:
    """(kept [count, VOCAB] int64 padded with -1, targets [count] in their sets): sizes 1, the
    whole vocabulary and between; padding before, between and after the ids; one set with an
    id twice. Each size >= 2 spans several blocks of 7."""
    kept = torch.full((count, VOCAB), -1, dtype=torch.long)
    targets = torch.empty(count, dtype=torch.long)
    sizes = [1, VOCAB, 2, 9, WIDEST, 5, 1, 17]
    for row in range(count):
        size = sizes[row % len(sizes)]
        ids = torch.randperm(VOCAB, generator=targets_from)[:size]
        slots = torch.randperm(VOCAB, generator=targets_from)[:size]  # padding anywhere
        kept[row, slots] = ids
        targets[row] = ids[torch.randint(size, (), generator=targets_from)]
    kept[5, 0], kept[5, 1] = kept[5, 2].clamp_min(0), kept[5, 2].clamp_min(0)  # an id twice
    return kept, targets


def head(bias: bool, dtype: torch.dtype, seed: int = 0) -> tuple[list[Tensor], Tensor, Tensor]:
    """([hidden, weight, bias?] requiring grad, kept sets, targets): one bias at -inf, never a
    target's (a kept id of probability 0)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(POSITIONS, HIDDEN, generator=generator, dtype=dtype)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=dtype) * 0.5
    tensors = [hidden, weight]
    kept, targets = kept_sets(generator)
    if bias:
        bias_t = torch.randn(VOCAB, generator=generator, dtype=dtype)
        spare = int(torch.isin(torch.arange(VOCAB), targets, invert=True).nonzero()[0])
        bias_t[spare] = -torch.inf
        tensors.append(bias_t)
    return [t.requires_grad_() for t in tensors], kept, targets


def restricted_reference(
    tensors: list[Tensor], kept: Tensor, targets: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """(logp, full-vocabulary entropy) in float64 from the whole [N, V] logits: -inf outside
    each kept set, log_softmax, gather."""
    hidden, weight, *rest = (t.double() for t in tensors)
    logits = torch.nn.functional.linear(hidden, weight, rest[0] if rest else None) / temperature
    member = torch.zeros(logits.shape, dtype=torch.bool)
    for row in range(kept.shape[0]):
        member[row, kept[row][kept[row] >= 0]] = True
    restricted = torch.where(member, logits, -torch.inf).log_softmax(-1)
    logp = restricted.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    full = logits.log_softmax(-1)
    entropy = -(full.exp() * torch.where(full.isneginf(), 0.0, full)).sum(-1)
    return logp, entropy.detach()


def replay(
    tensors: list[Tensor],
    targets: Tensor,
    temperature: float,
    position_chunk: int,
    vocab_chunk: int,
    with_entropy: bool,
    kept: Tensor | None,
    kernel: LogprobKernel = "torch",
) -> tuple[Tensor, Tensor]:
    """`vocab_chunked_logprobs` of the head [hidden, weight, bias?] (eager unless `kernel`)."""
    hidden, weight, *rest = tensors
    return vocab_chunked_logprobs(
        hidden, weight, rest[0] if rest else None, targets, temperature,
        position_chunk, vocab_chunk, with_entropy, kernel, kept,
    )  # fmt: skip


def loss_weights(count: int = POSITIONS) -> Tensor:
    return torch.randn(count, generator=torch.Generator().manual_seed(9), dtype=torch.float64)


def gradients(logp: Tensor, tensors: list[Tensor]) -> list[Tensor]:
    weights = loss_weights(logp.shape[0]).to(logp.dtype)
    return list(torch.autograd.grad(torch.where(logp.isnan(), 0.0, logp * weights).sum(), tensors))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("position_chunk", "vocab_chunk"), [(4, 7), (23, 53), (10, 1)])
def test_values_and_gradients_equal_the_dense_restricted_reference(
    dtype: torch.dtype,
    temperature: float,
    bias: bool,
    position_chunk: int,
    vocab_chunk: int,
    backward: str,
) -> None:
    tensors, kept, targets = head(bias, dtype)
    want_logp, want_entropy = restricted_reference(tensors, kept, targets, temperature)
    want = gradients(want_logp, tensors)
    logp, entropy = replay(tensors, targets, temperature, position_chunk, vocab_chunk, True, kept)
    got = gradients(logp, tensors)
    tolerance = TOLERANCES[dtype]
    assert logp.dtype == dtype and not entropy.requires_grad
    torch.testing.assert_close(logp.double(), want_logp, rtol=0, atol=tolerance)
    # The entropy is the full vocabulary's, whatever the sets.
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=0, atol=tolerance)
    for name, grad, expected in zip(("hidden", "weight", "bias"), got, want, strict=False):
        torch.testing.assert_close(grad, expected, rtol=0, atol=tolerance, msg=name)
    single = (kept >= 0).sum(-1) == 1
    # One kept token: log-prob 0 (up to the rounding of the taken logit's own dot product
    # against the product's) and a gradient of exactly 0, onehot(y) - onehot(y).
    assert bool((logp[single].abs() <= tolerance).all())
    assert bool((got[0][single] == 0).all())


@pytest.mark.parametrize("with_entropy", [True, False])
def test_a_set_of_the_whole_vocabulary_is_no_set(with_entropy: bool, backward: str) -> None:
    tensors, _, targets = head(True, torch.float32)
    everything = torch.arange(VOCAB).repeat(POSITIONS, 1)
    results = []
    for kept in (None, everything):
        logp, entropy = replay(tensors, targets, 0.8, 5, 7, with_entropy, kept)
        results.append((logp, entropy, gradients(logp, tensors)))
    (logp, entropy, got), (full_logp, full_entropy, want) = results
    torch.testing.assert_close(logp, full_logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, full_entropy, rtol=0, atol=1e-6)
    # The gradients come from the kept ids' gathered rows, not the blocks' products: the same
    # sums in another order, so float32 rounding of their size (about 1e-6 relative).
    for grad, expected in zip(got, want, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


def sampler_sets(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """The kept ids [N, top_k] of top-k then top-p (the smallest prefix of the sorted top-k
    whose renormalised mass reaches top_p), -1 padded, as a sampler truncates."""
    values, ids = logits.topk(top_k, -1)
    probs = values.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass of the higher-ranked ids
    return torch.where(before < top_p, ids, -1)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (40, 0.9), (53, 0.5)])
def test_the_replayed_ratio_of_the_sampling_weights_is_one(top_k: int, top_p: float) -> None:
    """With the weights that sampled, exp(replayed logp - behaviour logp) is 1: the behaviour
    log-prob taken as the sampler takes it (float32 logits at the temperature, log_softmax over
    the kept set); over the full vocabulary it would be the kept mass, below 1."""
    (hidden, weight, bias), _, _ = head(True, torch.float32, seed=4)
    temperature = 0.7
    with torch.no_grad():
        logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
        kept = sampler_sets(logits, top_k, top_p)
        restricted = torch.where(kept >= 0, logits.gather(-1, kept.clamp_min(0)), -torch.inf)
        # Each position's token drawn from its kept set.
        sampler = torch.Generator().manual_seed(5)
        draw = torch.multinomial(restricted.softmax(-1), 1, generator=sampler)
        targets = kept.gather(-1, draw).squeeze(-1)
        behaviour = restricted.log_softmax(-1).gather(-1, draw).squeeze(-1)
    replayed, _ = vocab_chunked_logprobs(
        hidden, weight, bias, targets, temperature, 8, 7, False, "torch", kept
    )
    full, _ = vocab_chunked_logprobs(hidden, weight, bias, targets, temperature, 8, 7, False)
    ratio = torch.exp(replayed.detach() - behaviour)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)
    if top_k < VOCAB or top_p < 1.0:
        assert bool((torch.exp(full.detach() - behaviour) < 1 - 1e-4).any())


def test_a_taken_token_outside_its_set_is_a_nonfinite_position() -> None:
    """Its log-prob would be -inf: it is NaN, entropy NaN, no gradient, as a position with a
    non-finite logit (the loss drops and counts it); an empty set is the same. The rest of the
    batch is untouched."""
    tensors, kept, targets = head(True, torch.float32)
    outside = torch.zeros(POSITIONS, dtype=torch.bool)
    outside[[2, 11]] = True
    kept[2] = torch.where(kept[2] == targets[2], -1, kept[2])  # the taken id struck out
    kept[11] = -1  # nothing kept
    assert not bool((kept[outside] == targets[outside].unsqueeze(-1)).any())
    impossible, _ = restricted_reference(tensors, kept, targets, 1.0)
    assert not bool(torch.isfinite(impossible[outside]).any())  # -inf, or NaN for no set
    # The reference of the rest, the dropped rows' sets made whole (no NaN in its backward).
    whole = torch.where(outside.unsqueeze(-1), torch.arange(VOCAB), kept)
    want_logp, want_entropy = restricted_reference(tensors, whole, targets, 1.0)
    want = gradients(torch.where(outside, torch.nan, want_logp), tensors)
    logp, entropy = replay(tensors, targets, 1.0, 4, 7, True, kept)
    got = gradients(logp, tensors)
    assert bool(logp[outside].isnan().all()) and bool(entropy[outside].isnan().all())
    torch.testing.assert_close(logp[~outside].double(), want_logp[~outside], rtol=0, atol=1e-5)
    torch.testing.assert_close(
        entropy[~outside].double(), want_entropy[~outside], rtol=0, atol=1e-5
    )
    assert bool((got[0][outside] == 0).all())
    for grad, expected in zip(got, want, strict=True):
        torch.testing.assert_close(grad, expected, rtol=0, atol=1e-5)


def test_nonfinite_logits_are_caught_inside_and_outside_the_sets() -> None:
    """A NaN state makes its position NaN; a +inf logit at an id no set keeps makes every
    position non-finite, as without sets (the mask must not hide it). Gradients stay finite."""
    (hidden, weight, bias), kept, targets = head(True, torch.float32)
    poison = torch.zeros_like(hidden)
    poison[3, 0] = torch.nan
    logp, _ = vocab_chunked_logprobs(
        hidden + poison, weight, bias, targets, 1.0, 4, 7, True, "torch", kept
    )
    assert bool(logp[3].isnan()) and int(logp.isnan().sum()) == 1
    grads = gradients(logp, [hidden, weight, bias])
    assert all(bool(torch.isfinite(grad).all()) for grad in grads)
    assert bool((grads[0][3] == 0).all())
    # An id no target is, struck out of every set (the whole vocabulary's too).
    unkept = int(torch.isin(torch.arange(VOCAB), targets, invert=True).nonzero()[0])
    narrow = torch.where(kept == unkept, -1, kept)
    infinite = bias.detach().clone()
    infinite[unkept] = torch.inf
    infinite.requires_grad_()
    logp, entropy = vocab_chunked_logprobs(
        hidden, weight, infinite, targets, 1.0, 4, 7, True, "torch", narrow
    )
    assert bool(logp.isnan().all()) and bool(entropy.isnan().all())
    grads = gradients(logp, [hidden, weight, infinite])
    assert all(bool((grad == 0).all()) for grad in grads)


def test_bfloat16_products_give_the_restricted_log_probs_of_their_rounded_logits() -> None:
    """bfloat16 products rounded, then float32 at the temperature (as the sampler reads them):
    the kept set's log-probs of those logits, at most 0; the hidden states' gradient in
    bfloat16, finite."""
    (hidden, weight), kept, targets = head(False, torch.float32)
    h, w = hidden.detach().bfloat16(), weight.detach().bfloat16()
    logits = (h @ w.t()).float() / 0.7
    member = torch.zeros(logits.shape, dtype=torch.bool)
    for row in range(POSITIONS):
        member[row, kept[row][kept[row] >= 0]] = True
    want = torch.where(member, logits, -torch.inf).log_softmax(-1)
    want = want.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    h.requires_grad_()
    logp, entropy = vocab_chunked_logprobs(h, w, None, targets, 0.7, 4, 7, True, "torch", kept)
    assert logp.dtype == torch.float32 and bool((logp <= 1e-6).all())
    torch.testing.assert_close(logp.detach(), want, rtol=0, atol=1e-4)
    full = logits.log_softmax(-1)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1), rtol=0, atol=1e-4)
    (grad,) = torch.autograd.grad(logp.sum(), [h])
    assert grad.dtype == torch.bfloat16 and bool(torch.isfinite(grad).all())


def test_no_pass_holds_more_than_a_block_of_logits_and_its_membership() -> None:
    """Forward (with entropy) and backward: nothing larger than a block [4, 7 + 1] (its
    membership mask has a spare column), the head [V, H], the states [N, H] or the sets [N, K];
    one projection of every position would be [N, V] = 23 x 53."""
    (hidden, weight, bias), kept, targets = head(True, torch.float32)
    kept = kept[:, :WIDEST]  # K < V: a [N, K] tensor is no [N, V] one (some targets cut off)
    with LargestTensor() as seen:
        logp, _ = vocab_chunked_logprobs(
            hidden, weight, bias, targets, 1.0, 4, 7, True, "torch", kept
        )
        torch.autograd.grad(logp.nan_to_num().sum(), [hidden, weight, bias])
    allowed = max(4 * 8, VOCAB * HIDDEN, POSITIONS * HIDDEN, POSITIONS * WIDEST)
    assert seen.largest[0] <= allowed, seen.largest


def test_the_dense_head_path_replays_the_same_sets() -> None:
    """`chunk_logprobs` (the head-module path) with the same kept sets: the same values,
    entropy and gradients, NaN at the same taken-outside positions (whose entropy is not read:
    that path's is the uniform one of the zeros its dropped rows are given)."""
    (hidden, weight, bias), kept, targets = head(True, torch.float32)
    kept[7] = torch.where(kept[7] == targets[7], -1, kept[7])
    kept[8] = -1  # an empty set: no row of the dense path may be all -inf
    linear = torch.nn.Linear(HIDDEN, VOCAB)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    params = [hidden, linear.weight, linear.bias]
    logp, entropy = chunk_logprobs(hidden, linear, targets, 0.9, True, kept)
    got = gradients(logp, params)
    want_logp, want_entropy = vocab_chunked_logprobs(
        hidden, weight, bias, targets, 0.9, 4, 7, True, "torch", kept
    )
    want = gradients(want_logp, [hidden, weight, bias])
    assert bool(logp[[7, 8]].isnan().all()) and int(logp.isnan().sum()) == 2
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5, equal_nan=True)
    kept_rows = ~logp.isnan()
    torch.testing.assert_close(entropy[kept_rows], want_entropy[kept_rows], rtol=0, atol=1e-5)
    for grad, expected in zip(got, want, strict=True):
        assert bool(torch.isfinite(grad).all())
        torch.testing.assert_close(grad, expected, rtol=0, atol=1e-5)


def test_kept_must_be_int64_one_row_per_target() -> None:
    (hidden, weight), kept, targets = head(False, torch.float32)
    for bad in (kept[:-1], kept.int(), kept[0]):
        with pytest.raises(ValueError, match="kept must be int64"):
            vocab_chunked_logprobs(hidden, weight, None, targets, 1.0, 4, 7, False, kept=bad)


def test_the_response_model_replays_kept_sets_on_both_head_paths(tmp_path: Path) -> None:
    """`ResponseLogProbs(batch, ..., kept=[B, T, K])`: the chunked linear head and the head-module
    path agree, masked tokens stay 0, and a set of the whole vocabulary is no set."""
    tokenizer = build_tokenizer()
    build_model(tokenizer, tied=True).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    policy = AutoModelForCausalLM.from_pretrained(tmp_path)
    batch = collate(sample_groups(tmp_path), 0, learner_version=0)
    mask = batch.response_mask.clone()
    mask[0, 1::2] = False
    batch = replace(batch, response_mask=mask)
    vocab = policy.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    kept = torch.randint(-1, vocab, (*batch.response_ids.shape, 6), generator=generator)
    kept[..., 0] = batch.response_ids  # every taken token kept
    results = []
    for model in (
        ResponseLogProbs(policy, 5, vocab_chunk=7),
        old_path(ResponseLogProbs(policy, 5)),
    ):
        logp, entropy = model(batch, 0.7, with_entropy=True, kept=kept)
        logp.sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        policy.zero_grad(set_to_none=True)
        results.append((logp, entropy, grads))
    (logp, entropy, grads), (old_logp, old_entropy, old_grads) = results
    assert bool((logp[~mask] == 0).all()) and bool(torch.isfinite(logp).all())
    torch.testing.assert_close(logp, old_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, old_entropy, rtol=0, atol=1e-5)
    assert grads.keys() == old_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, old_grads[name], rtol=0, atol=1e-5, msg=name)
    everything = torch.arange(vocab).expand(*batch.response_ids.shape, vocab)
    model = ResponseLogProbs(policy, 5, vocab_chunk=7)
    with torch.no_grad():
        whole, _ = model(batch, 0.7, with_entropy=False, kept=everything)
        full, _ = model(batch, 0.7, with_entropy=False)
    torch.testing.assert_close(whole, full, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs g++")
def test_the_compiled_kept_kernels_equal_the_eager_ones() -> None:
    """The functions CUDA's auto compiles, on CPU (inductor's C++ backend); one block shape
    (the whole vocabulary, one chunk) so that each compiles once."""
    tensors, kept, targets = head(True, torch.float32)
    results = []
    kernels: tuple[LogprobKernel, ...] = ("torch", "compiled")
    for kernel in kernels:
        logp, entropy = replay(tensors, targets, 0.8, POSITIONS, VOCAB, True, kept, kernel)
        results.append((logp, entropy, gradients(logp, tensors)))
    (logp, entropy, got), (c_logp, c_entropy, c_got) = results
    torch.testing.assert_close(c_logp, logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(c_entropy, entropy, rtol=0, atol=1e-5)
    for grad, expected in zip(c_got, got, strict=True):
        torch.testing.assert_close(grad, expected, rtol=0, atol=1e-5)
