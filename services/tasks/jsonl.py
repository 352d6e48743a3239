"""Load prompts from a local JSONL file: one `{"prompt": ..., "answer": ...}` object per line.

Every problem is reported as a `PromptFileError` (a ValueError) naming the file, the line and,
where one is at fault, the key, so that a bad file gives a one-line message rather than a
traceback from deep inside a run.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.messages import Prompt

REQUIRED_KEYS = ("prompt", "answer")


class PromptFileError(ValueError):
    """A prompt file that cannot be read: `path`, then the 1-based `line` (a text file) or
    `row` (a table) and the `key` (column) say where."""

    def __init__(
        self,
        path: Path,
        problem: str,
        line: int | None = None,
        key: str | None = None,
        *,
        row: int | None = None,
    ) -> None:
        self.path = path
        self.line = line
        self.row = row
        self.key = key
        self.problem = problem
        where = f"{path}:{line}" if line is not None else str(path)
        if row is not None:
            where += f", row {row}"
        noun = "column" if row is not None else "key"
        what = f"{noun} {key!r}: {problem}" if key is not None else problem
        super().__init__(f"{where}: {what}")


def _text_field(record: dict[str, object], key: str, path: Path, line: int) -> str:
    """A required string field; integers are accepted for `answer` and turned into strings."""
    if key not in record:
        raise PromptFileError(path, "missing", line, key)
    value = record[key]
    # bool is an int subclass, but `true` is never a meaningful answer.
    if key == "answer" and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        kind = "a string or integer" if key == "answer" else "a string"
        raise PromptFileError(path, f"must be {kind}, got {type(value).__name__}", line, key)
    if not value.strip():
        raise PromptFileError(path, "must not be empty", line, key)
    return value


def _parse_line(raw: bytes, path: Path, line: int) -> Prompt | None:
    """One line as a Prompt; None for a blank line."""
    try:
        # utf-8-sig drops the byte-order mark some editors put at the start of a file.
        text = raw.decode("utf-8-sig" if line == 1 else "utf-8")
    except UnicodeDecodeError as err:
        raise PromptFileError(path, f"not valid UTF-8 ({err.reason})", line) from err
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise PromptFileError(path, f"invalid JSON ({err.msg}, column {err.colno})", line) from err
    if not isinstance(record, dict):
        raise PromptFileError(path, f"expected a JSON object, got {type(record).__name__}", line)
    prompt = _text_field(record, "prompt", path, line)
    answer = _text_field(record, "answer", path, line).strip()
    prompt_id = record.get("id", f"{path.stem}:{line}")
    if not isinstance(prompt_id, str) or not prompt_id:
        raise PromptFileError(path, "must be a non-empty string", line, "id")
    return Prompt(
        prompt_id=prompt_id,
        text=prompt,
        answer=answer,
        meta={"source": f"{path.name}:{line}"},
    )


def load_jsonl_prompts(path: str | Path) -> list[Prompt]:
    """Read every prompt in a JSONL file, in file order; blank lines are skipped.

    Lines hold `{"prompt": str, "answer": str | int}` and optionally `"id": str` (default
    `<file stem>:<line>`); other keys are ignored. Raises PromptFileError for an unreadable or
    empty file, bad JSON, a missing key, a value of the wrong type and duplicate ids.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise PromptFileError(path, f"cannot read file ({err.strerror or err})") from err
    prompts: list[Prompt] = []
    first_line: dict[str, int] = {}
    for line, raw in enumerate(data.splitlines(), start=1):
        prompt = _parse_line(raw, path, line)
        if prompt is None:
            continue
        if prompt.prompt_id in first_line:
            seen = first_line[prompt.prompt_id]
            raise PromptFileError(path, f"duplicate id (first on line {seen})", line, "id")
        first_line[prompt.prompt_id] = line
        prompts.append(prompt)
    if not prompts:
        raise PromptFileError(path, "no prompts (the file is empty or has only blank lines)")
    return prompts
