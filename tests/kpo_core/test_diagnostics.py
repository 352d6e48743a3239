"""Tests for kpo_core.diagnostics (KPO, arXiv 2602.10609, Figure 1 and Appendix C statistics).

Expected values are worked out by hand next to each assertion. A plain-Python reference
implementation of the definitions backs the property test.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kpo_core.diagnostics import (
    DIAGNOSTIC_SCALARS,
    DIAGNOSTIC_SUMS,
    diagnostic_sums,
    diagnostics_of_sums,
    ratio_diagnostics,
    token_types,
)

# With the default thresholds (low=3e-4, high=4e-4): UP_R > 1.0004 is up, DOWN_R < 0.9997 is
# down, ON_R is on-policy.
UP_R, DOWN_R, ON_R = 1.01, 0.99, 1.0

SCALAR_KEYS = [
    "switch_frequency",
    "run_length_up",
    "run_length_down",
    "run_length_on",
    "low_frequency_ratio",
    "global_variance",
    "local_variance",
]
LIST_KEYS = ["window_frequency_up", "window_frequency_down"]


def right_padded(seqs: list[list[float]], pad_value: float = 1e6) -> tuple[torch.Tensor, ...]:
    """[B, T] float64 ratios and bool mask with each sequence left-aligned, garbage after."""
    t = max((len(s) for s in seqs), default=0)
    ratios = torch.full((len(seqs), t), pad_value, dtype=torch.float64)
    mask = torch.zeros(len(seqs), t, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ratios[b, : len(s)] = torch.tensor(s, dtype=torch.float64)
        mask[b, : len(s)] = True
    return ratios, mask


def diag(
    seqs: list[list[float]], window: int = 50, lfr_cutoff: float = 0.1
) -> dict[str, float | list[float]]:
    ratios, mask = right_padded(seqs)
    return ratio_diagnostics(ratios, mask, window=window, lfr_cutoff=lfr_cutoff)


def scalar(d: dict[str, float | list[float]], key: str) -> float:
    v = d[key]
    assert isinstance(v, float)
    return v


def assert_same(a: dict[str, float | list[float]], b: dict[str, float | list[float]]) -> None:
    assert a.keys() == b.keys()
    for k in SCALAR_KEYS:
        assert a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-12), k
    for k in LIST_KEYS:
        assert a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-12), k


# ---------------------------------------------------------------- token types


def test_token_types_thresholds() -> None:
    r = torch.tensor([1.0 + 4e-4, 1.0 + 5e-4, 1.0 - 3e-4, 1.0 - 4e-4, 1.0], dtype=torch.float64)
    # 1+high is not > 1+high -> on; 1.0005 > 1.0004 -> up; 1-low is not < 1-low -> on;
    # 0.9996 < 0.9997 -> down; 1.0 -> on.
    assert token_types(r, 3e-4, 4e-4).tolist() == [0, 1, 0, -1, 0]


# ---------------------------------------------------------------- switching and runs


def test_alternating_up_down() -> None:
    d = diag([[UP_R, DOWN_R] * 50], window=200)
    # 100 tokens in one window, all 99 adjacent pairs differ -> 99/99 = 1.0.
    assert scalar(d, "switch_frequency") == pytest.approx(1.0)
    # 50 runs of length 1 of each type.
    assert scalar(d, "run_length_up") == pytest.approx(1.0)
    assert scalar(d, "run_length_down") == pytest.approx(1.0)
    # No on-policy token -> 0.0 by convention.
    assert scalar(d, "run_length_on") == 0.0
    # Default window 50: two windows, each 49/49 changes -> mean 1.0.
    assert scalar(diag([[UP_R, DOWN_R] * 50]), "switch_frequency") == pytest.approx(1.0)


def test_constant_on_policy() -> None:
    d = diag([[ON_R] * 60], window=100)
    # No pair differs -> 0/59 = 0.
    assert scalar(d, "switch_frequency") == 0.0
    # One run of all n = 60 tokens.
    assert scalar(d, "run_length_on") == pytest.approx(60.0)
    assert scalar(d, "run_length_up") == 0.0
    assert scalar(d, "run_length_down") == 0.0
    # Zero energy after centring -> LFR 1.0 (perfectly smooth).
    assert scalar(d, "low_frequency_ratio") == 1.0
    # All tokens identical -> zero variance everywhere.
    assert scalar(d, "global_variance") == 0.0
    assert scalar(d, "local_variance") == 0.0


def test_constant_non_round_value_is_smooth() -> None:
    # 1.0001 * 4000 is not exact in floating point, so the centred sequence has rounding
    # residue; it must still count as constant (LFR 1.0), not as noise.
    d = diag([[1.0001] * 4000])
    assert scalar(d, "low_frequency_ratio") == 1.0


def test_constant_with_rounding_residue_is_smooth() -> None:
    # mean of 400 copies of 1.1 rounds to 1.1 - 2.2e-16, so the centred sequence is a tiny
    # nonzero constant whose non-DC FFT energy is pure rounding noise (~1e-58). The exact
    # constancy test must report 1.0 instead of a ratio of rounding noise.
    assert scalar(diag([[1.1] * 400]), "low_frequency_ratio") == 1.0


def test_lfr_drops_dc_rounding_of_the_mean() -> None:
    # 1.1 + 1e-13 * (-1)^t, n = 400: all true energy at k = 200 -> LFR 0. The computed mean is
    # off by 2.2e-16, which would put (400 * 2.2e-16)^2 in the DC bin, i.e. ~5e-6 of the
    # total; dropping the DC bin keeps LFR at 0 to rounding.
    seq = [1.1 + 1e-13 * (-1) ** t for t in range(400)]
    assert scalar(diag([seq]), "low_frequency_ratio") < 1e-9


def test_constant_up() -> None:
    d = diag([[UP_R] * 30])
    # One run of 30 up tokens, no type change.
    assert scalar(d, "switch_frequency") == 0.0
    assert scalar(d, "run_length_up") == pytest.approx(30.0)


def test_hand_made_runs_and_switches() -> None:
    seq = [UP_R, UP_R, ON_R, DOWN_R, DOWN_R, DOWN_R, ON_R]  # types [+, +, 0, -, -, -, 0]
    d = diag([seq], window=7)
    # Runs: up {2} -> 2; down {3} -> 3; on {1, 1} -> 2 tokens / 2 runs = 1.
    assert scalar(d, "run_length_up") == pytest.approx(2.0)
    assert scalar(d, "run_length_down") == pytest.approx(3.0)
    assert scalar(d, "run_length_on") == pytest.approx(1.0)
    # Changes at +->0, 0->-, -->0: 3 of 6 pairs = 0.5.
    assert scalar(d, "switch_frequency") == pytest.approx(0.5)
    # window=3: windows [+,+,0] 1/2, [-,-,-] 0/2, [0] (1 token) counts 0 -> (0.5+0+0)/3.
    assert scalar(diag([seq], window=3), "switch_frequency") == pytest.approx(0.5 / 3)


def test_runs_pooled_over_runs_not_responses() -> None:
    # Response A: one up run of 4; response B: up runs of 1 and 1 (separated by on).
    d = diag([[UP_R] * 4, [UP_R, ON_R, UP_R]])
    # Pooled: 6 up tokens / 3 up runs = 2.0 (a per-response mean would give (4 + 1)/2 = 2.5).
    assert scalar(d, "run_length_up") == pytest.approx(2.0)


def test_switch_ignores_pairs_across_window_boundary() -> None:
    # 101 alternating tokens, window 50: windows of 50, 50, 1 tokens.
    # Within-window pairs all differ: 49/49, 49/49; the 1-token window counts 0 -> 2/3.
    d = diag([[UP_R, DOWN_R] * 50 + [UP_R]], window=50)
    assert scalar(d, "switch_frequency") == pytest.approx(2.0 / 3.0)
    # Boundary pairs do not count: 50 up then 50 down, window 50 -> no change inside any
    # window -> 0 (a pooled count over the response would give 1/99).
    d2 = diag([[UP_R] * 50 + [DOWN_R] * 50], window=50)
    assert scalar(d2, "switch_frequency") == 0.0


# ---------------------------------------------------------------- low-frequency ratio


def test_lfr_low_frequency_sinusoid() -> None:
    n = 400
    seq = [1 + 0.1 * math.sin(2 * math.pi * t / n) for t in range(n)]
    # All energy at |k| = 1 <= k_c = floor(0.1 * 400 / 2) = 20 -> LFR = 1.
    assert scalar(diag([seq]), "low_frequency_ratio") > 0.99


def test_lfr_white_noise_near_cutoff() -> None:
    g = torch.Generator().manual_seed(1234)
    seqs = (1 + 0.01 * torch.randn(4, 400, generator=g, dtype=torch.float64)).tolist()
    # Flat spectrum: 40 of the 399 non-DC bins (|k| in 1..20) -> about 40/399 = 0.1.
    lfr = scalar(diag(seqs), "low_frequency_ratio")
    assert 0.03 < lfr < 0.25


def test_lfr_alternating_is_high_frequency() -> None:
    # 1 + 0.01 * (-1)^t, n = 100: all energy at k = n/2 = 50 > k_c = 5 -> LFR = 0.
    d = diag([[1.01, 0.99] * 50])
    assert scalar(d, "low_frequency_ratio") < 1e-12


def test_lfr_cutoff_is_inclusive_at_k_c() -> None:
    n = 100  # k_c = max(1, floor(0.1 * 100 / 2)) = 5

    def cosine(k: int) -> list[float]:
        return [1 + 0.01 * math.cos(2 * math.pi * k * t / n) for t in range(n)]

    # Frequency 5 = k_c is inside the low band -> 1; frequency 6 is outside -> 0.
    assert scalar(diag([cosine(5)]), "low_frequency_ratio") == pytest.approx(1.0)
    assert scalar(diag([cosine(6)]), "low_frequency_ratio") == pytest.approx(0.0, abs=1e-12)
    # lfr_cutoff=0.2 -> k_c = 10, so frequency 6 becomes low.
    d = diag([cosine(6)], lfr_cutoff=0.2)
    assert scalar(d, "low_frequency_ratio") == pytest.approx(1.0)


def test_lfr_nyquist_bin_counted_once() -> None:
    # n = 4, k_c = max(1, floor(0.1 * 4 / 2)) = 1. y = a cos(pi t / 2) + b (-1)^t with
    # a = b = 0.01 gives rho = 1 + y = [1.02, 0.99, 1.00, 0.99] (mean 1). Two-sided energies:
    # |X_1|^2 = |X_3|^2 = (a n / 2)^2 = 4a^2 (low), |X_2|^2 = (b n)^2 = 16b^2 (Nyquist, high,
    # a single bin). LFR = 8a^2 / (8a^2 + 16b^2) = 1/3.
    d = diag([[1.02, 0.99, 1.00, 0.99]])
    assert scalar(d, "low_frequency_ratio") == pytest.approx(1.0 / 3.0)


def test_lfr_averages_over_responses_of_different_lengths() -> None:
    smooth = [1 + 0.1 * math.sin(2 * math.pi * t / 200) for t in range(200)]  # LFR 1
    rough = [1.01, 0.99] * 30  # LFR 0 (n = 60, all energy at k = 30)
    single = [1.5]  # n = 1 < 2: excluded from the LFR average
    # (1 + 0) / 2 = 0.5.
    d = diag([smooth, rough, single])
    assert scalar(d, "low_frequency_ratio") == pytest.approx(0.5, abs=1e-9)


# ---------------------------------------------------------------- window frequency


def test_window_frequency_single_response() -> None:
    d = diag([[UP_R] * 50 + [DOWN_R] * 50], window=50)
    # Window 0 all up, window 1 all down.
    assert d["window_frequency_up"] == pytest.approx([1.0, 0.0])
    assert d["window_frequency_down"] == pytest.approx([0.0, 1.0])


def test_window_frequency_averages_over_responses_reaching_window() -> None:
    # A: 100 up tokens (windows 0, 1). B: 30 down tokens (window 0 only, partially filled).
    d = diag([[UP_R] * 100, [DOWN_R] * 30], window=50)
    # Window 0: up (1 + 0)/2 = 0.5, down (0 + 1)/2 = 0.5. Window 1: only A -> up 1, down 0.
    assert d["window_frequency_up"] == pytest.approx([0.5, 1.0])
    assert d["window_frequency_down"] == pytest.approx([0.5, 0.0])


def test_window_frequency_partial_window_uses_own_length() -> None:
    # 70 tokens, window 50: last window has 20 tokens, 5 of them up -> 5/20 = 0.25.
    seq = [ON_R] * 50 + [UP_R] * 5 + [ON_R] * 15
    d = diag([seq], window=50)
    assert d["window_frequency_up"] == pytest.approx([0.0, 0.25])
    assert d["window_frequency_down"] == pytest.approx([0.0, 0.0])


# ---------------------------------------------------------------- variances


def test_global_and_local_variance_hand_worked() -> None:
    d = diag([[1.0, 1.2, 0.8, 1.0], [2.0, 2.0, 2.0]], window=2)
    # A: mean 1, deviations (0, .2, -.2, 0) -> var 0.08/4 = 0.02. B: var 0.
    # Global = (0.02 + 0) / 2 = 0.01.
    assert scalar(d, "global_variance") == pytest.approx(0.01)
    # Windows: A [1, 1.2] var 0.01, A [.8, 1] var 0.01, B [2, 2] var 0, B [2] (1 token,
    # excluded) -> (0.01 + 0.01 + 0) / 3.
    assert scalar(d, "local_variance") == pytest.approx(0.02 / 3)


# ---------------------------------------------------------------- masking


def layouts(seq: list[float], garbage: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same sequence with right padding, left padding and interior holes."""
    n, pad = len(seq), 7
    s = torch.tensor(seq, dtype=torch.float64)
    out = []
    for kind in ("right", "left", "holes"):
        r = torch.full((n + pad,), garbage, dtype=torch.float64)
        m = torch.zeros(n + pad, dtype=torch.bool)
        if kind == "right":
            pos = torch.arange(n)
        elif kind == "left":
            pos = torch.arange(pad, n + pad)
        else:  # holes at interior positions 1, 4, 5, 9 and at the ends
            holes = {0, 1, 4, 5, 9, n + pad - 2, n + pad - 1}
            pos = torch.tensor([i for i in range(n + pad) if i not in holes])
        r[pos] = s
        m[pos] = True
        out.append((r, m))
    return out


