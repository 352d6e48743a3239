"""log pi(y) and the entropy of response positions without ever holding [N, V] float32 logits.

The head's logits of a 152k-word vocabulary in float32 are 0.6 MB per position: at the learner's
micro-batch sizes they, their softmax and their gradient were most of the step's GPU time and
memory. `vocab_chunked_logprobs` walks the positions in chunks of `position_chunk` and, within a
chunk, the vocabulary in blocks of `vocab_chunk`, so the largest float32 block is
position_chunk x vocab_chunk. Per block b and position, from one softmax p_b of its logits l
(services/learner/vocab_kernels.py), the block's log-sum-exp lse_b = max l - log max p_b and,
for the entropy, the block's own H_b = lse_b - sum p_b l; after the last block, with shares
s_b = e^(lse_b - log Z) of the probability mass,

    log Z = logsumexp_b lse_b,   logp = l[y] - log Z,
    entropy = sum_b s_b H_b - sum_b s_b log s_b

with l = head(h) / temperature in float32 (the matrix product runs in the compute dtype, as
under autocast; in float32 the temperature is folded into its operands, which saves a pass).
The taken token's logit l[y] is one row of the head per position, h . w[y], not a look-up in
every block. log Z [N] and lse_b [N, blocks] are saved for the backward, which recomputes each
block's logits once and uses d logp / d l = onehot(y) - softmax(l), where
softmax(l) = p_b e^(lse_b - log Z): the block enters its two matrix products as p_b, and the
per-position factor -grad e^(lse_b - log Z) scales the small [c, H] operands instead. The
one-hot part is a row of the head per position too. So a block costs one product forward and
three backward, and entropy (a metric: no loss term reads it, so it has no gradient) costs no
product. No step of either pass depends on a tensor's value: nothing waits on the device.

A position whose logits hold NaN or +inf gets log-prob NaN and a gradient of exactly 0 (the
rest of the batch is untouched): the loss then masks and counts it (docs/numerics.md).

Truncated sampling replayed (`kept`): a generator that samples with top-k / top-p / min-p draws
token t from the renormalised kept set S_t, so its behaviour log-prob is over S_t, and one over
the full vocabulary would put log(kept mass) into every importance ratio. Given each position's
S_t (ids [N, K], padded with -1), log Z is the log-sum-exp over S_t only: each block's lse_b is
that of its logits at the kept ids within it (FLOOR where there are none: a share of 0), and
d logp / d l = onehot(y) - the softmax over S_t, 0 outside it. Each block builds its own
[c, vocab_chunk] membership mask from the ids; nothing [N, V] is held. Ids outside [0, V) count
as padding and an id given twice counts once. A taken token outside its set (a record that
contradicts itself: its log-prob would be -inf) is a non-finite position as above: log-prob
NaN, entropy NaN, gradient 0, so the loss drops and counts it. The entropy stays the full
vocabulary's: it is a metric of the policy, read by the dashboard, the entropy-collapse alert
and the guard with thresholds set on full-softmax entropy, while the kept set's is capped at
log |S_t| and is 0 wherever one token is kept (a collapse the sampler makes, not the policy).
It costs a second softmax per block, in the forward and only when the entropy is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from services.learner.vocab_kernels import (
    FLOOR,
    KERNELS,
    BlockStats,
    KeptBlockStats,
    LogprobKernel,
    scaled_logits,
)

# -inf biases are raised to FLOOR (vocab_kernels); a log Z below BAD_LOG_Z means every logit
# was -inf (or, with a kept set, every kept one), which is then NaN, as before.
BAD_LOG_Z = -1e20

# A backward with kept sets of at most V / this many ids gathers the kept ids' rows of the head
# (`_backward_kept_chunk`: K products per position) instead of multiplying every vocabulary
# block: a real vocabulary (32k to 256k ids) against sets of at most 4096, always. Sets nearly as
# large as the vocabulary (a tiny model's) take the blocks, whose large products are cheaper
# than many small gathered ones.
GATHER_RATIO = 8

# The softmax of one block over the logits' product z, given the block's first vocabulary id:
# the full block's, or that over the kept ids in it.
BlockSoftmax = Callable[[Tensor, int], Tensor]


@dataclass(frozen=True)
class _Plan:
    """How one call runs: the products' dtype, the float dtype of everything else, and whether
    the temperature is folded into the products' operands (when both dtypes are the same)."""

    temperature: float
    position_chunk: int
    vocab_chunk: int
    dtype: torch.dtype
    accumulate: torch.dtype
    kernel: LogprobKernel

    @property
    def folded(self) -> bool:
        return self.dtype == self.accumulate

    @property
    def scale(self) -> float:
        """What each product is multiplied by to give logits (1: already in its operands)."""
        return 1.0 if self.folded else 1.0 / self.temperature

    @property
    def operand_scale(self) -> float:
        """What the products' operands carry of 1 / temperature (the gradients of the hidden
        states and the bias are the operands' times this)."""
        return 1.0 / self.temperature if self.folded else 1.0


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    """The dtype the head's matrix product runs in: autocast's where it is on, else the
    hidden states' (FSDP2 hands the head its compute-dtype weights)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _operand(hidden: Tensor, plan: _Plan) -> Tensor:
    """The product's left operand of a chunk: h / temperature when folded, else h."""
    if plan.folded:
        return hidden.to(plan.dtype) / plan.temperature
    return hidden.to(plan.dtype)


