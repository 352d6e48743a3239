"""Causal Kalman filter over token log-ratios (KPO, arXiv 2602.10609, Sec. 3).

State-space model over the valid tokens of one response (scalar random walk):

    x_t = x_{t-1} + w_t,  w ~ N(0, Q)        latent log-ratio
    z_t = x_t + v_t,      v ~ N(0, R)        observed log-ratio

Per valid token: P- = P + Q;  K = P- / (P- + R);  x = x + K (z - x);  P = (1 - K) P-.
A masked token leaves the state untouched, so left, right and interior padding and packed
sequences give the same values on the valid tokens. The observation tokens of a multi-turn
response (tool output in the context, SPEC.md) are masked tokens: across one, x and P carry
over, and the count n of valid tokens that indexes the gain table counts model tokens only.

With constant Q and R the covariance recursion never reads z, so the gain is a fixed table K[n]
over the count n of valid tokens so far, and the filter is the first-order linear recurrence

    x_t = a_t x_{t-1} + b_t,   a_t = 1 - K[n_t] m_t,   b_t = K[n_t] m_t z_t.

`method="parallel"` evaluates it without a loop over tokens. When every row's valid tokens are
a prefix of it (right padding, the common case), the n-th valid token is at position n - 1 in
every row, so a_t is one table along the sequence shared by all rows, and the recurrence is
solved by batched matmuls with fixed block matrices of products of a (the section "Right
padding" below): the tables are cached across calls, and the padded tail takes the held state.
Any other mask (left padding, interior holes, packed sequences) takes the general path, in two
levels:
1. Blocks of C tokens are solved in closed form with cumulative sums of log a_t measured from the
   block's own end, x_t = e^(S_t - S_end) * cumsum(e^(S_end - S_r) b_r), so every exponent stays
   within the block's total decay. C is chosen from the gain table so that this decay is at most
   8 (float32) or 64 (float64): no overflow, underflow or loss of precision, for any Q/R.
2. The blocks' (decay, end value) pairs form a short recurrence of the same kind, solved by a
   Hillis-Steele doubling scan over (a, b) pairs, (a2, b2) o (a1, b1) = (a2 a1, a2 b1 + b2),
   which only multiplies and adds.
The map z -> x is linear, so on both paths the backward pass is the transposed map (a custom
autograd function), not autograd through the forward. The paper's official code instead uses
x_t = A_t (x0 + sum_s b_s / A_s) with A_t = prod(1 - K), which divides by vanishing products
(docs/kpo_core.md, "Where the official code differs from ours"). `method="closed_form"` keeps
that form, with A_t floored at 1e-30, for comparison only: it stays finite but departs from the
exact recursion beyond ~70k tokens at Q/R = 1e-6.

Two generalisations keep the parallel evaluation, for noise schedules of your own:
- Per-response measurement noise r [...]: one gain table per distinct value, gathered per row.
- Per-token process noise q [..., T]: the gains then vary along the sequence, but the
  covariance recursion still never reads z.
  One step P -> (P + Q_t) R / (P + Q_t + R) is a linear fractional map, the 2x2 matrix
  [[R, R Q_t], [1, Q_t + R]] acting on P in homogeneous coordinates, so the posterior variances
  are prefix products of 2x2 matrices: a doubling scan in float64, rescaled at every level (all
  entries are non-negative, so nothing cancels).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

FilterMethod = Literal["parallel", "sequential", "closed_form"]
Noise = float | Tensor

_MAX_BLOCK = 64
# Largest total log-decay a block may span: e^8 keeps float32 relative error near 5e-7.
_BLOCK_DECAY_LIMIT = {torch.float32: 8.0, torch.float64: 64.0}
# log(1 - K) when K rounds to 1 (huge P0 or Q/R): the old state is forgotten, and a finite value
# keeps the log-space sums free of inf - inf. e^-80 ~ 1e-35 is zero at every tolerance we use.
_LOG_ZERO = -80.0

_gain_cache: dict[tuple[float, float, float], Tensor] = {}
_gain_lock = threading.Lock()


def _check_noise(q: float, r: float, p0: float) -> None:
    if not (math.isfinite(q) and q >= 0.0):
        raise ValueError(f"q (process noise variance) must be finite and >= 0, got {q}")
    if not (math.isfinite(r) and r > 0.0):
        raise ValueError(f"r (measurement noise variance) must be finite and > 0, got {r}")
    if not (math.isfinite(p0) and p0 >= 0.0):
        raise ValueError(f"p0 (initial state variance) must be finite and >= 0, got {p0}")


def _smallest(value: Noise, empty: float) -> float:
    if isinstance(value, Tensor):
        return float(value.min()) if value.numel() else empty
    return value


def _check_noise_tensors(z: Tensor, q: Noise, r: Noise, p0: float) -> None:
    """Validate scalar or tensor noise: q [..., T] (as z) and r [...] (one per response)."""
    _check_noise(_smallest(q, 0.0), _smallest(r, 1.0), p0)
    if isinstance(q, Tensor):
        if q.shape != z.shape:
            raise ValueError(f"tensor q must have z's shape {tuple(z.shape)}, got {tuple(q.shape)}")
        if not bool(torch.isfinite(q).all()):
            raise ValueError("q (process noise variance) must be finite everywhere")
    if isinstance(r, Tensor):
        if r.shape != z.shape[:-1]:
            raise ValueError(
                f"tensor r must have one value per response, shape {tuple(z.shape[:-1])}, "
                f"got {tuple(r.shape)}"
            )
        if not bool(torch.isfinite(r).all()):
            raise ValueError("r (measurement noise variance) must be finite everywhere")


def _riccati_gains(n: int, q: float, r: float, p0: float) -> Tensor:
    # The scalar covariance recursion in float64, once per (q, r, p0) and table size. Once the
    # covariance stops changing, the rest of the table is that fixed point's gain.
    gains = torch.empty(n, dtype=torch.float64)
    p = p0
    for i in range(n):
        p_prior = p + q
        k = p_prior / (p_prior + r)
        gains[i] = k
        p_next = (1.0 - k) * p_prior
        if p_next == p:
            gains[i + 1 :] = k
            break
        p = p_next
    return gains


def kalman_gains(n: int, q: float, r: float, p0: float = 0.0) -> Tensor:
    """Kalman gains K[1..n] of the 1st..n-th valid token: float64, shape [n].

    K depends only on (q, r, p0) and the count of valid tokens, never on the data. Tables are
    cached per (q, r, p0) and grown on demand; treat the returned tensor as read-only.
    """
    _check_noise(q, r, p0)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    key = (float(q), float(r), float(p0))
    with _gain_lock:
        table = _gain_cache.get(key)
        if table is None or table.numel() < n:
            size = max(n, 1024 if table is None else 2 * table.numel())
            table = _riccati_gains(size, *key)
            _gain_cache[key] = table
    return table[:n]


def steady_state_gain(q: float, r: float) -> float:
    """K_inf = (-s + sqrt(s^2 + 4 s)) / 2 with s = Q/R, the gain the table converges to."""
    _check_noise(q, r, 0.0)
    s = q / r
    return (-s + math.sqrt(s * s + 4.0 * s)) / 2.0


def _compute_dtype(z: Tensor) -> torch.dtype:
    # Never bf16/fp16: their 8-10 bit mantissas cannot resolve gains of ~1e-3.
    return torch.float64 if z.dtype == torch.float64 else torch.float32


# Tables derived from the gain table (per q, r, p0, dtype and device), built once and reused:
# rebuilding them costs as much as filtering a small batch. Each is built for a capacity of
# tokens and sliced to the length at hand, so one entry serves every padded width up to it, and
# a slice of a larger build holds exactly the values a smaller build would (the same call gives
# the same result whatever ran before). Least recently used entries are dropped beyond the bound.
_TABLE_CACHE_ENTRIES = 16
_table_cache: OrderedDict[tuple[Any, ...], tuple[int, Any]] = OrderedDict()
_table_lock = threading.Lock()  # not _gain_lock: a build reads the gain table


def _cached_table(key: tuple[Any, ...], n: int, build: Callable[[int], Any]) -> Any:
    """The table cached under `key` for at least n tokens, (re)built by build(capacity)."""
    with _table_lock:
        entry = _table_cache.get(key)
        if entry is None or entry[0] < n:
            capacity = max(n, 4096, 2 * entry[0] if entry is not None else 0)
            entry = (capacity, build(capacity))
            _table_cache[key] = entry
        _table_cache.move_to_end(key)
        while len(_table_cache) > _TABLE_CACHE_ENTRIES:
            _table_cache.popitem(last=False)
        return entry[1]


def _log_a(gains: Tensor) -> Tensor:
    return torch.log1p(-gains).clamp_min(_LOG_ZERO)


@dataclass(frozen=True)
class _Lookup:
    """Per-valid-token lookup of the general path: row 0 a masked token, row n the n-th valid."""

    gain_log_a: Tensor  # [capacity + 1, 2]: (K, log a), in the compute dtype
    max_decay: list[float]  # max_decay[n - 1]: the largest -log a among the first n gains


def _lookup(
    q: float, r: float, p0: float, n: int, dtype: torch.dtype, device: torch.device
) -> _Lookup:
    def build(capacity: int) -> _Lookup:
        gains = kalman_gains(capacity, q, r, p0)
        log_a = _log_a(gains)
        # Row 0 is a masked token (K = 0, a = 1), so that one gather with index n_t m_t covers
        # valid and masked tokens alike.
        table = torch.stack([gains, log_a], -1)
        table = torch.cat([table.new_zeros(1, 2), table]).to(dtype=dtype, device=device)
        return _Lookup(table, (-log_a).cummax(0).values.tolist())

    return cast(_Lookup, _cached_table(("lookup", q, r, p0, dtype, device), n, build))


def _recurrence_terms(
    z: Tensor, mask: Tensor, lookup: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """Gain, log a_t and b_t = K m z of x_t = a_t x_{t-1} + b_t, all [..., T] in `dtype`."""
    valid = mask.to(torch.bool)
    count = valid.to(torch.int32).cumsum(-1, dtype=torch.int32)
    index = (count * valid).flatten()
    gain, log_a = lookup.index_select(0, index).reshape(*z.shape, 2).unbind(-1)
    # masked_fill before the product: padded log-probs are often -inf or NaN and must not leak.
    b = gain * z.to(dtype).masked_fill(~valid, 0.0)
    return gain, log_a, b


def _block_size(max_decay: float, dtype: torch.dtype) -> int:
    if max_decay <= 0.0:
        return _MAX_BLOCK
    size = 1
    while size < _MAX_BLOCK and 2 * size * max_decay <= _BLOCK_DECAY_LIMIT[dtype]:
        size *= 2
    return size


def _doubling_scan(a: Tensor, b: Tensor) -> Tensor:
    """x_t = a_t x_{t-1} + b_t from x_{-1} = 0 by Hillis-Steele doubling. [N, T] -> [N, T]."""
    t = b.shape[-1]
    step = 1
    while step < t:
        b = torch.cat([b[:, :step], torch.addcmul(b[:, step:], a[:, step:], b[:, :-step])], -1)
        if 2 * step < t:
            a = torch.cat([a[:, :step], a[:, step:] * a[:, :-step]], -1)
        step *= 2
    return b


def _scan(log_a: Tensor, b: Tensor, block: int) -> Tensor:
    """x_t = a_t x_{t-1} + b_t from x_{-1} = 0, a_t = exp(log_a_t) <= 1. [N, T] -> [N, T]."""
    n_rows, t = b.shape
    pad = (-t) % block
    if pad:  # a = 1, b = 0: the state passes through the padding unchanged
        log_a = torch.nn.functional.pad(log_a, (0, pad))
        b = torch.nn.functional.pad(b, (0, pad))
    log_a = log_a.reshape(n_rows, -1, block)
    b = b.reshape(n_rows, -1, block)
    decay = log_a.cumsum(-1)  # S_t: log prod of a from the block start, in [-limit, 0]
    decay_end = decay[..., -1:]
    to_end = torch.exp(decay_end - decay)  # e^(S_end - S_t) in [e^-limit, 1]
    # x_t = local_t + e^(S_t) * incoming = (C_t + e^(S_end) * incoming) / e^(S_end - S_t), with
    # C the block-local cumulative sum; at the block's end e^(S_end - S_t) = 1, so x_end = C_end.
    weighted = torch.cumsum(to_end * b, -1)
    block_decay = decay_end.squeeze(-1).exp()
    block_end = _doubling_scan(block_decay, weighted[..., -1])
    incoming = torch.nn.functional.pad(block_end[:, :-1], (1, 0))
    x = (weighted + (block_decay * incoming).unsqueeze(-1)) / to_end
    return x.reshape(n_rows, -1)[:, :t]


class _LinearRecurrence(torch.autograd.Function):
    """x = L b for the lower-triangular L[t, s] = prod_{s<k<=t} a_k; backward is L^T g."""

    @staticmethod
    def forward(ctx: Any, log_a: Tensor, b: Tensor, block: int) -> Tensor:
        ctx.save_for_backward(log_a)
        ctx.block = block
        return _scan(log_a, b, block)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_x: Tensor) -> tuple[None, Tensor, None]:
        (log_a,) = ctx.saved_tensors
        # (L^T g)_s = g_s + a_{s+1} (L^T g)_{s+1}: the same recurrence backwards in time, with
        # each step's coefficient taken from the token after it.
        log_a_reversed = torch.nn.functional.pad(log_a.flip(-1)[:, :-1], (1, 0))
        grad_b = _scan(log_a_reversed, grad_x.flip(-1), ctx.block).flip(-1)
        return None, grad_b, None


# --- Right padding: every row's valid tokens are a prefix -------------------------------------
#
# Then the n-th valid token sits at position n - 1 in every row, so a_t = 1 - K[t] is one table
# along the sequence, shared by all rows, and b_t = K[t] m_t z_t. Treating the padding as
# observations z = 0 with the gains of those positions changes nothing before it (the filter is
# causal); the padded positions are then overwritten with the state held from the row's last
# valid token. With one a_t for all rows, the solve of each block of C tokens is a fixed C x C
# matrix, W_j[r, t] = prod_{r<k<=t} a_k (r <= t), so
#   level 1: local_block = b_block @ W_j, one batched matmul over the blocks;
#   level 2: the states at the block ends obey a recurrence of the same kind, with a = the
#            block's decay prod a_k, again shared by all rows: solved the same way, recursively;
# and x_t = local_t + prod_{block start<=k<=t} a_k * (state at the previous block's end).
# Every matrix entry is a product of numbers in [0, 1] computed in float64: nothing overflows,
# underflows to a wrong value or is divided, whatever the block size and Q/R. The backward pass
# multiplies by the transposes.

_PREFIX_BLOCK = 16  # C: the cheapest block for the batched matmul


@dataclass(frozen=True)
class _Level:
    weights: Tensor  # [blocks, C, C]: W_j[r, t], zero below the diagonal (r > t)
    prefix: Tensor  # [blocks, C]: prod of a from the block's start through t


@dataclass(frozen=True)
class _PrefixPlan:
    levels: tuple[_Level, ...]  # tokens, blocks of tokens, blocks of blocks, ... down to 1 block
    gains: Tensor  # [capacity]: K[t]
    from_start: Tensor  # [capacity]: prod_{k<=t} a_k, the weight of x0 in x_t


def _build_levels(log_a: Tensor) -> list[tuple[Tensor, Tensor]]:
    """(W, prefix) in float64 for every level, from log a [n] of the tokens (float64)."""
    c = _PREFIX_BLOCK
    upper = torch.ones(c, c, dtype=torch.bool).triu()  # r <= t
    levels = []
    while True:
        n_blocks = -(-log_a.numel() // c)
        # Padding (a = 1) only ever follows the tokens it was added to.
        padded = torch.nn.functional.pad(log_a, (0, n_blocks * c - log_a.numel()))
        decay = padded.view(n_blocks, c).cumsum(-1)  # log prod of a from the block's start
        exponent = (decay[:, None, :] - decay[:, :, None]).masked_fill(~upper, -math.inf)
        levels.append((exponent.exp(), decay.exp()))
        if n_blocks == 1:
            return levels
        log_a = decay[:, -1]


def _prefix_plan(
    q: float, r: float, p0: float, n: int, dtype: torch.dtype, device: torch.device
) -> _PrefixPlan:
    def build(capacity: int) -> _PrefixPlan:
        gains = kalman_gains(capacity, q, r, p0)
        log_a = _log_a(gains)
        levels = tuple(
            _Level(*(t.to(dtype=dtype, device=device) for t in level))
            for level in _build_levels(log_a)
        )
        from_start = log_a.cumsum(0).exp()
        return _PrefixPlan(
            levels, gains.to(dtype=dtype, device=device), from_start.to(dtype=dtype, device=device)
        )

    return cast(_PrefixPlan, _cached_table(("prefix", q, r, p0, dtype, device), n, build))


def _blocks(x: Tensor, c: int) -> Tensor:
    """[N, n] -> [N, blocks, C], zero-padded to whole blocks."""
    pad = (-x.shape[-1]) % c
    x = torch.nn.functional.pad(x, (0, pad)) if pad else x.contiguous()
    return x.view(x.shape[0], -1, c)


def _shared_solve(levels: tuple[_Level, ...], b: Tensor) -> Tensor:
    """x = L b for rows b [N, n], with the a_t of `levels` shared by all rows, from x_{-1} = 0."""
    level = levels[0]
    n_rows, n = b.shape
    c = level.weights.shape[-1]
    blocks = _blocks(b, c)
    n_blocks = blocks.shape[1]
    # The block index is the batch of the matmul and the rows its M dimension: one small GEMM per
    # block, read straight from the [N, blocks, C] layout.
    local = torch.bmm(blocks.transpose(0, 1), level.weights[:n_blocks])  # [blocks, N, C]
    if n_blocks == 1:
        return local[0, :, :n]
    end = _shared_solve(levels[1:], local[:, :, -1].t())  # [N, blocks]: state at block ends
    incoming = torch.nn.functional.pad(end[:, :-1], (1, 0))
    # out= writes the result in row order [N, blocks, C] (the matmul's output is block-major).
    x = b.new_empty(n_rows, n_blocks, c)
    torch.addcmul(local.transpose(0, 1), level.prefix[:n_blocks], incoming.unsqueeze(-1), out=x)
    return x.view(n_rows, -1)[:, :n]


def _shared_solve_transposed(levels: tuple[_Level, ...], g: Tensor) -> Tensor:
    """y = L^T g for rows g [N, n]: the adjoint of `_shared_solve`."""
    level = levels[0]
    n_rows, n = g.shape
    c = level.weights.shape[-1]
    blocks = _blocks(g, c)
    n_blocks = blocks.shape[1]
    weights = level.weights[:n_blocks]
    local = torch.bmm(blocks.transpose(0, 1), weights.transpose(1, 2))  # [blocks, N, C]
    if n_blocks == 1:
        return local[0, :, :n]
    # Block j's incoming state reaches x_t with weight prefix_j[t] = a_start W_j[0, t], so its
    # gradient is a_start * local_j[0]: no separate reduction over the block.
    to_incoming = local[:, :, 0].t() * level.prefix[:n_blocks, 0]  # [N, blocks]
    # ... and that state is the end of block j - 1, which the level above solved.
    to_end = _shared_solve_transposed(
        levels[1:], torch.nn.functional.pad(to_incoming[:, 1:], (0, 1))
    )
    # The end state of block j reads b_r with weight W_j[r, C - 1].
    y = g.new_empty(n_rows, n_blocks, c)
    torch.addcmul(local.transpose(0, 1), to_end.unsqueeze(-1), weights[:, :, -1], out=y)
    return y.view(n_rows, -1)[:, :n]


class _PrefixFilter(torch.autograd.Function):
    """The filter over right-padded rows [N, T]: z -> x, linear in z (see the section above)."""

    @staticmethod
    def forward(
        ctx: Any,
        z: Tensor,
        weight: Tensor,
        lengths: Tensor,
        plan: _PrefixPlan,
        x0: float,
    ) -> Tensor:
        n = z.shape[-1]
        gain = weight * plan.gains[:n]  # K_t m_t
        # Masking by a multiply (several times cheaper than torch.where on CPU) is safe: the
        # caller hands rows compacted into zeros (`_compact`), so no NaN or inf sits off the mask.
        b = z * gain
        x = _shared_solve(plan.levels, b)
        if x0 != 0.0:
            x = torch.addcmul(x, plan.from_start[:n], x.new_tensor(x0))
        last = (lengths - 1).clamp_min(0).unsqueeze(-1)
        held = torch.where(lengths.unsqueeze(-1) > 0, x.gather(-1, last), x0)
        ctx.save_for_backward(weight, gain, last)
        ctx.plan = plan
        # lerp is exact at weights 0 and 1: x on valid tokens, the held state on padding.
        return torch.lerp(held, x, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_x: Tensor) -> tuple[Tensor, None, None, None, None]:
        weight, gain, last = ctx.saved_tensors
        # The state held at padded positions is x at the row's last valid token: their gradient
        # goes there. (A row with no valid token holds x0; adding at index 0 is harmless, as z
        # there has gain 0.)
        grad = grad_x * weight
        held_grad = (grad_x - grad).sum(-1, keepdim=True)
        grad.scatter_add_(-1, last, held_grad)
        return _shared_solve_transposed(ctx.plan.levels, grad) * gain, None, None, None, None


def _compact(z: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Every row's valid tokens moved to its front, zeros after them: (rows [N, T], lengths [N],
    count [N, T] of valid tokens up to and including each position).

    The filter over a row depends only on the sequence of its valid z and their count, so the
    compacted rows are right-padded whatever the mask was (left padding, holes), and take the
    prefix path. A scatter, not a data-dependent branch: the mask is never read on the host.
    """
    n = z.shape[-1]
    count = valid.to(torch.int64).cumsum(-1)
    # Masked tokens go to a spare column n, cut off afterwards (they all write 0 there).
    dest = torch.where(valid, count - 1, n)
    spare = z.new_zeros(z.shape[0], n + 1)
    rows = spare.scatter(-1, dest, torch.where(valid, z, 0.0))[:, :n]
    return rows, count[:, -1], count


