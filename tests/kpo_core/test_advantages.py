"""Tests for kpo_core.advantages: GRPO / Dr.GRPO / RLOO group-relative advantages."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kpo_core.advantages import AdvantageMode, broadcast_to_tokens, group_advantages

EPS = 1e-6
MODES: tuple[AdvantageMode, ...] = ("grpo", "dr_grpo", "rloo")


def f64(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def ids(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# Python-loop reference (exact statistics via the `statistics` module, fractions inside)
# --------------------------------------------------------------------------------------------


def reference(
    rewards: list[float], group_ids: list[int], mode: str, eps: float, unbiased: bool
) -> list[float]:
    out = [0.0] * len(rewards)
    for g in set(group_ids):
        members = [i for i, gid in enumerate(group_ids) if gid == g]
        vals = [rewards[i] for i in members]
        size = len(vals)
        if size == 1 or all(v == vals[0] for v in vals):
            continue  # no baseline / no signal -> 0
        mean = statistics.fmean(vals)
        for i in members:
            if mode == "dr_grpo":
                out[i] = rewards[i] - mean
            elif mode == "rloo":
                others = [rewards[j] for j in members if j != i]
                out[i] = rewards[i] - statistics.fmean(others)
            else:
                std = statistics.stdev(vals) if unbiased else statistics.pstdev(vals)
                out[i] = (rewards[i] - mean) / (std + eps)
    return out


# --------------------------------------------------------------------------------------------
# Hand-computed values
# --------------------------------------------------------------------------------------------


def test_grpo_single_group_unbiased_std() -> None:
    adv = group_advantages(f64([1.0, 0.0, 0.0, 1.0]), ids([0, 0, 0, 0]), "grpo")
    # mean 0.5, centred ±0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = sqrt(1/3) = 0.5773503
    # A = ±0.5 / (0.5773503 + 1e-6) = ±0.8660239 (±0.8660254 without eps)
    a = 0.5 / (math.sqrt(1.0 / 3.0) + EPS)
    assert a == pytest.approx(0.8660239, abs=1e-7)
    torch.testing.assert_close(adv, f64([a, -a, -a, a]), rtol=0, atol=1e-12)


def test_grpo_single_group_population_std() -> None:
    adv = group_advantages(f64([1.0, 0.0, 0.0, 1.0]), ids([5, 5, 5, 5]), std_unbiased=False)
    # population var = 4 * 0.25 / 4 = 0.25, std = 0.5 -> A = ±0.5 / (0.5 + 1e-6) = ±0.999998
    a = 0.5 / (0.5 + EPS)
    torch.testing.assert_close(adv, f64([a, -a, -a, a]), rtol=0, atol=1e-12)


def test_grpo_eps_zero_matches_pure_zscore() -> None:
    adv = group_advantages(f64([1.0, 0.0, 0.0, 1.0]), ids([0, 0, 0, 0]), eps=0.0)
    # 0.5 / sqrt(1/3) = sqrt(3) / 2 = 0.8660254
    a = math.sqrt(3.0) / 2.0
    torch.testing.assert_close(adv, f64([a, -a, -a, a]), rtol=0, atol=1e-12)


# Shuffled, non-contiguous, negative ids; group sizes 3, 2, 2, 1:
#   idx: 0   1   2   3   4   5   6    7
#   id:  7  -3   7  42  -3   7  42  1000
#   r:   1   2   0   5   4   2   5   3.7
# group 7  (idx 0,2,5): r [1,0,2], mean 1, centred [0,-1,1], unbiased var 2/2 = 1, std 1
# group -3 (idx 1,4):   r [2,4],   mean 3, centred [-1,1],   unbiased var 2/1 = 2, std 1.4142136
# group 42 (idx 3,6):   r [5,5],   constant -> 0
# group 1000 (idx 7):   size 1 -> 0
MIXED_R = [1.0, 2.0, 0.0, 5.0, 4.0, 2.0, 5.0, 3.7]
MIXED_IDS = [7, -3, 7, 42, -3, 7, 42, 1000]


def test_grpo_shuffled_ids_unequal_sizes() -> None:
    adv = group_advantages(f64(MIXED_R), ids(MIXED_IDS), "grpo")
    one = 1.0 / (1.0 + EPS)  # group 7: ±1 / (1 + 1e-6) = ±0.999999
    s2 = 1.0 / (math.sqrt(2.0) + EPS)  # group -3: ±1 / (1.4142136 + 1e-6) = ±0.7071063
    expected = f64([0.0, -s2, -one, 0.0, s2, one, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    assert adv[3] == 0.0 and adv[6] == 0.0 and adv[7] == 0.0  # exactly, not approximately


def test_dr_grpo_shuffled_ids_unequal_sizes() -> None:
    adv = group_advantages(f64(MIXED_R), ids(MIXED_IDS), "dr_grpo")
    # r - mean_g: group 7 [0,-1,1] at idx 0,2,5; group -3 [-1,1] at idx 1,4; rest 0
    expected = f64([0.0, -1.0, -1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_rloo_shuffled_ids_unequal_sizes() -> None:
    adv = group_advantages(f64(MIXED_R), ids(MIXED_IDS), "rloo")
    # group 7: idx0 1 - mean(0,2)=0; idx2 0 - mean(1,2) = -1.5; idx5 2 - mean(1,0) = 1.5
    # group -3: idx1 2 - 4 = -2; idx4 4 - 2 = 2;  group 42 and the singleton: 0
    expected = f64([0.0, -2.0, -1.5, 0.0, 2.0, 1.5, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_rloo_hand_value() -> None:
    adv = group_advantages(f64([1.0, 0.0, 0.0]), ids([3, 3, 3]), "rloo")
    # 1 - mean(0,0) = 1; 0 - mean(1,0) = -0.5 (twice); = 3/2 * (r - 1/3)
    torch.testing.assert_close(adv, f64([1.0, -0.5, -0.5]), rtol=0, atol=1e-12)


def test_dr_grpo_hand_value() -> None:
    adv = group_advantages(f64([1.0, 0.0, 0.0]), ids([3, 3, 3]), "dr_grpo")
    # mean 1/3 -> [2/3, -1/3, -1/3]
    torch.testing.assert_close(adv, f64([2 / 3, -1 / 3, -1 / 3]), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Degenerate groups
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_zero_variance_groups_exactly_zero(
    mode: AdvantageMode, dtype: torch.dtype, eps: float
) -> None:
    # 0.1 + 0.1 + 0.1 = 0.30000000000000004 and / 3 != 0.1, so a naive r - mean leaves a
    # ~1e-17 residue; with eps = 0 it would be divided by a ~1e-17 std -> O(1) garbage.
    r = torch.tensor([0.1, 0.1, 0.1, 7.3, 7.3, 1.0, 0.0], dtype=dtype)
    g = ids([0, 0, 0, 1, 1, 2, 2])
    adv = group_advantages(r, g, mode, eps=eps)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[:5], torch.zeros(5, dtype=dtype))  # exactly 0
    assert (adv[5] > 0).item() and (adv[6] < 0).item()  # the non-constant group is untouched


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("unbiased", [True, False])
def test_group_of_size_one_is_zero(mode: AdvantageMode, unbiased: bool) -> None:
    # Bessel std of one sample is 0/0 = NaN in torch.std; here it must give advantage 0.
    adv = group_advantages(f64([3.0, 1.0, 2.0]), ids([10, 20, 30]), mode, std_unbiased=unbiased)
    assert torch.equal(adv, torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("mode", MODES)
def test_all_singletons_and_constant_with_eps_zero(mode: AdvantageMode) -> None:
    adv = group_advantages(f64([2.0]), ids([0]), mode, eps=0.0)
    assert torch.equal(adv, f64([0.0]))


@pytest.mark.parametrize("mode", MODES)
def test_empty_input(mode: AdvantageMode) -> None:
    adv = group_advantages(torch.empty(0), torch.empty(0, dtype=torch.int64), mode)
    assert adv.shape == (0,) and adv.dtype == torch.float32


# --------------------------------------------------------------------------------------------
# Dtypes
# --------------------------------------------------------------------------------------------


def test_integer_rewards_give_float32() -> None:
    adv = group_advantages(torch.tensor([1, 0, 0, 1]), ids([0, 0, 0, 0]))
    assert adv.dtype == torch.float32
    a = 0.5 / (math.sqrt(1.0 / 3.0) + EPS)  # 0.8660239, as in the float test above
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a]), rtol=0, atol=1e-6)


def test_bool_rewards_give_float32() -> None:
    r = torch.tensor([True, False, False])
    adv = group_advantages(r, ids([1, 1, 1]), "rloo")
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_float_dtype_preserved(dtype: torch.dtype) -> None:
    r = torch.tensor([1.0, 0.0, 0.0], dtype=dtype)
    adv = group_advantages(r, ids([0, 0, 0]), "dr_grpo")
    assert adv.dtype == dtype
    # [2/3, -1/3, -1/3] to the dtype's precision
    torch.testing.assert_close(adv.double(), f64([2 / 3, -1 / 3, -1 / 3]), rtol=0, atol=1e-2)


@pytest.mark.parametrize("id_dtype", [torch.int8, torch.int32, torch.int64, torch.uint8])
def test_group_id_integer_dtypes(id_dtype: torch.dtype) -> None:
    adv = group_advantages(f64([1.0, 0.0, 0.0]), torch.tensor([2, 2, 2], dtype=id_dtype), "rloo")
    torch.testing.assert_close(adv, f64([1.0, -0.5, -0.5]), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_nan_and_inf_raise_with_count_and_first_index() -> None:
    r = f64([0.0, 1.0, float("nan"), 1.0, float("inf"), float("-inf")])
    with pytest.raises(ValueError, match=r"3 non-finite.*index 2"):
        group_advantages(r, ids([0, 0, 0, 0, 1, 1]))


def test_single_nan_raises() -> None:
    with pytest.raises(ValueError, match=r"1 non-finite.*index 0"):
        group_advantages(f64([float("nan"), 1.0]), ids([0, 0]), "dr_grpo")


def test_length_mismatch_names_group_ids() -> None:
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(f64([1.0, 2.0, 3.0]), ids([0, 0]))


def test_2d_rewards_raise() -> None:
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        group_advantages(torch.zeros(2, 3), ids([0, 0]))


def test_2d_group_ids_raise() -> None:
    with pytest.raises(ValueError, match="group_ids must be 1-D"):
        group_advantages(torch.zeros(4), torch.zeros(2, 2, dtype=torch.int64))


def test_float_group_ids_raise() -> None:
    with pytest.raises(ValueError, match="group_ids must be an integer"):
        group_advantages(torch.zeros(2), torch.zeros(2))


def test_bad_mode_raises() -> None:
    with pytest.raises(ValueError, match="mode"):
        group_advantages(torch.zeros(2), ids([0, 0]), "ppo")  # type: ignore[arg-type]


@pytest.mark.parametrize("eps", [-1e-6, float("nan"), float("inf")])
def test_bad_eps_raises(eps: float) -> None:
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(2), ids([0, 0]), eps=eps)


def test_bad_nonfinite_policy_raises() -> None:
    with pytest.raises(ValueError, match="nonfinite"):
        group_advantages(torch.zeros(2), ids([0, 0]), nonfinite="ignore")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# nonfinite="drop": NaN/inf rewards leave their group
# --------------------------------------------------------------------------------------------

BAD = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("unbiased", [True, False])
def test_drop_is_the_group_without_the_bad_reward(
    mode: AdvantageMode, unbiased: bool, bad: float
) -> None:
    rewards = [1.0, bad, 0.0, 0.5, bad, 2.0, 0.0, 1.0]
    group_ids = [0, 0, 0, 0, 1, 1, 1, 1]
    adv = group_advantages(f64(rewards), ids(group_ids), mode, EPS, unbiased, nonfinite="drop")
    kept = [i for i, r in enumerate(rewards) if math.isfinite(r)]
    expected = reference(
        [rewards[i] for i in kept], [group_ids[i] for i in kept], mode, EPS, unbiased
    )
    torch.testing.assert_close(adv[kept], f64(expected), rtol=0, atol=1e-12)
    assert adv[1].item() == 0.0 and adv[4].item() == 0.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drop_leaves_groups_without_a_baseline_at_zero(
    mode: AdvantageMode, unbiased: bool, dtype: torch.dtype
) -> None:
    nan = float("nan")
    rewards = torch.tensor(
        [nan, nan, float("inf"), 1.0, nan, 0.1, 0.1, 0.1, nan, 3.0, 1.0], dtype=dtype
    )
    # group 0: nothing finite; 1: one finite reward; 2: constant finite rewards; 3: a signal.
    group_ids = ids([0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3])
    adv = group_advantages(rewards, group_ids, mode, 0.0, unbiased, nonfinite="drop")
    assert adv.dtype == dtype and torch.isfinite(adv).all()
    assert torch.equal(adv[:9], torch.zeros(9, dtype=dtype))  # exactly 0, even with eps = 0
    assert adv[9].item() > 0 > adv[10].item()


def test_drop_with_only_finite_rewards_changes_nothing() -> None:
    r, g = f64([1.0, 0.0, 0.0, 0.5, 2.0]), ids([0, 0, 0, 1, 1])
    for mode in MODES:
        assert torch.equal(
            group_advantages(r, g, mode, nonfinite="drop"), group_advantages(r, g, mode)
        )


# --------------------------------------------------------------------------------------------
# Properties on random data
# --------------------------------------------------------------------------------------------

_reward = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False, allow_infinity=False)
# Few distinct values so that constant groups and ties occur often.
_reward_or_tie = st.one_of(_reward, st.sampled_from([0.0, 1.0, 0.5]))
_group_id = st.sampled_from([-(10**9), -7, 0, 3, 42, 10**12])


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[float], list[int]]:
    n = draw(st.integers(min_value=1, max_value=24))
    r = draw(st.lists(_reward_or_tie, min_size=n, max_size=n))
    g = draw(st.lists(_group_id, min_size=n, max_size=n))
    return r, g


@settings(max_examples=150, deadline=None)
@given(
    batch=batches(),
    mode=st.sampled_from(MODES),
    unbiased=st.booleans(),
)
def test_matches_python_loop_reference(
    batch: tuple[list[float], list[int]], mode: AdvantageMode, unbiased: bool
) -> None:
    r, g = batch
    adv = group_advantages(f64(r), ids(g), mode, eps=EPS, std_unbiased=unbiased)
    expected = f64(reference(r, g, mode, EPS, unbiased))
    # float64 rounding (~1e-15) amplified at most by 1 / eps = 1e6 in grpo mode
    torch.testing.assert_close(adv, expected, rtol=1e-7, atol=1e-7)


@settings(max_examples=100, deadline=None)
@given(batch=batches(), mode=st.sampled_from(("dr_grpo", "rloo")))
def test_group_sums_are_zero(batch: tuple[list[float], list[int]], mode: AdvantageMode) -> None:
    # sum_i (r_i - mean_g) = 0, and rloo is that times G / (G - 1)
    r, g = batch
    adv = group_advantages(f64(r), ids(g), mode).tolist()
    for gid in set(g):
        total = sum(a for a, x in zip(adv, g, strict=True) if x == gid)
        assert abs(total) < 1e-12


@settings(max_examples=60, deadline=None)
@given(batch=batches(), mode=st.sampled_from(MODES), seed=st.integers(0, 2**31 - 1))
def test_permutation_and_relabel_equivariance(
    batch: tuple[list[float], list[int]], mode: AdvantageMode, seed: int
) -> None:
    # Shuffling responses permutes the advantages; renaming group ids changes nothing.
    r, g = batch
    base = group_advantages(f64(r), ids(g), mode)
    perm = torch.randperm(len(r), generator=torch.Generator().manual_seed(seed))
    relabelled = ids(g)[perm] * 3 - 5  # an injective renaming
    shuffled = group_advantages(f64(r)[perm], relabelled, mode)
    torch.testing.assert_close(shuffled, base[perm], rtol=1e-9, atol=1e-9)


def test_rloo_is_scaled_dr_grpo() -> None:
    # A_rloo = G / (G - 1) * A_dr_grpo with G = 4 here -> factor 4/3
    r = f64([0.3, 1.7, -2.0, 0.9])
    g = ids([1, 1, 1, 1])
    torch.testing.assert_close(
        group_advantages(r, g, "rloo"), group_advantages(r, g, "dr_grpo") * (4 / 3)
    )


def test_float32_large_batch_close_to_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(4096, generator=gen, dtype=torch.float64)
    g = torch.randint(0, 256, (4096,), generator=gen)
    for mode in MODES:
        a64 = group_advantages(r, g, mode)
        a32 = group_advantages(r.float(), g, mode)
        assert a32.dtype == torch.float32
        torch.testing.assert_close(a32.double(), a64, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# broadcast_to_tokens
# --------------------------------------------------------------------------------------------


def test_broadcast_per_response() -> None:
    adv = torch.tensor([0.5, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # row b gets A_b where the mask is 1, 0 at padding
    expected = torch.tensor([[0.5, 0.5, 0.0], [-1.0, 0.0, 0.0]])
    out = broadcast_to_tokens(adv, mask)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)


def test_broadcast_bool_mask_keeps_advantage_dtype() -> None:
    adv = f64([2.0, 3.0])
    mask = torch.tensor([[True, False], [False, True]])
    out = broadcast_to_tokens(adv, mask)
    assert out.dtype == torch.float64
    assert torch.equal(out, torch.tensor([[2.0, 0.0], [0.0, 3.0]], dtype=torch.float64))


def test_broadcast_already_per_token_only_masks() -> None:
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    expected = torch.tensor([[1.0, 0.0, 3.0], [0.0, 5.0, 6.0]])
    assert torch.equal(broadcast_to_tokens(adv, mask), expected)


def test_broadcast_output_is_writable_copy() -> None:
    adv = torch.tensor([1.0, 2.0])
    out = broadcast_to_tokens(adv, torch.ones(2, 3))
    out[0, 0] = 99.0  # an expand() view would alias all of row 0 (or refuse the write)
    assert adv[0] == 1.0 and out[0, 1] == 1.0


@pytest.mark.parametrize(
    ("adv_shape", "mask_shape", "name"),
    [
        ((3,), (2, 4), "advantages"),  # B mismatch
        ((2, 5), (2, 4), "advantages"),  # T mismatch
        ((2, 4, 1), (2, 4), "advantages"),  # 3-D advantages
        ((2,), (2,), "mask"),  # 1-D mask
        ((2,), (2, 4, 1), "mask"),  # 3-D mask
    ],
)
def test_broadcast_wrong_shapes_raise(
    adv_shape: tuple[int, ...], mask_shape: tuple[int, ...], name: str
) -> None:
    with pytest.raises(ValueError, match=name):
        broadcast_to_tokens(torch.zeros(adv_shape), torch.ones(mask_shape))


@pytest.mark.parametrize("mode", MODES)
def test_a_host_group_count_gives_the_same_advantages(mode: AdvantageMode) -> None:
    # Group indices 0..4 of which 2 has no response; a NaN reward dropped in group 3.
    rewards = f64([1.0, 0.0, 0.5, 2.0, 2.0, float("nan"), 1.0, 0.0, 3.0, 0.25])
    group_ids = ids([0, 0, 0, 1, 1, 3, 3, 3, 4, 4])
    looked_up = group_advantages(rewards, group_ids, mode, nonfinite="drop")
    known = group_advantages(rewards, group_ids, mode, nonfinite="drop", num_groups=5)
    assert torch.equal(known, looked_up)
    with pytest.raises(ValueError, match="num_groups"):
        group_advantages(rewards, group_ids, mode, nonfinite="drop", num_groups=-1)