def _operand_bias(bias: Tensor | None, plan: _Plan) -> Tensor | None:
    """The product's bias: b / temperature when folded, else b; -inf raised to FLOOR."""
    if bias is None:
        return None
    out = bias.to(plan.dtype) / plan.temperature if plan.folded else bias.to(plan.dtype)
    return out.clamp_min(FLOOR)


def _product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight^T (+ bias): one matrix product, the bias added inside it."""
    if bias is None:
        return x @ weight.t()
    return torch.addmm(bias, x, weight.t())


def _picked(x: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, plan: _Plan) -> Tensor:
    """The taken tokens' logits [c]: x . w[y] (+ b[y]) per position, accumulated in float32 and,
    in a lower compute dtype, rounded to it as the product's output is, so that l[y] is the
    logit the log-sum-exp saw."""
    rows = weight.index_select(0, targets).to(plan.accumulate)
    picked = (x.to(plan.accumulate) * rows).sum(-1)
    if bias is not None:
        picked = picked + bias.index_select(0, targets).to(plan.accumulate)
    if plan.folded:
        return picked
    return picked.to(plan.dtype).to(plan.accumulate) / plan.temperature


def _forward_chunk(
    x: Tensor, weight: Tensor, bias: Tensor | None, plan: _Plan, stats: BlockStats, entropy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(log Z [c], lse_b [c, blocks], entropy [c], zeros unless `entropy`) of one chunk."""
    lses, entropies = [], []  # per block: log-sum-exp, entropy of its own softmax
    for start in range(0, weight.shape[0], plan.vocab_chunk):
        end = start + plan.vocab_chunk
        block_bias = None if bias is None else bias[start:end]
        lse, own = stats(_product(x, weight[start:end], block_bias), plan.scale, entropy)
        lses.append(lse)
        entropies.append(own)
    block_lse = torch.stack(lses, -1)
    log_z = torch.logsumexp(block_lse, -1)
    if not entropy:
        return log_z, block_lse, torch.zeros_like(log_z)
    return log_z, block_lse, _mixture_entropy(block_lse, log_z, torch.stack(entropies, -1))


