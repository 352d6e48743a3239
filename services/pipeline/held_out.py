"""A task's held-out prompts: what held-out evaluation (services.pipeline.evaluation) asks.

Apart from the evaluation itself, which drives Ray actors, so that checking a run spec (its
`eval` has prompts to evaluate on) needs neither Ray nor torch. It reads the run spec's task, so it
sits with the driver, above the spec, rather than with the tasks the spec reads.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import islice
from pathlib import Path

from services.messages import Prompt
from services.spec import ArithTask, DatasetTask, TaskConfig
from services.tasks.dataset_files import load_dataset_prompts
from services.tasks.registry import get_task

EVAL_ID_PREFIX = "eval:"


class NoHeldOutPrompts(ValueError):
    """`eval` is set, but the task has no held-out prompts."""


def held_out_prompts(task: TaskConfig, seed: int, count: int) -> list[Prompt]:
    """The first `count` held-out prompts of `task`, ids prefixed `eval:` (string prompts as
    they are: the driver makes them chats as it does training prompts)."""
    if isinstance(task, ArithTask):  # a built-in task, by its name
        source = get_task(task.name).prompt_stream(
            seed, task.difficulty, task.difficulty_max, "eval"
        )
        prompts = list(islice(source, count))
    elif isinstance(task, DatasetTask) and task.eval_path is not None:
        prompts = load_dataset_prompts(Path(task.eval_path), task.format, task.eval_split)[:count]
    elif isinstance(task, DatasetTask) and Path(task.path).is_dir():
        prompts = load_dataset_prompts(Path(task.path), task.format, task.eval_split)[:count]
    else:
        raise NoHeldOutPrompts(
            f"a {task.name} task has no held-out prompts: use a dataset task "
            "with task.eval_path (or a save_to_disk directory with an eval_split)"
        )
    return [replace(p, prompt_id=f"{EVAL_ID_PREFIX}{p.prompt_id}") for p in prompts]
