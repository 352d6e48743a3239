"""Built-in tasks by name, so that a run config can select one with a string."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.messages import Prompt
from services.tasks import arith


@dataclass(frozen=True)
class Task:
    """A built-in task: how to generate its prompts and how to solve one for warm-start."""

    name: str
    description: str
    difficulties: tuple[int, ...]
    default_difficulty: int
    # (n, seed, difficulty, split) -> prompts; the same arguments give the same prompts.
    generate_prompts: Callable[[int, int, int, arith.Split], list[Prompt]]
    reference_solution: Callable[[Prompt], str]


_TASKS: dict[str, Task] = {
    arith.TASK_NAME: Task(
        name=arith.TASK_NAME,
        description="multi-step + - * arithmetic worked as aligned rewrites; answer after ####",
        difficulties=tuple(sorted(arith.LEVELS)),
        default_difficulty=arith.DEFAULT_DIFFICULTY,
        generate_prompts=arith.generate_prompts,
        reference_solution=arith.reference_solution,
    ),
}


def task_names() -> list[str]:
    """Names `get_task` accepts, sorted."""
    return sorted(_TASKS)


def get_task(name: str) -> Task:
    """The built-in task called `name`; ValueError listing the valid names otherwise."""
    try:
        return _TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(task_names())}") from None
