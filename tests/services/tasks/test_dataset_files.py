"""Dataset files in each format, written here with pyarrow and `datasets`, read back as prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.tasks.answers import extract_boxed
from services.tasks.dataset_files import load_dataset_prompts
from services.tasks.jsonl import PromptFileError

VERL_ROWS: list[dict[str, Any]] = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "Reason step by step."},
            {"role": "user", "content": "What is 2 + 3?"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 4 * 6?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "24"},
        "extra_info": {"split": "train", "index": 1},
    },
]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_a_verl_parquet_file_gives_chats_and_ground_truths(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "train.parquet", VERL_ROWS)
    prompts = load_dataset_prompts(path)  # detected from the columns
    assert [p.answer for p in prompts] == ["5", "24"]
    assert prompts[0].messages == VERL_ROWS[0]["prompt"]
    assert prompts[0].text == "What is 2 + 3?"
    assert prompts[1].prompt_id == "train:2"
    assert prompts[1].meta == {"source": "train.parquet:2", "data_source": "openai/gsm8k"}


def test_a_gsm8k_jsonl_file_takes_the_answer_after_the_marker(tmp_path: Path) -> None:
    rows = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "A farm has 1,200 hens.", "answer": "1,200 hens\n#### 1,200"},
    ]
    prompts = load_dataset_prompts(write_jsonl(tmp_path / "gsm8k.jsonl", rows), "gsm8k")
    assert [(p.text, p.answer, p.messages) for p in prompts] == [
        (rows[0]["question"], "7", []),
        (rows[1]["question"], "1200", []),
    ]


def test_a_math_json_file_takes_the_last_boxed_expression(tmp_path: Path) -> None:
    rows = [
        {"problem": "Simplify 2/4.", "solution": "We get $\\boxed{\\frac{1}{2}}$."},
        {"problem": "Solve x+1=3.", "solution": "First \\boxed{1}? No: $x = \\boxed{2}$."},
    ]
    path = tmp_path / "math.json"
    path.write_text(json.dumps(rows), encoding="utf-8")  # a JSON array, not JSON Lines
    assert [p.answer for p in load_dataset_prompts(path)] == ["\\frac{1}{2}", "2"]


def test_a_save_to_disk_directory_gives_the_split_asked_for(tmp_path: Path) -> None:
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "1+1", "answer": 2}]),
            "test": datasets.Dataset.from_list([{"prompt": "2+2", "answer": 4}]),
        }
    )
    splits.save_to_disk(str(tmp_path / "arith"))
    test = load_dataset_prompts(tmp_path / "arith", "prompt-answer", split="test")
    assert [(p.text, p.answer) for p in test] == [("2+2", "4")]
    with pytest.raises(PromptFileError, match=r"has no split 'validation' \(splits: test, train\)"):
        load_dataset_prompts(tmp_path / "arith", split="validation")


def test_a_prompt_answer_file_may_hold_chats(tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "user", "content": "3-1?"}], "answer": "2"}]
    (prompt,) = load_dataset_prompts(write_parquet(tmp_path / "chats.parquet", rows))
    assert prompt.messages == rows[0]["prompt"] and prompt.answer == "2"


@pytest.mark.parametrize(
    ("rows", "dataset_format", "message"),
    [
        # A row without its answer: the row and the column are named.
        (
            [{"question": "q1", "answer": "#### 1"}, {"question": "q2", "answer": "no marker"}],
            "gsm8k",
            r"row 2: column 'answer': has no final answer after '####'",
        ),
        (
            [{"problem": "p", "solution": "the answer is 3"}],
            "math",
            r"row 1: column 'solution': has no \\boxed\{\.\.\.\} answer",
        ),
        # A wrong type.
        (
            [{"prompt": "p", "answer": "1"}, {"prompt": "p", "answer": ["1"]}],
            "prompt-answer",
            r"row 2: column 'answer': must be a string, got list",
        ),
        (
            [{"prompt": "p", "answer": None}],
            "prompt-answer",
            r"row 1: column 'answer': missing",
        ),
        # A missing column, format given.
        (
            [{"question": "q"}],
            "gsm8k",
            r"format 'gsm8k' needs columns \['answer'\]; the file has \['question'\]",
        ),
        # No format fits the columns.
        (
            [{"query": "q", "label": "1"}],
            None,
            r"matches no known format: columns \['label', 'query'\]; formats: verl: prompt, "
            r"reward_model; gsm8k: question, answer",
        ),
    ],
)
def test_a_bad_file_names_the_file_row_and_column(
    tmp_path: Path, rows: list[dict[str, Any]], dataset_format: Any, message: str
) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(PromptFileError, match=message) as caught:
        load_dataset_prompts(path, dataset_format)
    assert str(caught.value).startswith(str(path))


def test_a_verl_row_without_ground_truth_or_chat_is_refused(tmp_path: Path) -> None:
    rows = [dict(VERL_ROWS[0]), {**VERL_ROWS[1], "reward_model": {"style": "rule"}}]
    with pytest.raises(PromptFileError, match=r"row 2: column 'reward_model': must hold a"):
        load_dataset_prompts(write_parquet(tmp_path / "a.parquet", rows))
    rows = [{**VERL_ROWS[0], "prompt": [{"role": "assistant", "content": "5"}]}]
    with pytest.raises(PromptFileError, match=r"row 1: column 'prompt': the last message is"):
        load_dataset_prompts(write_parquet(tmp_path / "b.parquet", rows))


def test_unreadable_files_are_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(PromptFileError, match=r"empty\.jsonl: the file is empty"):
        load_dataset_prompts(empty)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "p", "answer": "1"}\n{"prompt": \n')
    with pytest.raises(PromptFileError, match=r"broken\.jsonl: cannot be read as a dataset"):
        load_dataset_prompts(broken)
    with pytest.raises(PromptFileError, match=r"data\.csv: unknown file type '\.csv'"):
        load_dataset_prompts(write_jsonl(tmp_path / "data.csv", [{"prompt": "p"}]))
    with pytest.raises(PromptFileError, match=r"missing\.parquet: no such file"):
        load_dataset_prompts(tmp_path / "missing.parquet")


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{ {2}+3 }", "{2}+3"),
        ("\\fbox{x}", "x"),
        ("\\boxed 5$", "5"),
        ("no box here", None),
        ("\\boxed{never closed", None),
        ("\\boxedfoo", None),
    ],
)
def test_boxed_answers_are_extracted_with_balanced_braces(text: str, boxed: str | None) -> None:
    assert extract_boxed(text) == boxed