@pytest.mark.parametrize("garbage", [1e6, 0.0, float("nan"), float("inf")])
def test_padding_layout_does_not_matter(garbage: float) -> None:
    seq_a = [UP_R, UP_R, ON_R, DOWN_R, 1.003, 0.998, ON_R, UP_R, DOWN_R, 1.0002, 0.9, 1.1]
    seq_b = [ON_R, DOWN_R, DOWN_R, UP_R, 0.97, 1.02, 1.0, 1.0, 0.999, 1.001, UP_R, ON_R]
    results = []
    for (ra, ma), (rb, mb) in zip(layouts(seq_a, garbage), layouts(seq_b, garbage), strict=True):
        results.append(ratio_diagnostics(torch.stack([ra, rb]), torch.stack([ma, mb]), window=5))
    reference = diag([seq_a, seq_b], window=5)
    for r in results:
        assert_same(r, reference)


def test_integer_mask_equals_bool_mask() -> None:
    ratios = torch.tensor([[1.01, 0.99, 5.0, 1.0], [1.0, 1.0, 1.02, 7.0]])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]])
    assert_same(ratio_diagnostics(ratios, mask), ratio_diagnostics(ratios, mask.bool()))


def test_nan_in_valid_position_raises() -> None:
    ratios = torch.tensor([[1.0, float("nan"), 1.0]])
    with pytest.raises(ValueError, match="NaN"):
        ratio_diagnostics(ratios, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="inf"):
        ratio_diagnostics(torch.tensor([[1.0, float("inf")]]), torch.ones(1, 2))