def _filter_compacted(
    z: Tensor, valid: Tensor, q: float, r: float, p0: float, x0: float, dtype: torch.dtype
) -> Tensor:
    """The filter of rows z [N, T] (mask valid [N, T]) for scalar noise, through `_compact`."""
    n = z.shape[-1]
    rows, lengths, count = _compact(z.to(dtype), valid)
    positions = torch.arange(n, device=z.device)
    weight = (positions < lengths.unsqueeze(-1)).to(dtype)
    plan = _prefix_plan(q, r, p0, n, dtype, z.device)
    compact: Tensor = _PrefixFilter.apply(rows, weight, lengths, plan, x0)  # type: ignore[no-untyped-call]
    # Position t holds the state after the row's count_t-th valid token (its own value on a
    # valid token, the held state on a masked one), x0 before the first.
    state = compact.gather(-1, (count - 1).clamp_min(0))
    return torch.where(count > 0, state, x0)


def _prefix_lengths(weight: Tensor) -> Tensor | None:
    """Per-row counts of valid tokens if every row of the 0/1 weight [N, T] is a prefix."""
    # A prefix row never steps up from 0 to 1. (Float arithmetic: comparisons of bool or uint8
    # tensors are several times slower on CPU.)
    if weight.shape[-1] > 1 and bool((weight[:, 1:] - weight[:, :-1]).max() > 0):
        return None
    # Partial sums of 0/1 are integers, exact in the float's mantissa up to its 2^24 or 2^53.
    sum_dtype = torch.float64 if weight.shape[-1] >= 2**24 else weight.dtype
    return weight.sum(-1, dtype=sum_dtype).to(torch.int64)


