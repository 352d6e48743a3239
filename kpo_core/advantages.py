"""Group-relative advantages for critic-free policy optimisation of LLMs.

Every prompt is sampled ``G`` times; the ``G`` responses form a *group* and each response's
scalar reward ``r_i`` is compared only with the other members of its own group, so no learned
value function (critic) is needed.

Estimators (``mean_g``, ``std_g``: mean and standard deviation of the rewards in the group ``g``
that response ``i`` belongs to, ``G``: its size):

* ``"grpo"`` -- GRPO, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
  Language Models" (Shao et al., arXiv 2402.03300), outcome supervision::

      A_i = (r_i - mean_g) / (std_g + eps)

  ``std_g`` has Bessel's correction by default (``torch.std``'s default, as in verl).
* ``"dr_grpo"`` -- Dr. GRPO, "Understanding R1-Zero-Like Training: A Critical Perspective"
  (Liu et al., arXiv 2503.20783). Dividing by ``std_g`` up-weights groups whose rewards barely
  vary (nearly all right or all wrong) -- a question-level difficulty bias -- so Dr. GRPO keeps
  only the mean baseline::

      A_i = r_i - mean_g

* ``"rloo"`` -- REINFORCE leave-one-out (Kool et al., 2019; Ahmadian et al., arXiv 2402.14740):
  the baseline of ``r_i`` is the mean of the *other* ``G - 1`` rewards, which keeps it
  independent of response ``i`` and so the policy-gradient estimate unbiased::

      A_i = r_i - (sum_g - r_i) / (G - 1) = G / (G - 1) * (r_i - mean_g)

Conventions shared by all modes:

* A group with a single response has no baseline to compare with: its advantage is 0.
* A group whose rewards are all equal carries no learning signal: its advantages are exactly 0
  (never a rounding residue, never NaN/inf), even with ``eps = 0``.
* A NaN/inf reward (a verifier bug) is an error by default (``nonfinite="raise"``). With
  ``nonfinite="drop"`` that response is left out of its group: the group's statistics are those
  of its finite rewards (its size ``G`` counts only them), and the response's advantage is 0.

The computation is vectorised over groups (``torch.unique`` + ``index_add``), so its cost does
not grow with a Python loop over the number of prompts in the batch.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = ["AdvantageMode", "NonFiniteRewards", "broadcast_to_tokens", "group_advantages"]

AdvantageMode = Literal["grpo", "dr_grpo", "rloo"]
_MODES: tuple[str, ...] = get_args(AdvantageMode)
NonFiniteRewards = Literal["raise", "drop"]
_NONFINITE: tuple[str, ...] = get_args(NonFiniteRewards)


def _check_1d(name: str, t: Tensor) -> None:
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D with shape [N], got shape {tuple(t.shape)}")


def _check_arguments(
    rewards: Tensor,
    group_ids: Tensor,
    mode: str,
    eps: float,
    nonfinite: str,
    num_groups: int | None,
) -> None:
    """`group_advantages`' argument checks (its Raises), but for the rewards' values."""
    _check_1d("rewards", rewards)
    _check_1d("group_ids", group_ids)
    if group_ids.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"group_ids must have the same length as rewards, got group_ids of length "
            f"{group_ids.shape[0]} and rewards of length {rewards.shape[0]}"
        )
    if group_ids.device != rewards.device:
        raise ValueError(
            f"group_ids must be on the same device as rewards, got group_ids on "
            f"{group_ids.device} and rewards on {rewards.device}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex():
        # Float ids invite silent grouping mistakes (0.1 + 0.2 != 0.3); demand exact labels.
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    if rewards.is_complex():
        raise ValueError(f"rewards must be real, got dtype {rewards.dtype}")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if nonfinite not in _NONFINITE:
        raise ValueError(f"nonfinite must be one of {_NONFINITE}, got {nonfinite!r}")
    if not (eps >= 0.0 and eps != float("inf")):  # written so that NaN fails too
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    if num_groups is not None and num_groups < 0:
        raise ValueError(f"num_groups must be >= 0, got {num_groups}")


def _check_finite(rewards: Tensor, finite: Tensor) -> None:
    """ValueError giving how many rewards are NaN/inf and the first, if any is."""
    bad = ~finite
    n_bad = int(bad.sum().item())
    if n_bad:
        first = int(torch.nonzero(bad)[0, 0].item())
        raise ValueError(
            f"rewards contains {n_bad} non-finite value(s) (NaN or inf) out of "
            f"{rewards.shape[0]}; first at index {first} (value {rewards[first].item()})"
        )


def _constant_groups(r: Tensor, keep: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """[N] bool: whether response i's group has all-equal kept rewards (true of every group
    of size 1, and of one without finite rewards).

    A constant group's mean is not always exactly its value in floating point
    (3 * 0.1 / 3 != 0.1), and with a tiny eps that rounding residue divided by an equally
    tiny std would become an O(1) advantage. So constant groups are found exactly, by
    min == max (min >= max: a group without finite rewards keeps the fills -inf / +inf).
    """
    g_max = torch.full((num_groups,), -torch.inf, dtype=r.dtype, device=r.device)
    g_max = g_max.scatter_reduce(
        0, inverse, torch.where(keep, r, -torch.inf), reduce="amax", include_self=True
    )
    g_min = torch.full((num_groups,), torch.inf, dtype=r.dtype, device=r.device)
    g_min = g_min.scatter_reduce(
        0, inverse, torch.where(keep, r, torch.inf), reduce="amin", include_self=True
    )
    return (g_min >= g_max)[inverse]


def _scaled(
    centred: Tensor,
    counts: Tensor,
    inverse: Tensor,
    constant: Tensor,
    mode: str,
    eps: float,
    std_unbiased: bool,
) -> Tensor:
    """[N] advantages of `mode` from the centred rewards r_i - mean_g (0 in constant groups),
    the groups' finite-reward counts [K] and each response's group `inverse` [N]."""
    if mode == "dr_grpo":
        return centred
    if mode == "rloo":
        # G / (G - 1); groups of size 1 already have centred == 0, clamp only avoids 0 / 0.
        scale = counts / (counts - 1.0).clamp_min(1.0)
        return centred * scale[inverse]
    # "grpo"
    sq = torch.zeros(counts.shape[0], dtype=centred.dtype, device=centred.device).index_add_(
        0, inverse, centred * centred
    )  # [K], sum_i (r_i - mean_g)^2 over the finite rewards (dropped ones have centred 0)
    # Bessel: divide by G - 1; a size-1 group (or, population std, a group without finite
    # rewards) would give 0 / 0, but it is constant (above), so clamping its denominator
    # to 1 only keeps NaN out of a value that is then masked.
    denom = (counts - 1.0 if std_unbiased else counts).clamp_min(1.0)
    std = (sq / denom).sqrt()  # [K]
    # Constant groups have std 0 and centred 0: 0 / (0 + eps) is 0 for eps > 0, but
    # 0 / 0 with eps = 0 -- so divide by 1 there instead.
    divisor = torch.where(constant, torch.ones_like(centred), std[inverse] + eps)
    return centred / divisor


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    mode: AdvantageMode = "grpo",
    eps: float = 1e-6,
    std_unbiased: bool = True,
    nonfinite: NonFiniteRewards = "raise",
    num_groups: int | None = None,
) -> Tensor:
    """Group-relative advantage of every response.

    Args:
        rewards: ``[N]`` scalar reward ``r_i`` of each response; float, integer or bool.
        group_ids: ``[N]`` integer (or bool) tensor; responses with equal id form one group
            (typically: the same prompt). Ids are arbitrary -- they need not be contiguous,
            sorted, or non-negative -- and groups may have different sizes ``G``.
        mode: ``"grpo"``: ``(r_i - mean_g) / (std_g + eps)``; ``"dr_grpo"``:
            ``r_i - mean_g``; ``"rloo"``: ``G / (G - 1) * (r_i - mean_g)``.
        eps: ``>= 0``, added to ``std_g`` in ``"grpo"`` mode; ignored by the other modes.
        std_unbiased: ``"grpo"`` only: ``std_g`` with Bessel's correction (divide by ``G - 1``,
            ``torch.std``'s default) if True, else the population std (divide by ``G``).
        nonfinite: ``"raise"``: NaN/inf rewards are an error; ``"drop"``: such a response gets
            advantage 0 and is left out of its group's mean, std and size (the caller finds
            them with ``~torch.isfinite(rewards)``).
        num_groups: when the caller knows its groups on the host: their number ``K``, with
            ``group_ids`` already their indices in ``[0, K)`` (a group may have no response).
            The distinct ids are then not looked up with ``torch.unique``, whose data-dependent
            output waits on the device; the advantages are the same. Ids outside ``[0, K)``
            are the caller's error (not checked: that would wait on the device too).

    Returns:
        ``[N]`` advantages ``A_i`` on ``rewards``' device, with ``rewards``' dtype if it is a
        floating dtype, else float32. Groups of size 1 and groups with all-equal rewards give
        exactly 0 (with ``"drop"``: groups with at most one finite reward, or whose finite
        rewards are all equal).

    Raises:
        ValueError: ``rewards`` or ``group_ids`` not 1-D, different lengths or devices,
            ``group_ids`` not integer, ``rewards`` containing NaN/inf with ``nonfinite="raise"``
            (the message gives how many and the first index), unknown ``mode`` or
            ``nonfinite``, ``eps`` negative or not finite, or ``num_groups`` negative.
    """
    _check_arguments(rewards, group_ids, mode, eps, nonfinite, num_groups)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    keep = torch.isfinite(rewards) if rewards.is_floating_point() else None
    if keep is not None and nonfinite == "raise":
        _check_finite(rewards, keep)
    if rewards.shape[0] == 0:
        return torch.empty(0, dtype=out_dtype, device=rewards.device)

    # Accumulate in at least float32: half-precision sums of a few dozen rewards lose digits.
    dtype = torch.promote_types(out_dtype, torch.float32)
    r = rewards.to(dtype)
    if keep is None:
        keep = torch.ones_like(r, dtype=torch.bool)
    # Dropped (non-finite) rewards enter no sum: they count 0 and contribute 0.
    r = torch.where(keep, r, torch.zeros_like(r))

    # inverse[i] in [0, K) is the dense index of response i's group; K = number of groups.
    if num_groups is None:
        unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
        num_groups = unique_ids.shape[0]
    else:
        inverse = group_ids.long()

    counts = torch.zeros(num_groups, dtype=dtype, device=r.device).index_add_(
        0, inverse, keep.to(dtype)
    )  # [K], G per group (finite rewards only)
    sums = torch.zeros(num_groups, dtype=dtype, device=r.device).index_add_(0, inverse, r)
    mean = sums / counts.clamp_min(1.0)  # [K]; a group with no finite reward has mean 0
    centred = r - mean[inverse]  # [N], r_i - mean_g

    constant = _constant_groups(r, keep, inverse, num_groups)  # [N]
    centred = torch.where(constant | ~keep, torch.zeros_like(centred), centred)

    adv = _scaled(centred, counts, inverse, constant, mode, eps, std_unbiased)
    return adv.to(out_dtype)


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Spread per-response advantages over the response's tokens (outcome supervision).

    Every token ``t`` of response ``b`` gets the same advantage ``A_b`` (GRPO's outcome
    supervision, arXiv 2402.03300 Sec. 4.1.2); padding and prompt tokens get 0.

    Args:
        advantages: ``[B]`` per-response advantages, or ``[B, T]`` per-token advantages
            (then they are only masked).
        mask: ``[B, T]`` response mask; nonzero/True marks a token that is trained on.

    Returns:
        ``[B, T]`` tensor with ``advantages``' dtype: ``A_b`` (or ``A_{b,t}``) where ``mask``
        is nonzero, exactly 0 elsewhere.

    Raises:
        ValueError: ``mask`` not 2-D, or ``advantages`` neither ``[B]`` nor ``[B, T]``.
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D with shape [B, T], got shape {tuple(mask.shape)}")
    batch, _ = mask.shape
    if advantages.dim() == 1:
        if advantages.shape[0] != batch:
            raise ValueError(
                f"advantages of shape [B] must have B == mask.shape[0] == {batch}, got shape "
                f"{tuple(advantages.shape)}"
            )
        per_token = advantages.unsqueeze(1).expand(mask.shape)
    elif advantages.dim() == 2:
        if advantages.shape != mask.shape:
            raise ValueError(
                f"advantages of shape [B, T] must match mask's shape {tuple(mask.shape)}, got "
                f"shape {tuple(advantages.shape)}"
            )
        per_token = advantages
    else:
        raise ValueError(
            f"advantages must have shape [B] or [B, T], got shape {tuple(advantages.shape)}"
        )
    # where() rather than multiplying by the mask: it yields exact zeros whatever the mask's
    # dtype and does not promote the result to the mask's dtype.
    return torch.where(mask != 0, per_token, torch.zeros_like(per_token))