def test_nan_in_masked_position_is_ignored() -> None:
    ratios = torch.tensor([[UP_R, float("nan"), DOWN_R, float("-inf")]], dtype=torch.float64)
    mask = torch.tensor([[True, False, True, False]])
    d = ratio_diagnostics(ratios, mask)
    assert_same(d, diag([[UP_R, DOWN_R]]))
    # Valid tokens [up, down]: 1 change over 1 pair; population variance of {1.01, 0.99} is
    # 0.01^2 = 1e-4.
    assert scalar(d, "switch_frequency") == pytest.approx(1.0)
    assert scalar(d, "global_variance") == pytest.approx(1e-4)


def test_empty_and_fully_masked() -> None:
    d = ratio_diagnostics(torch.full((2, 5), 3.0), torch.zeros(2, 5, dtype=torch.bool))
    # No valid token: every average is empty -> 0.0, no windows -> empty lists.
    assert all(d[k] == 0.0 for k in SCALAR_KEYS)
    assert d["window_frequency_up"] == []
    assert d["window_frequency_down"] == []
    d0 = ratio_diagnostics(torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool))
    assert d0["window_frequency_up"] == []


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="shape"):
        ratio_diagnostics(torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="2-D"):
        ratio_diagnostics(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="window"):
        ratio_diagnostics(torch.ones(2, 3), torch.ones(2, 3), window=0)
    with pytest.raises(ValueError, match="lfr_cutoff"):
        ratio_diagnostics(torch.ones(2, 3), torch.ones(2, 3), lfr_cutoff=0.0)


