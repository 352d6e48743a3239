"""Built-in tasks by name, so that a run config can select one with a string."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from services.messages import Prompt
from services.tasks import arith, arith_tool


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
    # (seed, difficulty, split) -> the endless stream `generate_prompts` takes the first n of.
    iter_prompts: Callable[[int, int, arith.Split], Iterator[Prompt]]
    # (seed, low, high, split) -> an endless stream of difficulties drawn from low..high.
    iter_mixed_prompts: Callable[[int, int, int, arith.Split], Iterator[Prompt]]

    def prompt_stream(
        self, seed: int, difficulty: int, difficulty_max: int | None, split: arith.Split
    ) -> Iterator[Prompt]:
        """The endless stream of one difficulty, or of a mix up to `difficulty_max`."""
        if difficulty_max is not None:
            return self.iter_mixed_prompts(seed, difficulty, difficulty_max, split)
        return self.iter_prompts(seed, difficulty, split)


_TASKS: dict[str, Task] = {
    arith.TASK_NAME: Task(
        name=arith.TASK_NAME,
        description="multi-step + - * arithmetic worked as aligned rewrites; answer after ####",
        difficulties=tuple(sorted(arith.LEVELS)),
        default_difficulty=arith.DEFAULT_DIFFICULTY,
        generate_prompts=arith.generate_prompts,
        reference_solution=arith.reference_solution,
        iter_prompts=arith.iter_prompts,
        iter_mixed_prompts=arith.iter_mixed_prompts,
    ),
    arith_tool.TASK_NAME: Task(
        name=arith_tool.TASK_NAME,
        description="multi-digit * and // (integer division), one operation, best computed "
        "with a Python tool call; answer after ####",
        difficulties=tuple(sorted(arith_tool.LEVELS)),
        default_difficulty=arith_tool.DEFAULT_DIFFICULTY,
        generate_prompts=arith_tool.generate_prompts,
        reference_solution=arith_tool.reference_solution,
        iter_prompts=arith_tool.iter_prompts,
        iter_mixed_prompts=arith_tool.iter_mixed_prompts,
    ),
}

# Built-in models and the task each was warm-started on (services/tasks/tiny_model.py builds
# them; services/tasks/assets holds the committed copies).
BUILTIN_MODEL_TASKS: dict[str, str] = {
    "tiny-arith": arith.TASK_NAME,
    "tiny-arith-tool": arith_tool.TASK_NAME,
}
BUILTIN_MODELS: tuple[str, ...] = tuple(BUILTIN_MODEL_TASKS)


def task_names() -> list[str]:
    """Names `get_task` accepts, sorted."""
    return sorted(_TASKS)


def get_task(name: str) -> Task:
    """The built-in task called `name`; ValueError listing the valid names otherwise."""
    try:
        return _TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(task_names())}") from None