def _mixture_entropy(block_lse: Tensor, log_z: Tensor, entropies: Tensor) -> Tensor:
    """The entropy [c] of a mixture of the blocks' softmaxes (entropies [c, blocks]) with shares
    e^(lse_b - log Z): the shares' mean entropy plus the entropy of the shares. A position with
    a non-finite logit has NaN here (and NaN shares), and is set NaN by the caller anyway."""
    share = torch.exp(block_lse - log_z.unsqueeze(-1))
    mixture: Tensor = (share * entropies + torch.special.entr(share)).sum(-1)
    return mixture


def kept_mask(kept: Tensor, start: int, width: int) -> Tensor:
    """[c, width] bool: which ids of the block [start, start + width) are in each position's
    kept set (kept [c, K], -1 padded). Padding and the ids of other blocks are scattered into a
    spare last column, dropped; an id given twice is set once."""
    local = kept - start
    slots = torch.where((local >= 0) & (local < width), local, width)
    mask = torch.zeros((kept.shape[0], width + 1), dtype=torch.bool, device=kept.device)
    # A source tensor, not a scalar: torch's scatter of a scalar value takes a slower path.
    return mask.scatter_(1, slots, torch.ones_like(slots, dtype=torch.bool))[:, :width]


def taken_outside(kept: Tensor, targets: Tensor) -> Tensor:
    """[N] bool: the positions whose taken token is not among their kept ids."""
    return ~(kept == targets.unsqueeze(-1)).any(-1)