def _terms_from_gains(
    z: Tensor, mask: Tensor, gains: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """log a_t and b_t of the recurrence from per-token gains [..., T] (0 on masked tokens)."""
    valid = mask.to(torch.bool)
    log_a = torch.log1p(-gains).clamp_min(_LOG_ZERO).to(dtype)
    b = gains.to(dtype) * z.to(dtype).masked_fill(~valid, 0.0)
    return log_a, b


def _scalar_gains(mask: Tensor, q: float, r: float, p0: float) -> Tensor:
    """Per-token gains [N, T] float64 for scalar q and r: the table at each valid token's count.

    The table is kept on the mask's device (`_cached_table`), and nothing is read back."""
    valid = mask.to(torch.bool)
    n = max(mask.shape[-1], 1)
    key = ("gains", q, r, p0, mask.device)
    table = _cached_table(key, n, lambda size: kalman_gains(size, q, r, p0).to(mask.device))
    count = valid.to(torch.int64).cumsum(-1)
    index = (count * valid).clamp_min(1) - 1
    return torch.where(valid, table[index], 0.0)


def _row_gains_by_table(mask: Tensor, q: float, r: Tensor, p0: float) -> Tensor:
    """Per-token gains [..., T] float64 for a scalar q and one r per row: a table per distinct r."""
    valid = mask.to(torch.bool)
    gains = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    count = valid.to(torch.int64).cumsum(-1)
    index = (count * valid).clamp_min(1) - 1
    r64 = r.to(torch.float64)
    for value in torch.unique(r64).tolist():
        rows = r64 == value
        table = kalman_gains(max(mask.shape[-1], 1), q, value, p0).to(mask.device)
        gains[rows] = torch.where(valid[rows], table[index[rows]], 0.0)
    return gains


def _matrix_prefix_products(steps: Tensor) -> Tensor:
    """Prefix products M_t ... M_1 of [N, T, 2, 2] non-negative matrices, each rescaled.

    The products are only used as linear fractional maps, so any positive scale is free; each
    level divides by the largest entry to stay in range over 10^5 steps.
    """
    t = steps.shape[1]
    step = 1
    while step < t:
        combined = steps[:, step:] @ steps[:, :-step]
        combined = combined / combined.amax(dim=(-2, -1), keepdim=True)
        steps = torch.cat([steps[:, :step], combined], 1)
        step *= 2
    return steps


def _riccati_scan(q: Tensor, r: Tensor, mask: Tensor, p0: float) -> Tensor:
    """Per-token gains [N, T] float64 for per-token q [N, T] and per-row r [N] (module doc)."""
    valid = mask.to(torch.bool)
    q64 = torch.where(valid, q.to(torch.float64), 0.0)
    r64 = r.to(torch.float64).unsqueeze(-1).expand_as(q64)
    one, zero = torch.ones_like(q64), torch.zeros_like(q64)
    # Posterior update P -> (P + Q) R / (P + Q + R) on a valid token, identity on a masked one;
    # the valid matrices are divided by Q + R (a free scale) to start near 1.
    scale = torch.where(valid, q64 + r64, 1.0)
    top = torch.stack([torch.where(valid, r64, one), torch.where(valid, r64 * q64, zero)], -1)
    bottom = torch.stack([torch.where(valid, one, zero), torch.where(valid, q64 + r64, one)], -1)
    steps = torch.stack([top, bottom], -2) / scale[..., None, None]
    products = _matrix_prefix_products(steps)
    numerator = products[..., 0, 0] * p0 + products[..., 0, 1]
    denominator = products[..., 1, 0] * p0 + products[..., 1, 1]
    posterior = numerator / denominator
    before = torch.cat([posterior.new_full((posterior.shape[0], 1), p0), posterior[:, :-1]], 1)
    prior = before + q64
    return torch.where(valid, prior / (prior + r64), 0.0)


def _parallel_gains(mask: Tensor, q: Noise, r: Noise, p0: float) -> Tensor:
    """Per-token gains [N, T] float64 of the rows of the mask flattened to [N, T]."""
    # An explicit row count: reshape(-1, 0) is ambiguous for a mask with no tokens.
    rows = mask.reshape(math.prod(mask.shape[:-1]), mask.shape[-1])
    if not isinstance(q, Tensor) and not isinstance(r, Tensor):
        return _scalar_gains(rows, q, r, p0)
    n = rows.shape[0]
    r_rows = (
        r.reshape(n) if isinstance(r, Tensor) else torch.full((n,), float(r), dtype=torch.float64)
    )
    if isinstance(q, Tensor):
        return _riccati_scan(q.reshape(rows.shape), r_rows.to(rows.device), rows, p0)
    return _row_gains_by_table(rows, q, r_rows.to(rows.device), p0)


def filter_gains(mask: Tensor, q: Noise, r: Noise, p0: float = 0.0) -> Tensor:
    """The gain K_t the filter applies at each token, [..., T] float64 (0 on masked tokens).

    q and r as in `kalman_filter`; the gains never depend on z, only on the mask and the noise.
    """
    _check_noise_tensors(mask, q, r, p0)
    return _parallel_gains(mask, q, r, p0).reshape(mask.shape)


def _filter_parallel(z: Tensor, mask: Tensor, q: Noise, r: Noise, p0: float, x0: float) -> Tensor:
    if isinstance(q, Tensor) or isinstance(r, Tensor):
        return _filter_by_gains(z, mask, _parallel_gains(mask, q, r, p0).reshape(z.shape), x0)
    # Scalar noise: every mask is compacted to right padding and takes the section above's
    # path, with no branch on the data (the general scan, `_filter_by_gains`, serves tensor
    # noise).
    n = z.shape[-1]
    valid = mask.to(torch.bool).reshape(-1, n)
    filtered = _filter_compacted(z.reshape(valid.shape), valid, q, r, p0, x0, _compute_dtype(z))
    return filtered.reshape(z.shape)


def _filter_by_gains(z: Tensor, mask: Tensor, gains: Tensor, x0: float) -> Tensor:
    """The filter of z [..., T] with the per-token gains [..., T] float64 (0 on masked tokens),
    by the blocked scan; in the compute dtype (one read back: the largest decay sets the
    block)."""
    dtype = _compute_dtype(z)
    log_a, b = _terms_from_gains(z, mask, gains, dtype)
    max_decay = float(-log_a.min()) if log_a.numel() else 0.0
    if x0 != 0.0:
        # x_0 = a_0 x0 + b_0: folding x0 into the first term lets the scan start from zero.
        b = b + torch.nn.functional.pad(log_a[..., :1].exp() * x0, (0, b.shape[-1] - 1))
    block = _block_size(max_decay, dtype)
    rows = b.reshape(-1, b.shape[-1])
    scanned: Tensor = _LinearRecurrence.apply(log_a.reshape(rows.shape), rows, block)  # type: ignore[no-untyped-call]
    return scanned.reshape(z.shape)


def _filter_sequential(z: Tensor, mask: Tensor, q: Noise, r: Noise, p0: float, x0: float) -> Tensor:
    # The plain recursion with its own covariance update (not the gain table), so that it is an
    # independent reference for the parallel method.
    dtype = _compute_dtype(z)
    valid = mask.to(torch.bool)
    observed = torch.where(valid, z.to(dtype), 0.0)
    q64 = (
        q.to(torch.float64)
        if isinstance(q, Tensor)
        else torch.full(z.shape, float(q), dtype=torch.float64)
    )
    r64 = r.to(torch.float64) if isinstance(r, Tensor) else float(r)
    x = torch.full(z.shape[:-1], x0, dtype=dtype, device=z.device)
    p = torch.full(z.shape[:-1], p0, dtype=torch.float64, device=z.device)
    states = []
    for t in range(z.shape[-1]):
        m = valid[..., t]
        p_prior = p + q64[..., t].to(z.device)
        k = p_prior / (p_prior + r64)
        x = torch.where(m, x + k.to(dtype) * (observed[..., t] - x), x)
        p = torch.where(m, (1.0 - k) * p_prior, p)
        states.append(x)
    if not states:
        return z.new_zeros(z.shape)
    return torch.stack(states, dim=-1)


def _filter_closed_form(
    z: Tensor, mask: Tensor, q: Noise, r: Noise, p0: float, x0: float
) -> Tensor:
    # The official implementation's form, for comparison only: float32 prefix products and a
    # division by them, here floored at 1e-30 (without a floor 1 / prod overflows float32 about
    # 89 / sqrt(Q/R) tokens in; docs/kpo_core.md).
    if isinstance(q, Tensor) or isinstance(r, Tensor):
        raise ValueError("method 'closed_form' takes scalar q and r only")
    n = z.shape[-1]
    lookup = _lookup(q, r, p0, n, torch.float32, z.device).gain_log_a[: n + 1]
    gain, _, b = _recurrence_terms(z, mask, lookup, torch.float32)
    prefix = (1.0 - gain).cumprod(-1).clamp_min(1e-30)
    return prefix * (x0 + (b / prefix).cumsum(-1))


VersionSwitch = Literal["off", "reset", "inflate"]


def version_switches(versions: Tensor, mask: Tensor) -> Tensor:
    """[..., T] bool: the valid tokens whose version differs from the previous valid token's
    in the same row (SPEC.md, `version_switch`). Masked tokens (padding, observations) carry
    no version and are skipped over, and a row's first valid token is never a switch."""
    if versions.shape != mask.shape:
        raise ValueError(
            f"versions shape {tuple(versions.shape)} must equal mask shape {tuple(mask.shape)}"
        )
    valid = mask.to(torch.bool)
    n = valid.shape[-1]
    positions = torch.arange(n, device=valid.device).expand_as(valid)
    # The position of the last valid token at or before t (-1 before the first), then shifted
    # one step: the previous valid token of each position.
    last = torch.where(valid, positions, -1).cummax(-1).values
    previous = torch.nn.functional.pad(last[..., :-1], (1, 0), value=-1)
    previous_version = versions.gather(-1, previous.clamp_min(0))
    return valid & (previous >= 0) & (versions != previous_version)


def steady_state_covariance(q: float, r: float) -> float:
    """P_inf = K_inf R: the posterior variance the covariance recursion converges to."""
    return steady_state_gain(q, r) * r


def check_reset_prior(q: float, r: float, p0: float) -> None:
    """Refuse `version_switch: reset` with a prior covariance below the steady state: a reset
    to it would trust the old estimate more, not less (`switch_process_noise`)."""
    floor = steady_state_covariance(q, r)
    if p0 < floor:
        raise ValueError(
            f"version_switch 'reset' restarts the covariance at p0, which must be at least "
            f"the steady-state covariance {floor:.3g} (p0 is {p0}: a reset would trust "
            "the old estimate more, not less); set p0: diffuse, or use version_switch "
            "'inflate' with switch_q"
        )


def _check_switch_options(
    q: float, r: float, p0: float, mode: VersionSwitch, switch_q: float
) -> None:
    _check_noise(q, r, p0)
    if not (math.isfinite(switch_q) and switch_q >= 0.0):
        raise ValueError(f"switch_q must be finite and >= 0, got {switch_q}")
    if mode not in get_args(VersionSwitch):
        raise ValueError(f"unknown version_switch {mode!r}; valid: off, reset, inflate")
    if mode == "reset":
        check_reset_prior(q, r, p0)


def switch_process_noise(
    switches: Tensor,
    mask: Tensor,
    q: float,
    r: float,
    p0: float,
    mode: VersionSwitch,
    switch_q: float = 0.0,
) -> Tensor:
    """Per-token process noise Q_t [..., T] float64 of the version-aware filter (SPEC.md).

    Q_t = Q except at a switch, where `inflate` gives Q + switch_q and `reset` gives
    P0 + Q - P_{t-1}, so that the predicted covariance P_{t-1} + Q_t is the first token's,
    P0 + Q: the filter restarts its covariance there while x carries over. P never reads z, so
    P_{t-1} is known: after c valid tokens since the row's start or its last reset it is the
    posterior K[c] R of the gain table. `reset` needs P0 >= P_{t-1}, which holds for every t
    only when P0 is at least the steady-state covariance (otherwise it would trust the old
    estimate more, not less): refused below it.
    """
    _check_switch_options(q, r, p0, mode, switch_q)
    if switches.shape != mask.shape:
        raise ValueError(
            f"switches shape {tuple(switches.shape)} must equal mask shape {tuple(mask.shape)}"
        )
    valid = mask.to(torch.bool)
    at_switch = switches.to(torch.bool) & valid
    base = torch.full(mask.shape, float(q), dtype=torch.float64, device=mask.device)
    if mode == "off":
        return base
    if mode == "inflate":
        return torch.where(at_switch, q + switch_q, base)
    count = valid.to(torch.int64).cumsum(-1)
    # The valid-token count at the last switch at or before t, less one: the count at which
    # the current segment began (0 for the first segment).
    start = torch.where(at_switch, count - 1, 0).cummax(-1).values
    previous_start = torch.nn.functional.pad(start[..., :-1], (1, 0))
    # At a switch the previous segment holds count - 1 - previous_start >= 1 valid tokens.
    segment = (count - 1 - previous_start).clamp_min(1)
    table = kalman_gains(max(mask.shape[-1], 1), q, r, p0).to(mask.device)
    covariance_before = table[segment - 1] * r
    return torch.where(at_switch, p0 + q - covariance_before, base)


_METHODS = {
    "parallel": _filter_parallel,
    "sequential": _filter_sequential,
    "closed_form": _filter_closed_form,
}


def kalman_filter(
    z: Tensor,
    mask: Tensor,
    q: Noise,
    r: Noise,
    p0: float = 0.0,
    x0: float = 0.0,
    method: FilterMethod = "parallel",
) -> Tensor:
    """Filtered log-ratios x_t of observed log-ratios z_t along the last dimension.

    Args:
        z: [..., T] observed token log-ratios (any float dtype; computed in float32, or float64
            for float64 input).
        mask: [..., T] bool or 0/1, True on valid tokens. Masked tokens hold the state.
        q: process noise variance (>= 0): a float, or a [..., T] tensor of per-token values.
        r: measurement noise variance (> 0): a float, or a [...] tensor, one per response.
        p0, x0: initial state variance and mean.
        method: "parallel" (blocked scan, the training path), "sequential" (reference loop) or
            "closed_form" (the paper's official form, for comparison).

    Returns:
        [..., T] filtered log-ratios, same dtype as z, differentiable with respect to z. At a
        masked position the value is the state held from the last valid token (x0 before any),
        always finite when the valid z are.
    """
    if mask.shape != z.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal z shape {tuple(z.shape)}")
    if not z.is_floating_point():
        raise ValueError(f"z must be a floating-point tensor, got {z.dtype}")
    if method not in _METHODS:
        raise ValueError(f"unknown method {method!r}; valid methods: {sorted(_METHODS)}")
    if z.ndim == 0:
        raise ValueError("z must have at least one (time) dimension")
    _check_noise_tensors(z, q, r, p0)
    if z.numel() == 0:  # no responses or no tokens: nothing to filter (keeps the graph)
        return z * 0.0
    x = _METHODS[method](z, mask, q, r, p0, x0)
    return x.to(z.dtype)


def version_aware_filter(
    z: Tensor,
    mask: Tensor,
    versions: Tensor | None,
    q: float,
    r: float,
    p0: float = 0.0,
    x0: float = 0.0,
    mode: VersionSwitch = "off",
    switch_q: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """The filter with `version_switch` `mode` (SPEC.md): x [..., T] in z's dtype,
    differentiable in z, and the gains K_t [..., T] float64 (0 on masked tokens).

    versions: [..., T] the policy version that sampled each token (read on valid tokens only);
    None (every row sampled by one version) or mode "off": the plain filter,
    `kalman_filter(z, mask, q, r, p0, x0)` with `filter_gains(mask, q, r, p0)`.

    Otherwise each filter runs once. The plain one runs over the whole batch and gives the rows
    without a switch: with the batch's own shapes its values are `off`'s bit for bit (a
    response sampled by one version gets exactly today's values; a matmul's rounding may change
    with its row count, so those rows are not filtered apart, and the plain values of the rows
    with a switch, cheap beside theirs, are replaced). The per-token noise path of
    `switch_process_noise` (prefix products of 2x2 Riccati matrices, then the general scan:
    tens of times the plain filter's cost) runs over the rows with a switch only, and its gains
    serve x and the returned gains alike. Picking those rows reads one value back to the host
    (their number); the scan reads its largest decay, only when some row has a switch.
    """
    _check_switch_options(q, r, p0, mode, switch_q)
    x = kalman_filter(z, mask, q, r, p0, x0)
    gains = filter_gains(mask, q, r, p0)
    if versions is None or mode == "off" or z.numel() == 0:
        return x, gains
    n = z.shape[-1]
    switches = version_switches(versions, mask).reshape(-1, n)
    rows = switches.any(-1).nonzero().squeeze(-1)  # the one read back that picks them
    if rows.numel() == 0:
        return x, gains
    valid = mask.to(torch.bool).reshape(-1, n)[rows]
    noise = switch_process_noise(switches[rows], valid, q, r, p0, mode, switch_q)
    switched_gains = _parallel_gains(valid, noise, r, p0)
    switched_x = _filter_by_gains(z.reshape(-1, n)[rows], valid, switched_gains, x0)
    x = x.reshape(-1, n).index_copy(0, rows, switched_x.to(z.dtype))
    gains = gains.reshape(-1, n).index_copy(0, rows, switched_gains)
    return x.reshape(z.shape), gains.reshape(z.shape)
