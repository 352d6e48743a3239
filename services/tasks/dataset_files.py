"""Prompts from dataset files in the formats RL datasets come in, read through `datasets`.

Files: `.jsonl`, `.json`, `.parquet`, or a directory written by `datasets`' `save_to_disk` (a
`Dataset`, or a `DatasetDict` whose `split` is taken). Formats, by their columns:

    verl           `prompt` (a list of chat messages), `reward_model.ground_truth`, and
                   optionally `data_source`, `extra_info` and `agent_name` (verl's RL parquet
                   files; multi-turn tool rows: see below)
    gsm8k          `question`, `answer` (worked solution ending `#### <answer>`)
    math           `problem`, `solution` (the answer is its last `\\boxed{...}`)
    prompt-answer  `prompt` (a string or a list of chat messages), `answer` (a string or an
                   integer): the project's JSONL format

verl's multi-turn tool rows name their agent loop in `agent_name` (`tool_agent`, or
`single_turn_agent`; another name is an error) and carry per-tool arguments in
`extra_info.tools_kwargs` ({tool: {create_kwargs, execute_kwargs, ...}}). Both are kept in the
prompt's `meta` for the rollout: `meta["agent_name"]`, and `meta["tools_kwargs"]` as JSON
(keys sorted). Whether a run calls tools is the spec's `tools` section; with it enabled, every
row is answered in multi-turn rollouts except a `single_turn_agent` row, which gets one response
with no tool declared (`Prompt.takes_tools`). The reward is the verifier's score of the final
answer after the last turn, as for any row.

`format` may be left out: it is detected from the columns. Every problem is a
`PromptFileError` naming the file and, where one is at fault, the row (1-based) and the column,
so a bad file gives a one-line message before any actor starts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from services.messages import SINGLE_TURN_AGENT, TOOL_AGENT, ChatMessage, Prompt
from services.tasks.answers import extract_boxed, extract_final_answer
from services.tasks.jsonl import PromptFileError

DatasetFormat = Literal["verl", "gsm8k", "math", "prompt-answer"]
# The columns that identify each format, in the order detection tries them.
FORMAT_COLUMNS: dict[DatasetFormat, tuple[str, ...]] = {
    "verl": ("prompt", "reward_model"),
    "gsm8k": ("question", "answer"),
    "math": ("problem", "solution"),
    "prompt-answer": ("prompt", "answer"),
}
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
CHAT_ROLES = ("system", "user", "assistant")
VERL_AGENTS = (SINGLE_TURN_AGENT, TOOL_AGENT)


def read_rows(path: Path, split: str) -> tuple[list[str], Sequence[Mapping[str, Any]]]:
    """(column names, rows) of the dataset at `path` (a file, or a `save_to_disk` directory,
    whose `split` is taken when it holds several)."""
    import datasets

    if not path.exists():
        raise PromptFileError(path, "no such file or directory")
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    known = ", ".join(sorted(loaded))
                    raise PromptFileError(path, f"has no split {split!r} (splits: {known})")
                loaded = loaded[split]
        else:
            builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
            if builder is None:
                known = ", ".join(FILE_SUFFIXES)
                raise PromptFileError(
                    path, f"unknown file type {path.suffix!r} (known: {known}, or a directory)"
                )
            if path.stat().st_size == 0:
                raise PromptFileError(path, "the file is empty")
            loaded = datasets.load_dataset(builder, data_files=str(path), split="train")
    except PromptFileError:
        raise
    except Exception as error:  # the library's own: bad JSON, a broken parquet footer, ...
        raise PromptFileError(path, f"cannot be read as a dataset: {_first_line(error)}") from error
    if not isinstance(loaded, datasets.Dataset):
        raise PromptFileError(path, f"holds a {type(loaded).__name__}, not a dataset of rows")
    if len(loaded) == 0:
        raise PromptFileError(path, "has no rows")
    return list(loaded.column_names), loaded


def _first_line(error: Exception) -> str:
    cause: BaseException = error
    while cause.__cause__ is not None:  # `datasets` wraps the parser's error
        cause = cause.__cause__
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}".rstrip(": ")


def detect_format(path: Path, columns: Sequence[str]) -> DatasetFormat:
    """The one format whose columns `columns` hold; PromptFileError naming what was found."""
    matches = [name for name, needed in FORMAT_COLUMNS.items() if set(needed) <= set(columns)]
    if len(matches) == 1:
        return matches[0]
    known = "; ".join(f"{name}: {', '.join(needed)}" for name, needed in FORMAT_COLUMNS.items())
    if not matches:
        raise PromptFileError(
            path, f"matches no known format: columns {sorted(columns)}; formats: {known}"
        )
    raise PromptFileError(
        path, f"columns {sorted(columns)} fit formats {matches}: set task.format to one of them"
    )


# --- one row of each format ---------------------------------------------------------------------


class _Row:
    """One row being read: its fields, and errors that name the file, row and column."""

    def __init__(self, path: Path, number: int, fields: Mapping[str, Any]) -> None:
        self.path, self.number, self.fields = path, number, fields

    def error(self, column: str, problem: str) -> PromptFileError:
        return PromptFileError(self.path, problem, key=column, row=self.number)

    def get(self, column: str) -> Any:
        value = self.fields.get(column)
        if value is None:
            raise self.error(column, "missing")
        return value

    def text(self, column: str, value: Any = None) -> str:
        """A non-empty string (an integer is taken as its digits: answers often are)."""
        value = self.get(column) if value is None else value
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise self.error(column, f"must be a string, got {type(value).__name__}")
        if not value.strip():
            raise self.error(column, "must not be empty")
        return value

    def messages(self, column: str) -> list[ChatMessage]:
        """A non-empty list of {"role", "content"} chat messages."""
        value = self.get(column)
        if not isinstance(value, list) or not value:
            kind = type(value).__name__
            raise self.error(column, f"must be a non-empty list of chat messages, got {kind}")
        messages: list[ChatMessage] = []
        for index, message in enumerate(value):
            if not isinstance(message, Mapping):
                raise self.error(column, f"message {index} is not an object")
            role, content = message.get("role"), message.get("content")
            if role not in CHAT_ROLES:
                raise self.error(column, f"message {index}: role must be one of {CHAT_ROLES}")
            if not isinstance(content, str):
                raise self.error(column, f"message {index}: content must be a string")
            messages.append({"role": str(role), "content": content})
        if messages[-1]["role"] == "assistant":
            raise self.error(column, "the last message is the assistant's: nothing to answer")
        return messages

    def prompt(self, column: str) -> tuple[str, list[ChatMessage]]:
        """(text, messages) of a prompt column that holds a string or a message list."""
        value = self.get(column)
        if isinstance(value, str):
            return self.text(column, value), []
        messages = self.messages(column)
        users = [m["content"] for m in messages if m["role"] == "user"]
        return (users[-1] if users else messages[-1]["content"]), messages

    def make(self, text: str, answer: str, messages: list[ChatMessage], **meta: str) -> Prompt:
        return Prompt(
            prompt_id=f"{self.path.stem}:{self.number}",
            text=text,
            answer=answer.strip(),
            meta={"source": f"{self.path.name}:{self.number}", **meta},
            messages=messages,
        )


def _verl(row: _Row) -> Prompt:
    text, messages = row.prompt("prompt")
    if not messages:
        raise row.error("prompt", "must be a list of chat messages (verl's format)")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, Mapping) or reward_model.get("ground_truth") is None:
        raise row.error("reward_model", "must hold a ground_truth")
    answer = row.text("reward_model", reward_model["ground_truth"])
    meta = {}
    source = row.fields.get("data_source")
    if isinstance(source, str) and source:
        meta["data_source"] = source
    agent = row.fields.get("agent_name")
    if agent is not None:
        if agent not in VERL_AGENTS:
            raise row.error(
                "agent_name", f"{agent!r} is not an agent loop run here (known: {VERL_AGENTS})"
            )
        meta["agent_name"] = agent
    extra_info = row.fields.get("extra_info")
    tools_kwargs = extra_info.get("tools_kwargs") if isinstance(extra_info, Mapping) else None
    if tools_kwargs is not None:
        if not isinstance(tools_kwargs, Mapping):
            kind = type(tools_kwargs).__name__
            raise row.error(
                "extra_info.tools_kwargs", f"must map tool names to their kwargs, got {kind}"
            )
        try:
            meta["tools_kwargs"] = json.dumps(tools_kwargs, sort_keys=True)
        except (TypeError, ValueError) as error:
            raise row.error("extra_info.tools_kwargs", f"is not JSON: {error}") from None
    return row.make(text, answer, messages, **meta)


def _gsm8k(row: _Row) -> Prompt:
    solution = row.text("answer")
    answer = extract_final_answer(solution)
    if not answer:
        raise row.error("answer", "has no final answer after '####'")
    return row.make(row.text("question"), answer.replace(",", ""), [])


def _math(row: _Row) -> Prompt:
    answer = extract_boxed(row.text("solution"))
    if not answer:
        raise row.error("solution", "has no \\boxed{...} answer")
    return row.make(row.text("problem"), answer, [])


def _prompt_answer(row: _Row) -> Prompt:
    text, messages = row.prompt("prompt")
    return row.make(text, row.text("answer"), messages)


_READERS: dict[DatasetFormat, Callable[[_Row], Prompt]] = {
    "verl": _verl,
    "gsm8k": _gsm8k,
    "math": _math,
    "prompt-answer": _prompt_answer,
}


def load_dataset_prompts(
    path: str | Path, dataset_format: DatasetFormat | None = None, split: str = "train"
) -> list[Prompt]:
    """Every prompt of the dataset at `path`, in row order (`dataset_format`: detected from the
    columns when None). Raises PromptFileError naming file, row and column."""
    path = Path(path)
    columns, rows = read_rows(path, split)
    chosen = dataset_format or detect_format(path, columns)
    missing = [column for column in FORMAT_COLUMNS[chosen] if column not in columns]
    if missing:
        raise PromptFileError(
            path, f"format {chosen!r} needs columns {missing}; the file has {sorted(columns)}"
        )
    reader = _READERS[chosen]
    return [reader(_Row(path, number, fields)) for number, fields in enumerate(rows, start=1)]
