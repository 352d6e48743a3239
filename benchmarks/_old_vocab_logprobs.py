"""The learner's log-prob head as it was at commit 775c7f6 (services/learner/vocab_logprobs.py),
kept only so that benchmarks/bench_logprob_head.py can measure it against the fused head that
replaced it. Not imported by the service. Its docstring then:

log pi(y) and the entropy of response positions without ever holding [N, V] float32 logits.

The head's logits of a 152k-word vocabulary in float32 are 0.6 MB per position: at the learner's
micro-batch sizes they, their softmax and their gradient were most of the step's GPU time and
memory. `vocab_chunked_logprobs` walks the positions in chunks of `position_chunk` and, within a
chunk, the vocabulary in blocks of `vocab_chunk`, keeping an online log-sum-exp (running max m,
running sum of exponentials s, and for the entropy the running sum of e^(l - m) (l - m)), so the
largest float32 block is position_chunk x vocab_chunk:

    log Z = m + log s,   logp = l[y] - log Z,   entropy = log s - (sum_v e^(l_v - m) (l_v - m)) / s

with l = head(h) / temperature in float32 (the matrix product runs in the compute dtype, as
under autocast). Only log Z [N] is saved for the backward, which recomputes each block's logits
and forms d logp / d l = onehot(y) - softmax(l) block by block. Entropy is a metric (no loss
term reads it), so it is computed in the same pass without a gradient. No step of either pass
depends on a tensor's value: nothing waits on the device.

A position whose logits hold NaN or +inf gets log-prob NaN and a gradient of exactly 0 (the
rest of the batch is untouched): the loss then masks and counts it (docs/numerics.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    """The dtype the head's matrix product runs in: autocast's where it is on, else the
    hidden states' (FSDP2 hands the head its compute-dtype weights)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _block_logits(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, accumulate: torch.dtype
) -> Tensor:
    """[c, vc] logits of one block in the accumulation dtype, divided by the temperature."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    return logits.to(accumulate) / temperature


def _target_in_block(targets: Tensor, start: int, size: int) -> tuple[Tensor, Tensor]:
    """(the targets' column in the block, clamped into it; whether the target is there)."""
    local = targets - start
    inside = (local >= 0) & (local < size)
    return local.clamp(0, size - 1).unsqueeze(-1), inside


class _VocabChunkedLogProbs(torch.autograd.Function):
    """(logp [N], entropy [N]) of `vocab_chunked_logprobs`; entropy carries no gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        position_chunk: int,
        vocab_chunk: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        dtype = _compute_dtype(hidden)
        accumulate = torch.promote_types(dtype, torch.float32)
        vocab = weight.shape[0]
        count = hidden.shape[0]
        log_z = torch.empty(count, dtype=accumulate, device=hidden.device)
        chosen = torch.empty_like(log_z)
        entropy = torch.zeros_like(log_z)
        # The casts run once, not once per block; autocast is off below so that nothing is
        # cast twice (the backward, which autocast does not cover, casts the same way).
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, count, position_chunk):
                end = min(start + position_chunk, count)
                h = hidden[start:end].to(dtype)
                t = targets[start:end]
                rows = end - start
                running_max = torch.full((rows,), -torch.inf, dtype=accumulate, device=h.device)
                running_sum = torch.zeros_like(running_max)
                running_dot = torch.zeros_like(running_max)
                picked = torch.zeros_like(running_max)
                for v_start in range(0, vocab, vocab_chunk):
                    v_end = min(v_start + vocab_chunk, vocab)
                    block_bias = None if b is None else b[v_start:v_end]
                    logits = _block_logits(h, w[v_start:v_end], block_bias, temperature, accumulate)
                    new_max = torch.maximum(running_max, logits.amax(-1))
                    # exp(-inf - -inf) is NaN: a row still at -inf contributes nothing yet.
                    rescale = torch.where(
                        torch.isneginf(new_max), 0.0, torch.exp(running_max - new_max)
                    )
                    weights = torch.exp(logits - new_max.unsqueeze(-1))
                    if with_entropy:
                        # sum e^(l - m) (l - m), kept relative to the running max so that the
                        # entropy is not a difference of two large numbers; moving the max from
                        # m to m' shifts every earlier term by m - m'. A -inf logit adds 0.
                        shift = torch.where(running_sum > 0, running_max - new_max, 0.0)
                        centred = torch.where(
                            weights > 0, weights * (logits - new_max.unsqueeze(-1)), 0.0
                        )
                        running_dot = (running_dot + shift * running_sum) * rescale
                        running_dot = running_dot + centred.sum(-1)
                    running_sum = running_sum * rescale + weights.sum(-1)
                    running_max = new_max
                    column, inside = _target_in_block(t, v_start, v_end - v_start)
                    picked = torch.where(inside, logits.gather(-1, column).squeeze(-1), picked)
                log_z[start:end] = running_max + running_sum.log()
                chosen[start:end] = picked
                if with_entropy:
                    entropy[start:end] = running_sum.log() - running_dot / running_sum
        # log Z is NaN or +inf exactly when a logit of the position is NaN or +inf.
        bad = ~torch.isfinite(log_z)
        logp = torch.where(bad, torch.nan, chosen - log_z)
        entropy = torch.where(bad, torch.nan, entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, log_z)
        ctx.settings = (temperature, position_chunk, vocab_chunk, dtype, accumulate)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor, _grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, log_z = ctx.saved_tensors
        temperature, position_chunk, vocab_chunk, dtype, accumulate = ctx.settings
        vocab = weight.shape[0]
        # A non-finite position passes no gradient (its log-prob is NaN and masked).
        grad = torch.where(torch.isfinite(log_z), grad_logp.to(accumulate), 0.0)
        safe_log_z = torch.where(torch.isfinite(log_z), log_z, 0.0)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_bias = bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        # In the weight's own dtype, as autograd would accumulate it: a float32 copy of a
        # bfloat16 head's gradient would add V x H x 4 bytes at the step's peak.
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], position_chunk):
                end = min(start + position_chunk, hidden.shape[0])
                # A non-finite state (which made its logits so) must not meet a zero gradient
                # in the weight's product: 0 x NaN is NaN.
                finite = torch.isfinite(log_z[start:end]).unsqueeze(-1)
                h = torch.where(finite, hidden[start:end], 0.0).to(dtype)
                g = grad[start:end]
                h_grad = torch.zeros(
                    (end - start, hidden.shape[1]), dtype=accumulate, device=h.device
                )
                for v_start in range(0, vocab, vocab_chunk):
                    v_end = min(v_start + vocab_chunk, vocab)
                    block_bias = None if b is None else b[v_start:v_end]
                    logits = _block_logits(h, w[v_start:v_end], block_bias, temperature, accumulate)
                    probs = torch.exp(logits - safe_log_z[start:end].unsqueeze(-1))
                    # d logp / d l = onehot(y) - softmax(l); d l / d (h W^T) = 1 / temperature.
                    grad_logits = torch.nan_to_num(-probs * g.unsqueeze(-1), nan=0.0)
                    column, inside = _target_in_block(targets[start:end], v_start, v_end - v_start)
                    grad_logits.scatter_add_(-1, column, torch.where(inside, g, 0.0).unsqueeze(-1))
                    grad_logits = (grad_logits / temperature).to(dtype)
                    if need_hidden:
                        h_grad += (grad_logits @ w[v_start:v_end]).to(accumulate)
                    if grad_weight is not None:
                        grad_weight[v_start:v_end] += (grad_logits.t() @ h).to(weight.dtype)
                    if grad_bias is not None:
                        grad_bias[v_start:v_end] += grad_logits.sum(0).to(grad_bias.dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = h_grad.to(hidden.dtype)
        return (
            grad_hidden,
            grad_weight,
            grad_bias,
            None,
            None,
            None,
            None,
            None,
        )


def vocab_chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    position_chunk: int,
    vocab_chunk: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor]:
    """logp [N] (differentiable in `hidden`, `weight`, `bias`) and entropy [N] (detached; zeros
    unless `with_entropy`) of the targets [N] under the head `weight` [V, H] (+ `bias` [V]) at
    `temperature`, from hidden states [N, H]; float32 (float64 for float64 inputs). NaN where
    the position's logits are not finite. See the module docstring."""
    if position_chunk < 1 or vocab_chunk < 1:
        raise ValueError(
            f"position_chunk and vocab_chunk must be >= 1, got {position_chunk}, {vocab_chunk}"
        )
    logp, entropy = _VocabChunkedLogProbs.apply(  # type: ignore[no-untyped-call]
        hidden, weight, bias, targets, temperature, position_chunk, vocab_chunk, with_entropy
    )
    return logp, entropy
