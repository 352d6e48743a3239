"""Seeded prompt streams shared by the generated tasks (`arith`, `arith_tool`).

A task supplies its name, its difficulty levels and a `draw` that turns a random generator and a
level into one prompt text and its answer; `PromptStreams` turns those into the task's endless,
deterministic streams: one difficulty (`iter_prompts`), a seeded mix of difficulties
(`iter_mixed_prompts`) and the first `n` of a stream (`generate_prompts`).

Train and eval prompts never overlap: a prompt's split is a property of its text alone
(`prompt_split`), whatever the seeds, and a stream draws again whenever a text of the other split
comes up.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Generic, Literal, TypeVar, get_args

from services.messages import Prompt

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = get_args(Split)
Level = TypeVar("Level")

# A prompt belongs to the eval split when the first byte of its digest is below this (1 in 8).
_EVAL_BUCKET = 32


def prompt_split(text: str) -> Split:
    """Which split a prompt text belongs to (a stable digest of the text, not `hash()`)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return "eval" if digest[0] < _EVAL_BUCKET else "train"


def _stream_seed(task: str, seed: int, difficulty: int, split: Split) -> int:
    """An integer seed for one task's (seed, difficulty, split) stream, stable across processes."""
    key = f"{task}|{seed}|{difficulty}|{split}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big")


@dataclass(frozen=True)
class PromptStreams(Generic[Level]):
    """One task's seeded prompt streams; a task module exposes the bound methods as its own."""

    task: str
    levels: Mapping[int, Level]
    # The stream's generator and the level -> one prompt text and its answer.
    draw: Callable[[random.Random, Level], tuple[str, str]]
    default_difficulty: int

    def iter_prompts(
        self, seed: int, difficulty: int | None = None, split: Split = "train"
    ) -> Iterator[Prompt]:
        """An endless, deterministic stream of prompts of one split and difficulty (the task's
        default difficulty when none is given).

        A text of the other split is drawn again, so each split keeps to its own part of the
        space. Bad arguments raise ValueError when the first prompt is drawn.
        """
        if difficulty is None:
            difficulty = self.default_difficulty
        if difficulty not in self.levels:
            raise ValueError(f"difficulty must be one of {sorted(self.levels)}, got {difficulty}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
        level = self.levels[difficulty]
        rng = random.Random(_stream_seed(self.task, seed, difficulty, split))
        index = 0
        while True:
            text, answer = self.draw(rng, level)
            if prompt_split(text) != split:
                continue
            yield Prompt(
                prompt_id=f"{self.task}/{split}/d{difficulty}/s{seed}/{index}",
                text=text,
                answer=answer,
                meta={
                    "task": self.task,
                    "difficulty": str(difficulty),
                    "split": split,
                    "seed": str(seed),
                },
            )
            index += 1

    def iter_mixed_prompts(
        self, seed: int, low: int, high: int, split: Split = "train"
    ) -> Iterator[Prompt]:
        """An endless, deterministic stream whose every prompt has a difficulty drawn uniformly
        from low..high: each level's own stream, interleaved by a seeded choice."""
        streams = {level: self.iter_prompts(seed, level, split) for level in range(low, high + 1)}
        rng = random.Random(_stream_seed(self.task, seed, low * 10 + high, split) ^ 0x5EED)
        levels = list(streams)
        while True:
            yield next(streams[rng.choice(levels)])

    def generate_prompts(
        self, n: int, seed: int = 0, difficulty: int | None = None, split: Split = "train"
    ) -> list[Prompt]:
        """The first `n` prompts of the (seed, difficulty, split) stream."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return list(islice(self.iter_prompts(seed, difficulty, split), n))
