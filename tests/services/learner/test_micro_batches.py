"""The plan of a minibatch's forward passes: shares per rank, micro-batches under a budget."""

from __future__ import annotations

import pytest

from services.learner.micro_batches import MicroBatch, pack, plan_minibatch, share_rows

# (prompt, response) lengths of 7 rows.
PROMPTS = [5, 6, 5, 7, 5, 6, 5]
RESPONSES = [40, 3, 17, 12, 30, 1, 8]


def padded_cost(rows: tuple[int, ...]) -> int:
    return len(rows) * (max(PROMPTS[r] for r in rows) + max(RESPONSES[r] for r in rows))


def test_rows_are_dealt_longest_first_to_the_least_loaded_rank() -> None:
    lengths = [p + t for p, t in zip(PROMPTS, RESPONSES, strict=True)]
    # 45 -> rank 0; 35 -> 1; 22 -> 1 (57); 19 -> 0 (64); 13 -> 1 (70); 9 -> 0 (73); 7 -> 1.
    assert share_rows(lengths, 2) == [[0, 3, 1], [4, 2, 6, 5]]
    assert share_rows(lengths[:1], 3) == [[0], [], []]


def test_micro_batches_stay_under_the_budget_and_cover_every_row_once() -> None:
    rows = range(len(PROMPTS))
    for budget in (1, 30, 60, 100, 1000):
        parts = pack(rows, PROMPTS, RESPONSES, budget)
        assert sorted(r for part in parts for r in part) == list(rows)
        for part in parts:
            assert len(part) == 1 or padded_cost(part) <= budget, (budget, part)
    assert pack(rows, PROMPTS, RESPONSES, 0) == [(0, 4, 2, 3, 6, 1, 5)]  # longest first
    # Worked by hand, budget 60: (0: 45) alone; (4, 2): 2 x (5 + 30) = 70 > 60, so 4 alone;
    # (2, 3): 2 x (7 + 17) = 48; + 6: 3 x 24 = 72 > 60; (6, 1): 2 x (6 + 8) = 28; + 5: 42.
    assert pack(rows, PROMPTS, RESPONSES, 60) == [(0,), (4,), (2, 3), (6, 1, 5)]


def test_packed_rows_cost_their_lengths() -> None:
    rows = range(len(PROMPTS))
    # Packed, 45 + 35 = 80 <= 80 fits, though padded it would cost 2 x (5 + 40) = 90.
    assert pack(rows, PROMPTS, RESPONSES, 80, packed=True)[0] == (0, 4)
    assert pack(rows, PROMPTS, RESPONSES, 80)[0] == (0,)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("budget", [0, 40, 100])
def test_every_rank_runs_the_same_number_of_passes(world_size: int, budget: int) -> None:
    plan = plan_minibatch(PROMPTS, RESPONSES, world_size, budget)
    assert len(plan) == world_size and len({len(passes) for passes in plan}) == 1
    real = [r for passes in plan for micro in passes if not micro.filler for r in micro.rows]
    assert sorted(real) == list(range(len(PROMPTS)))  # every row once, over all ranks
    shortest = RESPONSES.index(min(RESPONSES))
    fillers = [micro for passes in plan for micro in passes if micro.filler]
    assert all(micro == MicroBatch((shortest,), filler=True) for micro in fillers)
    if world_size == 8:
        assert fillers  # 7 rows for 8 ranks: one rank has only a filler pass
