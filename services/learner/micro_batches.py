"""Which rows of a minibatch each learner rank runs, and in which forward passes.

A minibatch of b rows is dealt to the W ranks of the learner group, and each rank's share is
packed into micro-batches under a budget of padded tokens per forward pass
(`learner.micro_batch_tokens`). Gradients accumulate over the micro-batches and the optimiser
steps once per minibatch; the loss of every part is normalised by the counts of the whole
minibatch (`kpo_core.losses.LossNormaliser`), so the result equals the unsplit minibatch.

Every rank computes the same plan from the same batch (each rank receives all of it), so the
ranks agree without talking. Under FSDP every forward and backward is a collective, so all ranks
must run the same number of passes: a rank with fewer micro-batches runs filler passes (one real
row whose loss weight is zero).

Rows are padded to the widest prompt and longest response of their micro-batch, so sorting by
length first keeps padding small: a micro-batch of n rows costs n * (P_max + T_max) tokens; with
an attention kernel that takes variable-length rows, they are packed and cost their lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatch:
    """One forward pass of one rank: `rows` index the minibatch's rows; a `filler` pass only
    keeps the ranks' collectives in step (its rows carry no loss)."""

    rows: tuple[int, ...]
    filler: bool = False


def share_rows(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Deal rows to ranks, longest first, each to the rank with the fewest tokens so far.

    Ties go to the lowest rank; each share keeps the longest-first order. With fewer rows than
    ranks, some shares are empty.
    """
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        rank = min(range(world_size), key=lambda k: (load[k], k))
        shares[rank].append(row)
        load[rank] += lengths[row]
    return shares


def pack(
    rows: Sequence[int],
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    budget: int,
    packed: bool = False,
) -> list[tuple[int, ...]]:
    """Pack `rows` (longest first) into micro-batches of at most `budget` tokens.

    A micro-batch of rows R costs |R| * (max P + max T) over R when padded, or the sum of its
    rows' lengths when `packed` (rows concatenated, `ResponseLogProbs.packed`). A row longer
    than the budget alone gets a micro-batch of its own. `budget` 0: one micro-batch of every
    row.
    """
    order = sorted(rows, key=lambda r: (-(prompt_lengths[r] + response_lengths[r]), r))
    if budget == 0:
        return [tuple(order)] if order else []
    parts: list[tuple[int, ...]] = []
    current: list[int] = []
    width_p = width_t = tokens = 0
    for row in order:
        length = prompt_lengths[row] + response_lengths[row]
        p, t = max(width_p, prompt_lengths[row]), max(width_t, response_lengths[row])
        cost = tokens + length if packed else (len(current) + 1) * (p + t)
        if current and cost > budget:
            parts.append(tuple(current))
            current, p, t, tokens = [], prompt_lengths[row], response_lengths[row], 0
        current.append(row)
        width_p, width_t, tokens = p, t, tokens + length
    if current:
        parts.append(tuple(current))
    return parts


def plan_minibatch(
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    world_size: int,
    budget: int,
    packed: bool = False,
) -> list[list[MicroBatch]]:
    """The passes of every rank over one minibatch: plan[rank] is that rank's micro-batches.

    Every rank gets the same number of passes; missing ones are filler passes over the
    minibatch's shortest row.
    """
    lengths = [p + t for p, t in zip(prompt_lengths, response_lengths, strict=True)]
    if not lengths:
        raise ValueError("a minibatch needs at least one row")
    plan = [
        [MicroBatch(rows) for rows in pack(share, prompt_lengths, response_lengths, budget, packed)]
        for share in share_rows(lengths, world_size)
    ]
    passes = max(len(rank_plan) for rank_plan in plan)
    shortest = min(range(len(lengths)), key=lambda r: (lengths[r], r))
    for rank_plan in plan:
        rank_plan.extend(
            MicroBatch((shortest,), filler=True) for _ in range(passes - len(rank_plan))
        )
    return plan