# ---------------------------------------------------------------- reference + property


def reference(
    seqs: list[list[float]], window: int, low: float = 3e-4, high: float = 4e-4, cutoff: float = 0.1
) -> dict[str, float | list[float]]:
    """Token-by-token transcription of the definitions (slow, obviously correct)."""
    types = [[1 if r > 1 + high else -1 if r < 1 - low else 0 for r in s] for s in seqs]
    wins = [[s[i : i + window] for i in range(0, len(s), window)] for s in types]
    all_wins = [w for ws in wins for w in ws]
    switch = [
        sum(a != b for a, b in itertools.pairwise(w)) / (len(w) - 1) if len(w) > 1 else 0.0
        for w in all_wins
    ]
    runs: dict[int, list[int]] = {1: [], -1: [], 0: []}
    for ts in types:
        for tau, grp in itertools.groupby(ts):
            runs[tau].append(len(list(grp)))

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    lfrs = []
    for s in seqs:
        n = len(s)
        if n < 2:
            continue
        arr = np.asarray(s)
        if arr.max() == arr.min():
            lfrs.append(1.0)
            continue
        e = np.abs(np.fft.fft(arr - arr.mean())) ** 2
        e[0] = 0.0
        k_c = max(1, math.floor(cutoff * n / 2 + 1e-9))
        low_band = [e[k] for k in range(n) if min(k, n - k) <= k_c]
        lfrs.append(float(sum(low_band) / e.sum()))
    n_w = max((len(ws) for ws in wins), default=0)
    freq = {
        tau: [
            mean([sum(t == tau for t in ws[j]) / len(ws[j]) for ws in wins if len(ws) > j])
            for j in range(n_w)
        ]
        for tau in (1, -1)
    }
    rwins = [s[i : i + window] for s in seqs for i in range(0, len(s), window)]
    return {
        "switch_frequency": mean(switch),
        "run_length_up": mean([float(x) for x in runs[1]]),
        "run_length_down": mean([float(x) for x in runs[-1]]),
        "run_length_on": mean([float(x) for x in runs[0]]),
        "low_frequency_ratio": mean(lfrs),
        "global_variance": mean([float(np.var(s)) for s in seqs if s]),
        "local_variance": mean([float(np.var(w)) for w in rwins if len(w) >= 2]),
        "window_frequency_up": freq[1],
        "window_frequency_down": freq[-1],
    }


