"""The seeded prompt streams that `arith` and `arith_tool` share (tasks/prompt_streams.py)."""

from __future__ import annotations

import itertools
import random

import pytest

from services.messages import Prompt
from services.tasks import arith, arith_tool
from services.tasks.prompt_streams import SPLITS, PromptStreams, prompt_split


def heads(prompts: list[Prompt], n: int = 3) -> list[tuple[str, str, str]]:
    return [(p.prompt_id, p.text, p.answer) for p in prompts[:n]]


def test_the_tasks_streams_are_pinned() -> None:
    # The streams are the run's data: a change to the shared code must not move them.
    assert heads(arith.generate_prompts(3, 7, 3, "eval")) == [
        ("arith/eval/d3/s7/0", "8-2-3+6+2-5=", "6"),
        ("arith/eval/d3/s7/1", "5-3-1-1+8-8=", "0"),
        ("arith/eval/d3/s7/2", "5-5+7+2+6-1=", "14"),
    ]
    assert heads(arith_tool.generate_prompts(3, 7, 4, "train")) == [
        ("arith-tool/train/d4/s7/0", "3183*22=", "70026"),
        ("arith-tool/train/d4/s7/1", "7344//97=", "75"),
        ("arith-tool/train/d4/s7/2", "8586//91=", "94"),
    ]
    mixed = list(itertools.islice(arith_tool.iter_mixed_prompts(0, 1, 5, "eval"), 3))
    assert heads(mixed) == [
        ("arith-tool/eval/d2/s0/0", "41*5=", "205"),
        ("arith-tool/eval/d1/s0/0", "2*7=", "14"),
        ("arith-tool/eval/d4/s0/0", "6836*56=", "382816"),
    ]
    assert arith.generate_prompts(1, 7, split="eval")[0].meta == {
        "task": "arith",
        "difficulty": "3",
        "split": "eval",
        "seed": "7",
    }


def test_a_task_without_a_difficulty_uses_its_default() -> None:
    for task in (arith, arith_tool):
        default = task.generate_prompts(10, 2, split="eval")
        assert default == task.generate_prompts(10, 2, task.DEFAULT_DIFFICULTY, "eval")


def count_draw(rng: random.Random, level: int) -> tuple[str, str]:
    value = rng.randrange(10**6)
    return f"{level}:{value}", str(value)


STREAMS = PromptStreams("count", {1: 1, 2: 2}, count_draw, default_difficulty=2)


def test_the_streams_of_any_task_keep_to_their_split() -> None:
    for split in SPLITS:
        prompts = STREAMS.generate_prompts(100, 0, 1, split)
        assert all(prompt_split(p.text) == split for p in prompts)
        assert [p.prompt_id for p in prompts[:2]] == [
            f"count/{split}/d1/s0/0",
            f"count/{split}/d1/s0/1",
        ]


def test_a_mixed_stream_draws_every_level_from_each_levels_own_stream() -> None:
    mixed = list(itertools.islice(STREAMS.iter_mixed_prompts(4, 1, 2), 60))
    for level in (1, 2):
        mine = [p for p in mixed if p.meta["difficulty"] == str(level)]
        assert mine
        assert mine == STREAMS.generate_prompts(len(mine), 4, level)


def test_bad_arguments_raise_when_the_first_prompt_is_drawn() -> None:
    stream = STREAMS.iter_prompts(0, 3)  # nothing is checked until a prompt is drawn
    with pytest.raises(ValueError, match="difficulty"):
        next(stream)
    with pytest.raises(ValueError, match="split"):
        next(STREAMS.iter_prompts(0, 1, "test"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be"):
        STREAMS.generate_prompts(-1)
