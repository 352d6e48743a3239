"""verl's multi-turn tool rows (`agent_name`, `extra_info.tools_kwargs`) and plain math rows, in
parquet files written here with pyarrow, read back as prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.tasks.dataset_files import load_dataset_prompts
from services.tasks.jsonl import PromptFileError

SYSTEM = "Solve the problem. You may run Python in a ```python block; answer after ####."


def tool_row(index: int, question: str, answer: str) -> dict[str, Any]:
    """A row as verl's multi-turn GSM8K tool preprocessing writes one."""
    return {
        "data_source": "openai/gsm8k",
        "agent_name": "tool_agent",
        "prompt": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {
            "split": "train",
            "index": index,
            "need_tools_kwargs": True,
            "tools_kwargs": {
                "code_interpreter": {"create_kwargs": {"ground_truth": answer}},
                "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": answer}},
            },
        },
    }


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_tool_rows_keep_their_agent_and_tools_kwargs(tmp_path: Path) -> None:
    rows = [tool_row(0, "What is 3417 * 86?", "293862"), tool_row(1, "What is 9991 // 37?", "270")]
    path = write_parquet(tmp_path / "tool.parquet", rows)
    prompts = load_dataset_prompts(path)
    assert [p.answer for p in prompts] == ["293862", "270"]
    assert prompts[0].messages == rows[0]["prompt"]
    assert prompts[1].text == "What is 9991 // 37?"
    for prompt, row in zip(prompts, rows, strict=True):
        assert prompt.meta["agent_name"] == "tool_agent"
        assert json.loads(prompt.meta["tools_kwargs"]) == row["extra_info"]["tools_kwargs"]
        assert prompt.meta["data_source"] == "openai/gsm8k"
    # JSON with sorted keys: the same kwargs give the same text, whatever the column order.
    assert prompts[0].meta["tools_kwargs"] == json.dumps(
        rows[0]["extra_info"]["tools_kwargs"], sort_keys=True
    )


def test_plain_math_rows_load_as_before(tmp_path: Path) -> None:
    # A verl math row with no agent or tools: with `tools` enabled in the spec it is rolled out
    # with the tool like any prompt; the row itself carries nothing about tools.
    row = tool_row(0, "What is 12 * 12?", "144")
    del row["agent_name"]
    row["extra_info"] = {"split": "test", "index": 7}
    prompt = load_dataset_prompts(write_parquet(tmp_path / "math.parquet", [row]))[0]
    assert prompt.answer == "144"
    assert prompt.meta == {"source": "math.parquet:1", "data_source": "openai/gsm8k"}


def test_single_turn_rows_beside_tool_rows(tmp_path: Path) -> None:
    single = tool_row(1, "What is 2 + 2?", "4")
    single["agent_name"] = "single_turn_agent"
    single["extra_info"]["tools_kwargs"] = None  # parquet's null for a row without tools
    path = write_parquet(tmp_path / "mixed.parquet", [tool_row(0, "What is 6 * 7?", "42"), single])
    first, second = load_dataset_prompts(path)
    assert first.meta["agent_name"] == "tool_agent" and "tools_kwargs" in first.meta
    assert second.meta["agent_name"] == "single_turn_agent"
    assert "tools_kwargs" not in second.meta


def test_an_unknown_agent_names_the_file_row_and_key(tmp_path: Path) -> None:
    rows = [tool_row(0, "What is 6 * 7?", "42"), tool_row(1, "What is 2 + 2?", "4")]
    rows[1]["agent_name"] = "react_agent"
    path = write_parquet(tmp_path / "agents.parquet", rows)
    with pytest.raises(PromptFileError) as error:
        load_dataset_prompts(path)
    message = str(error.value)
    assert "agents.parquet" in message and "row 2" in message and "agent_name" in message
    assert "react_agent" in message and "tool_agent" in message
    assert error.value.key == "agent_name" and error.value.row == 2


def test_tools_kwargs_that_are_not_a_mapping_are_refused(tmp_path: Path) -> None:
    row = tool_row(0, "What is 6 * 7?", "42")
    row["extra_info"]["tools_kwargs"] = "code_interpreter"
    path = write_parquet(tmp_path / "kwargs.parquet", [row])
    with pytest.raises(PromptFileError, match=r"row 1.*extra_info\.tools_kwargs"):
        load_dataset_prompts(path)