def test_reference_agrees_on_hand_example() -> None:
    seq = [UP_R, UP_R, ON_R, DOWN_R, DOWN_R, DOWN_R, ON_R]
    assert_same(diag([seq], window=3), reference([seq], window=3))


ratio_values = st.one_of(
    st.sampled_from([0.99, 0.9997, 1.0, 1.0002, 1.0004, 1.01]),
    st.floats(0.98, 1.02, allow_nan=False),
)


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(st.lists(ratio_values, min_size=0, max_size=25), min_size=1, max_size=4),
    window=st.integers(1, 8),
    extra=st.integers(0, 6),
    seed=st.integers(0, 2**32 - 1),
    garbage=st.sampled_from([1e6, 0.0, -1.0, float("nan")]),
)
def test_property_layout_invariance_and_bounds(
    seqs: list[list[float]], window: int, extra: int, seed: int, garbage: float
) -> None:
    # Scatter each response's tokens, in order, over random positions of a wider row.
    rng = np.random.default_rng(seed)
    t = max(len(s) for s in seqs) + extra
    ratios = torch.full((len(seqs), t), garbage, dtype=torch.float64)
    mask = torch.zeros(len(seqs), t, dtype=torch.bool)
    for b, s in enumerate(seqs):
        pos = torch.from_numpy(np.sort(rng.choice(t, size=len(s), replace=False)))
        ratios[b, pos] = torch.tensor(s, dtype=torch.float64)
        mask[b, pos] = True
    scattered = ratio_diagnostics(ratios, mask, window=window)
    assert_same(scattered, diag(seqs, window=window))
    expected = reference(seqs, window)
    for k in SCALAR_KEYS:
        assert scattered[k] == pytest.approx(expected[k], rel=1e-9, abs=1e-9), k
    for k in LIST_KEYS:
        assert scattered[k] == pytest.approx(expected[k], rel=1e-9, abs=1e-12), k
    assert 0.0 <= scalar(scattered, "switch_frequency") <= 1.0
    assert 0.0 <= scalar(scattered, "low_frequency_ratio") <= 1.0 + 1e-12


