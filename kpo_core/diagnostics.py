"""Importance-ratio diagnostics from the KPO paper (arXiv 2602.10609, Figure 1 and Appendix C).

KPO motivates Kalman filtering of token-level importance ratios by showing that the ratio
sequence rho_t = pi_theta(y_t | ...) / pi_old(y_t | ...) along a response is *structured*:
off-policy tokens come in runs and in bursts, the sequence switches type rarely, and most of
its spectral energy sits at low frequencies (Figure 1; definitions in Appendix C). This module
computes those statistics for a batch so they can be logged on every learner step.

Every statistic is computed over the *compacted* sequence of each response's valid tokens:
masked positions are removed (not treated as tokens), so left padding, right padding and
interior holes all give the same result. Work is tensorised over tokens and responses; the only
Python loops are over the three token types and, in the low-frequency ratio, over the distinct
response lengths (a length-n DFT cannot be taken on a zero-padded row).

Everything is computed on the device the ratios are on. Each scalar statistic is a quotient of
two sums over responses (`diagnostic_sums`), so the sums of disjoint sets of responses (e.g.
those of several ranks) add up to those of their union, and `diagnostics_of_sums` finishes
them. Only the response lengths and the results are read back to the host: the lengths set the
shapes (the longest response, the distinct lengths of the DFTs), and a caller that knows them
on the host already passes them to `diagnostic_sums`, which then reads nothing back.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "DIAGNOSTIC_SCALARS",
    "DIAGNOSTIC_SUMS",
    "diagnostic_sums",
    "diagnostics_of_sums",
    "ratio_diagnostics",
    "token_types",
]

UP = 1
DOWN = -1
ON = 0
# Type code for positions past a response's end: differs from every real type so that a run
# can never continue into padding.
_PAD_TYPE = 2

# The scalar statistics of `ratio_diagnostics`, in the order of their sums in `diagnostic_sums`.
DIAGNOSTIC_SCALARS = (
    "switch_frequency",
    "run_length_up",
    "run_length_down",
    "run_length_on",
    "low_frequency_ratio",
    "global_variance",
    "local_variance",
)
# The length of `diagnostic_sums`: the NaN and inf counts, then a (numerator, denominator) pair
# per scalar statistic.
DIAGNOSTIC_SUMS = 2 + 2 * len(DIAGNOSTIC_SCALARS)


def token_types(ratios: Tensor, low: float = 3e-4, high: float = 4e-4) -> Tensor:
    """Classify each importance ratio as up (+1), down (-1) or on-policy (0).

    Args:
        ratios: [...] importance ratios rho (ratio values, not log-ratios).
        low: down threshold; rho < 1 - low is a "down" token.
        high: up threshold; rho > 1 + high is an "up" token.

    Returns:
        [...] int8 tensor: +1 where rho > 1 + high, -1 where rho < 1 - low, 0 otherwise
        (NaN compares false both ways and is therefore 0; callers validate finiteness).
    """
    up = (ratios > 1.0 + high).to(torch.int8)
    down = (ratios < 1.0 - low).to(torch.int8)
    return up - down


def _validate(ratios: Tensor, mask: Tensor, window: int, lfr_cutoff: float) -> Tensor:
    """Check shapes and arguments (finiteness is `_nonfinite`'s); return the mask as a [B, T]
    bool tensor on the ratios' device."""
    if ratios.dim() != 2:
        raise ValueError(f"ratios must be 2-D [B, T], got shape {tuple(ratios.shape)}")
    if mask.shape != ratios.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not match ratios shape {tuple(ratios.shape)}"
        )
    if ratios.is_complex():
        raise ValueError("ratios must be real-valued")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not 0.0 < lfr_cutoff <= 1.0:
        raise ValueError(f"lfr_cutoff must be in (0, 1], got {lfr_cutoff}")
    return mask.to(device=ratios.device, dtype=torch.bool)


def _nonfinite(ratios: Tensor, valid: Tensor) -> Tensor:
    """[2] float64: the NaN and the +-inf ratios at valid positions (padding may hold anything)."""
    bad = valid & ~torch.isfinite(ratios)
    n_nan = (bad & torch.isnan(ratios)).sum()
    return torch.stack([n_nan, bad.sum() - n_nan]).to(torch.float64)


def _check_finite(n_nan: float, n_inf: float) -> None:
    if n_nan or n_inf:
        raise ValueError(
            f"ratios contain non-finite values at valid (unmasked) positions: "
            f"{int(n_nan)} NaN, {int(n_inf)} inf"
        )