def _forward_kept_chunk(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    kept: Tensor,
    plan: _Plan,
    stats: KeptBlockStats,
    entropy: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """`_forward_chunk` restricted to the kept sets kept [c, K]: (log Z over each position's
    kept ids [c], each block's part of it [c, blocks], the full vocabulary's entropy [c], zeros
    unless `entropy`)."""
    kept_lses, lses, entropies = [], [], []
    for start in range(0, weight.shape[0], plan.vocab_chunk):
        w = weight[start : start + plan.vocab_chunk]
        block_bias = None if bias is None else bias[start : start + plan.vocab_chunk]
        keep = kept_mask(kept, start, w.shape[0])
        kept_lse, lse, own = stats(_product(x, w, block_bias), keep, plan.scale, entropy)
        kept_lses.append(kept_lse)
        lses.append(lse)
        entropies.append(own)
    block_kept = torch.stack(kept_lses, -1)
    log_z = torch.logsumexp(block_kept, -1)
    if not entropy:
        return log_z, block_kept, torch.zeros_like(log_z)
    block_lse = torch.stack(lses, -1)
    full = _mixture_entropy(block_lse, torch.logsumexp(block_lse, -1), torch.stack(entropies, -1))
    return log_z, block_kept, full


def _backward_chunk(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    coef: Tensor,
    plan: _Plan,
    softmax: BlockSoftmax,
    grads: tuple[Tensor | None, Tensor | None],
) -> Tensor:
    """The softmax part of one chunk's gradients: returns d/dx [c, H] (accumulation dtype) and
    adds into the weight's and bias's gradients (`grads`). coef [c, blocks] is each position's
    -grad e^(lse_b - log Z): the block's softmax (over its kept ids, with a kept set) times it
    is d loss / d logits."""
    grad_weight, grad_bias = grads
    grad_x = torch.zeros(x.shape, dtype=plan.accumulate, device=x.device)
    for index, start in enumerate(range(0, weight.shape[0], plan.vocab_chunk)):
        end = start + plan.vocab_chunk
        w = weight[start:end]
        block_bias = None if bias is None else bias[start:end]
        probs = softmax(_product(x, w, block_bias), start)
        factor = coef[:, index].unsqueeze(-1)
        grad_x.addcmul_(factor, (probs @ w).to(plan.accumulate))
        if grad_weight is not None:
            scaled = (factor * x).to(plan.dtype)
            if grad_weight.dtype == plan.dtype:
                grad_weight[start:end].addmm_(probs.t(), scaled)
            else:
                grad_weight[start:end] += (probs.t() @ scaled).to(grad_weight.dtype)
        if grad_bias is not None:
            column = coef[:, index].to(plan.dtype)
            grad_bias[start:end] += (probs.t() @ column).to(grad_bias.dtype)
    return grad_x


def _one_hot_part(
    x: Tensor, weight: Tensor, targets: Tensor, rate: Tensor, grads: tuple[Tensor | None, ...]
) -> Tensor:
    """The one-hot part of one chunk's gradients, a row of the head per position: returns
    d/dx [c, H] and adds rate x into the taken rows of the weight's gradient, rate into the
    bias's (rate [c]: each position's gradient of logp, in the product's units)."""
    grad_weight, grad_bias = grads
    factor = rate.unsqueeze(-1)
    if grad_weight is not None:
        grad_weight.index_add_(0, targets, (factor * x.to(rate.dtype)).to(grad_weight.dtype))
    if grad_bias is not None:
        grad_bias.index_add_(0, targets, rate.to(grad_bias.dtype))
    return factor * weight.index_select(0, targets).to(rate.dtype)


# The forward statistics (log Z [c], lse_b [c, blocks], entropy [c]) of a chunk of positions:
# its operand x and its rows of the batch.
ChunkForward = Callable[[Tensor, slice], tuple[Tensor, Tensor, Tensor]]


def _chunk_forward(
    weight: Tensor,
    bias: Tensor | None,
    kept: Tensor | None,
    plan: _Plan,
    device: torch.device,
    with_entropy: bool,
) -> ChunkForward:
    """`_forward_chunk`, or with kept sets [N, K] `_forward_kept_chunk` on the chunk's rows, with
    the kernels of the call fetched once."""
    if kept is None:
        stats, _ = KERNELS.get(plan.kernel, device, plan.dtype, plan.scale)
        return lambda x, _rows: _forward_chunk(x, weight, bias, plan, stats, with_entropy)
    kept_stats, _ = KERNELS.get_kept(plan.kernel, device, plan.dtype, plan.scale)
    return lambda x, rows: _forward_kept_chunk(
        x, weight, bias, kept[rows], plan, kept_stats, with_entropy
    )


def _chunk_softmax(
    kept: Tensor | None, plan: _Plan, device: torch.device
) -> Callable[[slice], BlockSoftmax]:
    """For a chunk of positions (its rows of the batch), the softmax of its blocks: the full
    block's, or with kept sets [N, K] that over the chunk's kept ids in the block."""
    if kept is None:
        _, probs = KERNELS.get(plan.kernel, device, plan.dtype, plan.scale)

        def full(z: Tensor, _first: int) -> Tensor:
            return probs(z, plan.scale, plan.accumulate, plan.dtype)

        return lambda _rows: full
    _, kept_probs = KERNELS.get_kept(plan.kernel, device, plan.dtype, plan.scale)

    def restricted(rows: slice) -> BlockSoftmax:
        ids = kept[rows]
        return lambda z, first: kept_probs(
            z, kept_mask(ids, first, z.shape[1]), plan.scale, plan.accumulate, plan.dtype
        )

    return restricted


def _backward_kept_chunk(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    kept: Tensor,
    rate: Tensor,
    plan: _Plan,
    grads: tuple[Tensor | None, Tensor | None],
) -> Tensor:
    """`_backward_chunk` with kept sets kept [c, K]: the softmax over a position's kept ids is 0
    at every other id, so only the head's rows of those ids take part. They are gathered, a few
    positions at a time ([c', K, H] no larger than a [position_chunk, vocab_chunk] block), and
    their logits taken again, where the full softmax multiplies every block of the vocabulary:
    K products per position instead of V. rate [c]: each position's gradient of logp in the
    product's units (0 where it is not finite). An id given twice counts
    once, padding (-1) and ids outside [0, V) not at all, as in `kept_mask`."""
    grad_weight, grad_bias = grads
    grad_x = torch.zeros(x.shape, dtype=plan.accumulate, device=x.device)
    ids, _ = kept.sort(-1)
    repeated = torch.zeros_like(ids, dtype=torch.bool)
    repeated[:, 1:] = ids[:, 1:] == ids[:, :-1]
    valid = (ids >= 0) & (ids < weight.shape[0]) & ~repeated
    ids = torch.where(valid, ids, 0)
    width, hidden = ids.shape[1], x.shape[1]
    block = plan.position_chunk * min(plan.vocab_chunk, weight.shape[0])
    step = max(1, block // max(width * hidden, 1))
    for start in range(0, x.shape[0], step):
        part = slice(start, start + step)
        flat = ids[part].flatten()
        rows = weight.index_select(0, flat).view(-1, width, hidden)  # [c', K, H]
        z = torch.bmm(rows, x[part].unsqueeze(-1)).squeeze(-1)
        if bias is not None:
            z = z + bias.index_select(0, flat).view(z.shape)
        # Normalised over the same gathered logits (not the forward's log Z, whose blocked
        # products round otherwise): the set's softmax sums to 1, and a set of one token is
        # exactly onehot(y), so its gradient is exactly 0.
        logits = torch.where(valid[part], scaled_logits(z, plan.scale, plan.accumulate), -torch.inf)
        probs = torch.where(valid[part], torch.softmax(logits, -1), 0.0)
        factor = -rate[part].unsqueeze(-1) * probs  # d loss / d product at each kept id
        grad_x[part] = (
            torch.bmm(factor.to(plan.dtype).unsqueeze(1), rows).squeeze(1).to(plan.accumulate)
        )
        if grad_weight is not None:
            outer = factor.unsqueeze(-1) * x[part].unsqueeze(1).to(plan.accumulate)
            grad_weight.index_add_(0, flat, outer.flatten(0, 1).to(grad_weight.dtype))
        if grad_bias is not None:
            grad_bias.index_add_(0, flat, factor.flatten().to(grad_bias.dtype))
    return grad_x


class _VocabChunkedLogProbs(torch.autograd.Function):
    """(logp [N], entropy [N]) of `vocab_chunked_logprobs`; entropy carries no gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        plan: _Plan,
        with_entropy: bool,
        kept: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        count = hidden.shape[0]
        blocks = -(-weight.shape[0] // plan.vocab_chunk)
        log_z = torch.empty(count, dtype=plan.accumulate, device=hidden.device)
        block_lse = torch.empty((count, blocks), dtype=plan.accumulate, device=hidden.device)
        chosen, entropy = torch.empty_like(log_z), torch.empty_like(log_z)
        # The casts run once, not once per block; autocast is off below so that nothing is
        # cast twice (the backward, which autocast does not cover, casts the same way).
        w, b = weight.to(plan.dtype), _operand_bias(bias, plan)
        statistics = _chunk_forward(w, b, kept, plan, hidden.device, with_entropy)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, count, plan.position_chunk):
                rows = slice(start, min(start + plan.position_chunk, count))
                x = _operand(hidden[rows], plan)
                log_z[rows], block_lse[rows], entropy[rows] = statistics(x, rows)
                chosen[rows] = _picked(x, w, b, targets[rows], plan)
        if kept is not None:
            # A taken token outside its kept set (log-prob -inf) is made non-finite: log Z NaN,
            # which the backward reads too.
            log_z = torch.where(taken_outside(kept, targets), torch.nan, log_z)
        # log Z is NaN or +inf exactly when a logit of the position is NaN or +inf (below
        # BAD_LOG_Z when every logit is -inf).
        bad = ~torch.isfinite(log_z) | (log_z < BAD_LOG_Z)
        logp = torch.where(bad, torch.nan, chosen - log_z)
        entropy = torch.where(bad, torch.nan, entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, block_lse, kept)
        ctx.plan = plan
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor, _grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, log_z, block_lse, kept = ctx.saved_tensors
        plan: _Plan = ctx.plan
        finite = torch.isfinite(log_z) & (log_z >= BAD_LOG_Z)
        # A non-finite position passes no gradient (its log-prob is NaN and masked); in the
        # product's units: d logits / d product = 1 / temperature unless that is folded in.
        rate = torch.where(finite, grad_logp.to(plan.accumulate) * plan.scale, 0.0)
        share = torch.exp(block_lse - torch.where(finite, log_z, 0.0).unsqueeze(-1))
        coef = torch.where(finite.unsqueeze(-1), -rate.unsqueeze(-1) * share, 0.0)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # In the weight's own dtype, as autograd would accumulate it: a float32 copy of a
        # bfloat16 head's gradient would add V x H x 4 bytes at the step's peak.
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        grads = (grad_weight, grad_bias)
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        softmax_of = _chunk_softmax(kept, plan, hidden.device)
        gathered = kept is not None and kept.shape[1] * GATHER_RATIO <= weight.shape[0]
        w, b = weight.to(plan.dtype), _operand_bias(bias, plan)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], plan.position_chunk):
                rows = slice(start, min(start + plan.position_chunk, hidden.shape[0]))
                # A non-finite state (which made its logits so) must not meet a zero gradient
                # in the weight's product: 0 x NaN is NaN.
                states = torch.where(finite[rows].unsqueeze(-1), hidden[rows], 0.0)
                x = _operand(states, plan)
                grad_x = _one_hot_part(x, w, targets[rows], rate[rows], grads)
                if gathered:
                    grad_x += _backward_kept_chunk(x, w, b, kept[rows], rate[rows], plan, grads)
                else:
                    grad_x += _backward_chunk(x, w, b, coef[rows], plan, softmax_of(rows), grads)
                if grad_hidden is not None:
                    grad_hidden[rows] = (grad_x * plan.operand_scale).to(hidden.dtype)
        if grad_bias is not None and plan.folded:
            grad_bias *= plan.operand_scale
        return (grad_hidden, grad_weight, grad_bias, None, None, None, None)


def vocab_chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    position_chunk: int,
    vocab_chunk: int,
    with_entropy: bool,
    kernel: LogprobKernel = "auto",
    kept: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """logp [N] (differentiable in `hidden`, `weight`, `bias`) and entropy [N] (detached; zeros
    unless `with_entropy`) of the targets [N] under the head `weight` [V, H] (+ `bias` [V]) at
    `temperature`, from hidden states [N, H]; float32 (float64 for float64 inputs). NaN where
    the position's logits are not finite. `kernel`: the per-block elementwise work eager
    (torch), compiled, or auto (compiled on CUDA where it compiles). `kept` [N, K] int64: each
    position's kept set of truncated sampling (vocabulary ids, padded with -1), over which
    alone log Z is taken; NaN where the target is not in it; the entropy stays the full
    vocabulary's. See the module docstring."""
    if position_chunk < 1 or vocab_chunk < 1:
        raise ValueError(
            f"position_chunk and vocab_chunk must be >= 1, got {position_chunk}, {vocab_chunk}"
        )
    if kept is not None and (
        kept.dim() != 2 or kept.shape[0] != targets.shape[0] or kept.dtype != torch.long
    ):
        raise ValueError(
            f"kept must be int64 [N, K] for {targets.shape[0]} targets, got {kept.dtype}"
            f" {tuple(kept.shape)}"
        )
    dtype = _compute_dtype(hidden)
    accumulate = torch.promote_types(dtype, torch.float32)
    plan = _Plan(temperature, position_chunk, vocab_chunk, dtype, accumulate, kernel)
    logp, entropy = _VocabChunkedLogProbs.apply(  # type: ignore[no-untyped-call]
        hidden, weight, bias, targets, plan, with_entropy, kept
    )
    return logp, entropy
