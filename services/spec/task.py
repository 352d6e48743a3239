"""The `task` section: the built-in arithmetic task, a JSONL prompt file, or a dataset."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    Field,
    model_validator,
)

from kpo_core.config import StrictModel
from services.spec.bounds import MAX_TEXT_CHARS, NameText, PathText
from services.tasks.dataset_files import DatasetFormat


class ArithTask(StrictModel):
    """A built-in arithmetic task (seeded, endless; held-out prompts never overlap): `arith`,
    multi-step sums worked line by line; `arith-tool`, multi-digit products and quotients that
    pay for a Python tool call (docs/tools.md)."""

    name: Literal["arith", "arith-tool"] = "arith"
    difficulty: int = Field(
        3,
        ge=1,
        le=5,
        description="arith: 1 (4 terms, +) to 5 (8 terms, + - *); arith-tool: the operands' "
        "digits, 1 to 5",
    )
    difficulty_max: int | None = Field(
        None,
        ge=1,
        le=5,
        description="draw each prompt's difficulty uniformly from difficulty..difficulty_max "
        "(seeded): a mix of short and long responses, as real tasks have",
    )

    @model_validator(mode="after")
    def _range(self) -> ArithTask:
        if self.difficulty_max is not None and self.difficulty_max < self.difficulty:
            raise ValueError(
                f"difficulty_max ({self.difficulty_max}) must be >= difficulty ({self.difficulty})"
            )
        return self


class JsonlTask(StrictModel):
    """Prompts from a local JSONL file of {"prompt": ..., "answer": ...} lines, cycled in epochs."""

    name: Literal["jsonl"] = "jsonl"
    path: PathText = Field(description="path of the JSONL file on the driver's machine")
    shuffle: bool = Field(True, description="reshuffle every epoch (seeded by the run seed)")


class DatasetTask(StrictModel):
    """Prompts from a dataset file or `save_to_disk` directory in one of the formats RL datasets
    come in (services/tasks/dataset_files.py), cycled in epochs."""

    name: Literal["dataset"] = "dataset"
    path: PathText = Field(
        description="a .jsonl, .json or .parquet file, or a directory written by datasets' "
        "save_to_disk, on the driver's machine",
    )
    format: DatasetFormat | None = Field(
        None, description="the file's format; detected from its columns when left out"
    )
    split: NameText = Field("train", description="the split taken from a directory holding several")
    shuffle: bool = Field(True, description="reshuffle every epoch (seeded by the run seed)")
    chat_template: Literal["auto", "always", "never"] = Field(
        "auto",
        description="string prompts through the tokenizer's chat template: auto (when it has "
        "one), always (an error when it has none) or never; chat-message prompts always are",
    )
    system_prompt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_TEXT_CHARS,
        description="a system message put before each string prompt rendered as a chat",
    )
    eval_path: PathText | None = Field(
        None,
        description="held-out prompts for eval: a file or directory as `path` takes, in the "
        "same format",
    )
    eval_split: NameText = Field(
        "test",
        description="the held-out split of a directory (eval_path's, or path's without one)",
    )


TaskConfig = Annotated[ArithTask | JsonlTask | DatasetTask, Field(discriminator="name")]
