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

from services.messages import ChatMessage, Prompt
from services.spec import ArithTask, DatasetTask, JsonlTask, TaskConfig
from services.tasks import get_task, load_jsonl_prompts
from services.tasks.dataset_files import load_dataset_prompts


def _file_epochs(prompts: Sequence[Prompt], shuffle: bool, seed: int) -> Iterator[Prompt]:
    """The file's prompts again and again; ids carry the epoch so they stay unique in a run."""
    for epoch in count():
        order = list(range(len(prompts)))
        if shuffle:
            random.Random(f"{seed}/{epoch}").shuffle(order)
        for index in order:
            prompt = prompts[index]
            yield replace(prompt, prompt_id=f"{prompt.prompt_id}@{epoch}")


def _endless(task: TaskConfig, seed: int) -> Iterator[Prompt]:
    if isinstance(task, ArithTask):  # a built-in task, by its name
        return get_task(task.name).prompt_stream(
            seed, task.difficulty, task.difficulty_max, "train"
        )
    if isinstance(task, JsonlTask):
        return _file_epochs(load_jsonl_prompts(Path(task.path)), task.shuffle, seed)
    if isinstance(task, DatasetTask):
        prompts = load_dataset_prompts(Path(task.path), task.format, task.split)
        return _file_epochs(prompts, task.shuffle, seed)
    raise TypeError(f"unknown task config {task!r}")


def as_chat(prompt: Prompt, system_prompt: str | None) -> Prompt:
    """A string prompt as a chat of one user message (after `system_prompt`, if any); a chat
    prompt as it is."""
    if prompt.messages:
        return prompt
    messages: list[ChatMessage] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": prompt.text})
    return replace(prompt, messages=messages)


def chats_strings(task: TaskConfig, tokenizer_has_template: bool) -> bool:
    """Whether `task`'s string prompts go through the chat template (ValueError for
    `chat_template: always` with a tokenizer that has none)."""
    if not isinstance(task, DatasetTask) or task.chat_template == "never":
        return False
    if task.chat_template == "always" and not tokenizer_has_template:
        raise ValueError(
            "task.chat_template is 'always', but the model's tokenizer has no chat template"
        )
    return tokenizer_has_template


class PromptStream:
    """Training prompts of `task`, drawn in order; `position` counts those drawn from the source.

    Raises `services.tasks.PromptFileError` at construction for a bad JSONL file, before any
    actor starts.
    """

    def __init__(
        self,
        task: TaskConfig,
        seed: int,
        position: int = 0,
        handed_back: Sequence[Prompt] = (),
        *,
        chat: bool = False,
    ) -> None:
        """`chat`: string prompts are drawn as chats (`chats_strings` decides it for a task and a
        tokenizer; the driver sets it once it has resolved the model, before the first take)."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        self.chat = chat
        self._system_prompt = task.system_prompt if isinstance(task, DatasetTask) else None
        self._source = _endless(task, seed)
        # Skipping re-draws the skipped prompts: cheap for generated tasks and files alike.
        for _ in islice(self._source, position):
            pass
        self._position = position
        self._handed_back: deque[Prompt] = deque(handed_back)

    def as_drawn(self, prompt: Prompt) -> Prompt:
        """`prompt` as `take` hands out its prompts (a chat when `chat` is set)."""
        return as_chat(prompt, self._system_prompt) if self.chat else prompt

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
        fresh = [self.as_drawn(prompt) for prompt in fresh]
        self._position += len(fresh)
        return taken + fresh

    def give_back(self, prompts: Sequence[Prompt]) -> None:
        """Return prompts that were taken but never turned into rollouts; served next, in order."""
        self._handed_back.extendleft(reversed(prompts))