# ---------------------------------------------------------------- sums


def random_batch(seed: int, rows: int = 9, width: int = 130) -> tuple[torch.Tensor, ...]:
    """[rows, width] ratios near 1 (float32, as the learner logs them) and a ragged mask."""
    gen = torch.Generator().manual_seed(seed)
    ratios = 1.0 + 1e-3 * torch.randn(rows, width, generator=gen)
    mask = torch.rand(rows, width, generator=gen) < torch.rand(rows, 1, generator=gen)
    ratios[~mask] = float("nan")  # garbage off the mask
    return ratios, mask


def test_diagnostics_of_sums_are_ratio_diagnostics() -> None:
    ratios, mask = random_batch(0)
    lengths = mask.sum(dim=1).tolist()
    sums = diagnostic_sums(ratios, mask, lengths, window=7)
    assert sums.shape == (DIAGNOSTIC_SUMS,) and sums.dtype == torch.float64
    expected = ratio_diagnostics(ratios, mask, window=7)
    # The same operations: equal to the last bit.
    assert diagnostics_of_sums(sums.tolist()) == {k: expected[k] for k in DIAGNOSTIC_SCALARS}


def test_sums_of_disjoint_rows_add_up_to_those_of_their_union() -> None:
    ratios, mask = random_batch(1)
    parts = [[0, 4, 5], [1, 2, 3, 6], [7, 8]]
    total = sum(
        diagnostic_sums(ratios[rows], mask[rows], mask[rows].sum(dim=1).tolist()) for rows in parts
    )
    assert isinstance(total, torch.Tensor)
    pooled = diagnostics_of_sums(total.tolist())
    expected = ratio_diagnostics(ratios, mask)
    for key in DIAGNOSTIC_SCALARS:
        assert pooled[key] == pytest.approx(expected[key], rel=1e-12, abs=1e-15), key


def test_sums_count_nonfinite_ratios_and_their_diagnostics_raise() -> None:
    ratios = torch.tensor([[1.0, float("nan"), float("inf"), float("-inf"), 7.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    sums = diagnostic_sums(ratios, mask, [4])
    assert sums[:2].tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="1 NaN, 2 inf"):
        diagnostics_of_sums(sums.tolist())
    with pytest.raises(ValueError, match="lengths"):
        diagnostic_sums(ratios, mask, [4, 4])
    with pytest.raises(ValueError, match="sums"):
        diagnostics_of_sums([0.0])


def test_sums_of_no_row_are_zero() -> None:
    sums = diagnostic_sums(torch.ones(0, 5), torch.zeros(0, 5, dtype=torch.bool), [])
    assert sums.tolist() == [0.0] * DIAGNOSTIC_SUMS
    assert diagnostics_of_sums(sums.tolist()) == dict.fromkeys(DIAGNOSTIC_SCALARS, 0.0)