def _compact(ratios: Tensor, valid: Tensor, max_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """Left-align each response's valid tokens, preserving their order.

    Token t of response b goes to column c = (number of valid tokens before t), computed with
    a cumulative sum (an O(B*T) scatter rather than a sort). Masked tokens are sent to a
    scratch column T that is then dropped.

    Args:
        ratios: [B, T] ratios (any float dtype); valid: [B, T] bool; max_len: the most valid
            tokens of a response (known on the host: no read here).

    Returns:
        x: [B, L] float64 compacted ratios, L = max_b n_b; positions >= n_b hold 1.0.
        keep: [B, L] bool, keep[b, c] = c < n_b.
        lengths: [B] long, n_b = number of valid tokens of response b.
    """
    b, t = ratios.shape
    lengths = valid.sum(dim=1)
    dest = torch.where(valid, valid.cumsum(dim=1) - 1, torch.full_like(lengths[:, None], t))
    # torch.where (not multiplication) so NaN/inf garbage in padding cannot leak into x.
    src = torch.where(valid, ratios.to(torch.float64), 1.0)
    out = torch.ones(b, t + 1, dtype=torch.float64, device=ratios.device)
    out.scatter_(1, dest, src)
    x = out[:, :max_len]
    keep = torch.arange(max_len, device=ratios.device)[None, :] < lengths[:, None]
    return x, keep, lengths


def _to_windows(values: Tensor, window: int, fill: float | int | bool) -> Tensor:
    """Reshape [B, L] into [B, W, window] non-overlapping windows, W = ceil(L / window).

    The tail of the last window is padded with `fill`; callers combine with the padded mask.
    """
    b, length = values.shape
    n_windows = -(-length // window)
    pad = n_windows * window - length
    padded = torch.nn.functional.pad(values, (0, pad), value=fill)
    return padded.reshape(b, n_windows, window)


def _masked_sum(values: Tensor, include: Tensor) -> Tensor:
    """[2] float64 (sum of `values` where `include` is True, number of such entries): their
    mean is the quotient (0.0 if there are none, `_quotient`)."""
    total = torch.where(include, values, 0.0).sum()
    return torch.stack([total, include.sum().to(torch.float64)])


def _quotient(numerator: float, denominator: float) -> float:
    """numerator / denominator, 0.0 for an empty average (denominator 0)."""
    return numerator / denominator if denominator > 0 else 0.0


def _run_lengths(types: Tensor, keep: Tensor) -> Tensor:
    """Mean maximal-run length of each type, pooled over all runs in the batch.

    With r_tau runs of type tau and N_tau tokens of type tau over all responses, the mean run
    length is N_tau / r_tau (each token belongs to exactly one run); 0.0 if tau never occurs.
    A run starts at column 0 or wherever the type differs from the previous column. Runs span
    whole responses: windows do not cut them.

    Args:
        types: [B, L] int8 token types of the compacted sequences; keep: [B, L] bool.

    Returns:
        [6] float64: (tokens, runs) of up, of down, of on: the mean run lengths' sums.
    """
    coded = torch.where(keep, types, torch.full_like(types, _PAD_TYPE))
    starts = keep.clone()
    starts[:, 1:] &= coded[:, 1:] != coded[:, :-1]
    out = []
    for tau in (UP, DOWN, ON):
        is_tau = coded == tau
        out.append(is_tau.sum())
        out.append((starts & is_tau).sum())
    return torch.stack(out).to(torch.float64)


def _switch_frequency(types: Tensor, keep: Tensor, window: int) -> Tensor:
    """Fraction of type changes between adjacent tokens, per window, averaged over windows.

    For window w with m_w tokens and c_w adjacent pairs (t-1, t) *inside w* whose types differ,
    s_w = c_w / (m_w - 1), and s_w = 0 when m_w <= 1. The result is the mean of s_w over all
    non-empty windows of all responses (a response shorter than `window` is one window).

    Args:
        types: [B, L] int8; keep: [B, L] bool.

    Returns:
        [2] float64: the switching frequency's sums (`_masked_sum`); it is in [0, 1].
    """
    length = types.shape[1]
    change = torch.zeros_like(keep)
    change[:, 1:] = keep[:, 1:] & (types[:, 1:] != types[:, :-1])
    # A pair straddling a window boundary belongs to no window.
    col = torch.arange(length, device=types.device)
    change &= (col % window != 0)[None, :]
    n_changes = _to_windows(change, window, False).sum(dim=-1).to(torch.float64)
    n_tokens = _to_windows(keep, window, False).sum(dim=-1)
    n_pairs = (n_tokens - 1).clamp(min=0).to(torch.float64)
    per_window = torch.where(n_pairs > 0, n_changes / n_pairs.clamp(min=1), 0.0)
    return _masked_sum(per_window, n_tokens > 0)


def _window_frequencies(types: Tensor, keep: Tensor, window: int) -> Tensor:
    """Window-wise off-policy frequency (Figure 1): fraction of up / down tokens per window.

    For window index j, f_j^up = mean over responses b reaching window j of
    (#up tokens in window j of b) / (#tokens in window j of b); a partially filled last window
    is normalised by its own length. Likewise for down.

    Args:
        types: [B, L] int8; keep: [B, L] bool.

    Returns:
        [2, W] float64 (row 0 up, row 1 down), W = ceil(L / window) = max windows per response.
    """
    n_tokens = _to_windows(keep, window, False).sum(dim=-1).to(torch.float64)  # [B, W]
    reached = n_tokens > 0
    n_resp = reached.sum(dim=0).clamp(min=1).to(torch.float64)  # [W], >= 1 by construction
    out = []
    for tau in (UP, DOWN):
        count = _to_windows((types == tau) & keep, window, False).sum(dim=-1).to(torch.float64)
        frac = torch.where(reached, count / n_tokens.clamp(min=1), 0.0)
        out.append(frac.sum(dim=0) / n_resp)
    return torch.stack(out)


def _variances(x: Tensor, keep: Tensor, lengths: Tensor, window: int) -> Tensor:
    """Global and local (window-wise) population variance of the ratios.

    Global: Var_b = (1/n_b) sum_t (rho_bt - mean_b)^2 over each response's valid tokens,
    averaged over responses with n_b >= 1. Local: the same (ddof=0) variance inside each
    `window`-token window, averaged over all windows with >= 2 tokens of all responses.
    Two-pass (mean first) for accuracy, since ratios cluster tightly around 1.

    Args:
        x: [B, L] float64 compacted ratios; keep: [B, L] bool; lengths: [B] long.

    Returns:
        [4] float64: the sums (`_masked_sum`) of global_variance, then of local_variance.
    """
    n = lengths.clamp(min=1).to(torch.float64)
    mean = torch.where(keep, x, 0.0).sum(dim=1) / n
    var = torch.where(keep, (x - mean[:, None]) ** 2, 0.0).sum(dim=1) / n
    global_var = _masked_sum(var, lengths >= 1)

    xw = _to_windows(x, window, 1.0)  # [B, W, window]
    kw = _to_windows(keep, window, False)
    m = kw.sum(dim=-1)
    m_f = m.clamp(min=1).to(torch.float64)
    w_mean = torch.where(kw, xw, 0.0).sum(dim=-1) / m_f
    w_var = torch.where(kw, (xw - w_mean[..., None]) ** 2, 0.0).sum(dim=-1) / m_f
    local_var = _masked_sum(w_var, m >= 2)
    return torch.cat([global_var, local_var])


def _band_weights(n: int, lfr_cutoff: float, like: Tensor) -> tuple[Tensor, Tensor]:
    """Weights turning one-sided rfft power into two-sided band energies for length n.

    rfft returns bins k = 0..floor(n/2). For real input |X_{n-k}| = |X_k|, so every bin with
    0 < k < n/2 stands for two two-sided bins (k and n - k, both at signed frequency |k|),
    while k = n/2 (n even) stands for one. The DC bin gets weight 0 (dropped, see LFR).

    Returns:
        (w_all, w_low): [floor(n/2) + 1] float64; w_low keeps only |k| <= k_c.
    """
    k = torch.arange(n // 2 + 1, device=like.device, dtype=torch.float64)
    w_all = 2.0 - (2 * k == n).to(torch.float64)
    w_all[0] = 0.0
    # The small epsilon keeps e.g. 0.1 * 400 / 2 from flooring to 19 on rounding error.
    k_c = max(1, math.floor(lfr_cutoff * n / 2 + 1e-9))
    return w_all, torch.where(k <= k_c, w_all, 0.0)


def _low_frequency_ratio(
    x: Tensor, keep: Tensor, lengths: Tensor, host_lengths: Sequence[int], lfr_cutoff: float
) -> Tensor:
    """Low-frequency ratio (LFR): share of the ratio sequence's spectral energy at low |k|.

    For a response with n >= 2 valid ratios, let y_t = rho_t - mean(rho) and X_k = DFT(y)_k
    for k = 0..n-1 (two-sided spectrum, signed frequency |k| = min(k, n - k)). Then

        LFR = sum_{1 <= |k| <= k_c} |X_k|^2 / sum_{k != 0} |X_k|^2,
        k_c = max(1, floor(lfr_cutoff * n / 2)),

    i.e. the lowest `lfr_cutoff` fraction of the n/2 non-negative frequencies. The DC bin is
    zero after centring; it is dropped explicitly so rounding in the mean cannot count as
    low-frequency energy. A constant response (zero energy) has LFR 1.0 (perfectly smooth).
    White noise gives about 2 k_c / (n - 1) ~= lfr_cutoff. The result is the mean over
    responses with n >= 2 (0.0 if there are none). For n <= 3 every bin is low, so LFR = 1.

    A length-n DFT cannot be taken on a zero-padded row (padding changes it), so rows are
    sorted by length and each block of equal length gets one batched rfft: a Python loop over
    distinct lengths (at most B), not over tokens. On CPU this beats a single batched
    chirp-z transform, which needs three complex FFTs of size >= 2L. The blocks are found from
    the lengths on the host (`host_lengths`): nothing is read back.

    Args:
        x: [B, L] float64 compacted ratios; keep: [B, L] bool; lengths: [B] long;
        host_lengths: the same lengths on the host.

    Returns:
        [2] float64: the mean LFR's sums (`_masked_sum`).
    """
    if x.shape[1] < 2:  # no response has n >= 2 (and amax below needs a non-empty dim)
        return torch.zeros(2, dtype=torch.float64, device=x.device)
    # Sorting makes equal lengths contiguous, so each distinct length is one block and one
    # FFT. Only the batch mean is needed, so the rows can stay in sorted order throughout.
    order = torch.argsort(lengths)
    xs, ks, ns = x[order], keep[order], lengths[order]
    low_energy = torch.zeros(ns.shape, dtype=torch.float64, device=x.device)
    all_energy = torch.zeros_like(low_energy)
    # The blocks of the sorted rows (whatever order argsort gave rows of equal length).
    blocks = sorted(Counter(host_lengths).items())
    start = 0
    for n, count in blocks:
        rows = slice(start, start + count)
        start += count
        if n < 2:
            continue
        seq = xs[rows, :n]  # [G, n], all rows of length n
        power = torch.fft.rfft(seq - seq.mean(dim=1, keepdim=True), dim=1).abs().square()
        w_all, w_low = _band_weights(n, lfr_cutoff, x)
        all_energy[rows] = power @ w_all
        low_energy[rows] = power @ w_low
    # Exact constancy test: FFT rounding leaves tiny non-DC energy even for a constant y.
    seq_max = torch.where(ks, xs, -math.inf).amax(dim=1)
    constant = seq_max == torch.where(ks, xs, math.inf).amin(dim=1)
    smooth = constant | (all_energy == 0)
    lfr = torch.where(smooth, 1.0, low_energy / torch.where(smooth, 1.0, all_energy))
    return _masked_sum(lfr, ns >= 2)


def ratio_diagnostics(
    ratios: Tensor,
    mask: Tensor,
    window: int = 50,
    low: float = 3e-4,
    high: float = 4e-4,
    lfr_cutoff: float = 0.1,
) -> dict[str, float | list[float]]:
    """Structure statistics of a batch of token-level importance ratios (KPO Fig. 1, App. C).

    Args:
        ratios: [B, T] importance ratios rho (ratio values, not log-ratios).
        mask: [B, T] bool or 0/1; True/nonzero marks a valid token. Valid tokens may sit
            anywhere (left/right padding, interior holes); each response's valid tokens,
            in order and with masked ones removed, form its sequence of length n_b.
        window: window length (tokens) for window-wise statistics; windows are
            non-overlapping and start at each response's first valid token.
        low, high: token types: up if rho > 1 + high, down if rho < 1 - low, else on.
        lfr_cutoff: fraction of the frequency range counted as "low" in the LFR.

    Returns:
        switch_frequency: mean over non-empty windows of (#type changes between adjacent
            tokens in the window) / (#pairs in it); 0 for a 1-token window.
        run_length_up / run_length_down / run_length_on: mean length of maximal runs of that
            type, pooled over all runs in the batch (tokens / runs); 0.0 if absent.
        low_frequency_ratio: mean over responses with n_b >= 2 of the spectral energy share
            at |k| <= k_c = max(1, floor(lfr_cutoff * n_b / 2)); see `_low_frequency_ratio`.
        global_variance: mean over responses of the population variance of their ratios.
        local_variance: mean population variance over windows with >= 2 tokens.
        window_frequency_up / window_frequency_down: per window index j, the fraction of
            up / down tokens, averaged over responses that reach window j.
        Empty averages are 0.0; lists are empty if there are no valid tokens.

    Computed on the ratios' device, with two reads back to the host: the lengths (and the
    finiteness check), which set the shapes, then every result at once. `diagnostic_sums`
    reads nothing back when its caller knows the lengths.

    Raises:
        ValueError: on bad shapes/arguments, or NaN/inf at a valid position.
    """
    valid = _validate(ratios, mask, window, lfr_cutoff)
    # Two reads: the lengths, which set the shapes (with the finiteness check), then the results.
    n_nan, n_inf, *counts = torch.cat([_nonfinite(ratios, valid), valid.sum(dim=1)]).tolist()
    _check_finite(n_nan, n_inf)
    lengths = [int(n) for n in counts]
    x, keep, lengths_t = _compact(ratios.detach(), valid, max(lengths, default=0))
    types = token_types(x, low, high)
    sums = _sums(x, keep, lengths_t, lengths, types, window, lfr_cutoff)
    freqs = _window_frequencies(types, keep, window)
    values = torch.cat([sums, freqs.flatten()]).tolist()
    n_sums, n_windows = len(sums), freqs.shape[1]
    out: dict[str, float | list[float]] = dict(
        diagnostics_of_sums([n_nan, n_inf, *values[:n_sums]])
    )
    out["window_frequency_up"] = values[n_sums : n_sums + n_windows]
    out["window_frequency_down"] = values[n_sums + n_windows :]
    return out


def _sums(
    x: Tensor,
    keep: Tensor,
    lengths: Tensor,
    host_lengths: Sequence[int],
    types: Tensor,
    window: int,
    lfr_cutoff: float,
) -> Tensor:
    """[DIAGNOSTIC_SUMS - 2] float64: the (numerator, denominator) pairs of the scalars."""
    return torch.cat(
        [
            _switch_frequency(types, keep, window),
            _run_lengths(types, keep),
            _low_frequency_ratio(x, keep, lengths, host_lengths, lfr_cutoff),
            _variances(x, keep, lengths, window),
        ]
    )


def diagnostic_sums(
    ratios: Tensor,
    mask: Tensor,
    lengths: Sequence[int],
    window: int = 50,
    low: float = 3e-4,
    high: float = 4e-4,
    lfr_cutoff: float = 0.1,
) -> Tensor:
    """The sums behind `ratio_diagnostics`' scalars, on the ratios' device, nothing read back.

    Args:
        ratios, mask, window, low, high, lfr_cutoff: as for `ratio_diagnostics`.
        lengths: [B] on the host: each response's valid tokens (`mask`'s per row), which set
            the shapes. Wrong lengths give wrong statistics; they are not checked.

    Returns:
        [DIAGNOSTIC_SUMS] float64: the NaN and the inf ratios at valid positions, then per
        scalar of DIAGNOSTIC_SCALARS its numerator and denominator. The sums of disjoint sets
        of responses add up to the sums of their union; `diagnostics_of_sums` finishes them.

    Raises:
        ValueError: on bad shapes or arguments (non-finite ratios are counted, not raised).
    """
    valid = _validate(ratios, mask, window, lfr_cutoff)
    if len(lengths) != ratios.shape[0]:
        raise ValueError(f"lengths has {len(lengths)} entries for {ratios.shape[0]} responses")
    x, keep, lengths_t = _compact(ratios.detach(), valid, max(lengths, default=0))
    types = token_types(x, low, high)
    sums = _sums(x, keep, lengths_t, lengths, types, window, lfr_cutoff)
    return torch.cat([_nonfinite(ratios, valid), sums])


def diagnostics_of_sums(sums: Sequence[float]) -> dict[str, float]:
    """The scalar statistics of `ratio_diagnostics` from (summed) `diagnostic_sums` values.

    Raises:
        ValueError: if the sums counted a NaN or inf ratio at a valid position.
    """
    if len(sums) != DIAGNOSTIC_SUMS:
        raise ValueError(f"expected {DIAGNOSTIC_SUMS} sums, got {len(sums)}")
    _check_finite(sums[0], sums[1])
    pairs = sums[2:]
    return {
        name: _quotient(pairs[2 * i], pairs[2 * i + 1]) for i, name in enumerate(DIAGNOSTIC_SCALARS)
    }
