"""The prompt stream: deterministic, resumable at any position, hands prompts back in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.pipeline.prompts import PromptStream
from services.spec import ArithTask, JsonlTask
from services.tasks import PromptFileError


def ids(prompts: list) -> list[str]:
    return [p.prompt_id for p in prompts]


def test_a_stream_resumed_at_its_position_continues_where_it_stopped() -> None:
    whole = PromptStream(ArithTask(), seed=3).take(10)
    first = PromptStream(ArithTask(), seed=3)
    head = first.take(4)
    resumed = PromptStream(ArithTask(), seed=3, position=first.position)
    assert ids(head + resumed.take(6)) == ids(whole)
    assert first.position == 4


def test_handed_back_prompts_come_first_and_are_not_counted_twice() -> None:
    reference = ids(PromptStream(ArithTask(), seed=0).take(4))
    stream = PromptStream(ArithTask(), seed=0)
    a, b, _ = stream.take(3)
    stream.give_back([a, b])
    assert ids(stream.take(3)) == [reference[0], reference[1], reference[3]]
    assert stream.position == 4


def test_seeds_and_difficulties_give_different_streams() -> None:
    assert ids(PromptStream(ArithTask(), 0).take(5)) != ids(PromptStream(ArithTask(), 1).take(5))
    easy = PromptStream(ArithTask(difficulty=1), 0).take(1)[0]
    assert easy.meta["difficulty"] == "1"


def test_jsonl_cycles_in_shuffled_epochs_with_unique_ids(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(5)))
    taken = PromptStream(JsonlTask(path=str(path)), seed=0).take(10)
    assert len(set(ids(taken))) == 10
    first, second = taken[:5], taken[5:]
    assert (
        sorted(p.text for p in first)
        == sorted(p.text for p in second)
        == [f"q{i}" for i in range(5)]
    )
    assert all(p.prompt_id.endswith("@0") for p in first)
    assert all(p.prompt_id.endswith("@1") for p in second)
    in_order = PromptStream(JsonlTask(path=str(path), shuffle=False), seed=0).take(5)
    assert [p.text for p in in_order] == [f"q{i}" for i in range(5)]


def test_a_bad_prompt_file_fails_at_construction(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "q"}\n')
    with pytest.raises(PromptFileError, match="answer"):
        PromptStream(JsonlTask(path=str(path)), seed=0)
