"""The prompt stream of a run: endless, deterministic from the run seed, and resumable.

Its state is the number of prompts drawn so far plus any prompts handed back (in flight when a
checkpoint was taken), so a resumed run sees exactly the prompts the interrupted one would have.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import replace
from itertools import count, islice
from pathlib import Path

from kpo_core.config import ArithTask, JsonlTask, TaskConfig
from services.messages import Prompt
from services.tasks import iter_mixed_prompts, iter_prompts, load_jsonl_prompts


def _jsonl_epochs(prompts: Sequence[Prompt], shuffle: bool, seed: int) -> Iterator[Prompt]:
    """The file's prompts again and again; ids carry the epoch so they stay unique in a run."""
    for epoch in count():
        order = list(range(len(prompts)))
        if shuffle:
            random.Random(f"{seed}/{epoch}").shuffle(order)
        for index in order:
            prompt = prompts[index]
            yield replace(prompt, prompt_id=f"{prompt.prompt_id}@{epoch}")


def _endless(task: TaskConfig, seed: int) -> Iterator[Prompt]:
    if isinstance(task, ArithTask):
        if task.difficulty_max is not None:
            return iter_mixed_prompts(seed, task.difficulty, task.difficulty_max, "train")
        return iter_prompts(seed, task.difficulty, "train")
    if isinstance(task, JsonlTask):
        return _jsonl_epochs(load_jsonl_prompts(Path(task.path)), task.shuffle, seed)
    raise TypeError(f"unknown task config {task!r}")


class PromptStream:
    """Training prompts of `task`, drawn in order; `position` counts those drawn from the source.

    Raises `services.tasks.PromptFileError` at construction for a bad JSONL file, before any
    actor starts.
    """

    def __init__(
        self, task: TaskConfig, seed: int, position: int = 0, handed_back: Sequence[Prompt] = ()
    ) -> None:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        self._source = _endless(task, seed)
        # Skipping re-draws the skipped prompts: cheap for generated tasks and files alike.
        for _ in islice(self._source, position):
            pass
        self._position = position
        self._handed_back: deque[Prompt] = deque(handed_back)

    @property
    def position(self) -> int:
        """Prompts drawn from the source so far (handed-back prompts are not counted again)."""
        return self._position

    @property
    def handed_back(self) -> list[Prompt]:
        """Prompts returned with `give_back`, served again before new ones."""
        return list(self._handed_back)

    def take(self, n: int) -> list[Prompt]:
        """The next `n` prompts: handed-back ones first, then new ones from the source."""
        taken = [self._handed_back.popleft() for _ in range(min(n, len(self._handed_back)))]
        fresh = list(islice(self._source, n - len(taken)))
        self._position += len(fresh)
        return taken + fresh

    def give_back(self, prompts: Sequence[Prompt]) -> None:
        """Return prompts that were taken but never turned into rollouts; served next, in order."""
        self._handed_back.extendleft(reversed(prompts))
