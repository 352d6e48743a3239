"""Built-in tasks and datasets: the arithmetic task, a JSONL loader, and the tiny model.

The tiny-model builder (`services.tasks.tiny_model`) is not imported here, so that using a task
does not import torch and transformers.
"""

from services.tasks.answers import ANSWER_MARKER, extract_final_answer, is_correct
from services.tasks.arith import (
    generate_prompts,
    iter_mixed_prompts,
    iter_prompts,
    reference_solution,
)
from services.tasks.jsonl import PromptFileError, load_jsonl_prompts
from services.tasks.registry import Task, get_task, task_names

__all__ = [
    "ANSWER_MARKER",
    "PromptFileError",
    "Task",
    "extract_final_answer",
    "generate_prompts",
    "get_task",
    "is_correct",
    "iter_mixed_prompts",
    "iter_prompts",
    "load_jsonl_prompts",
    "reference_solution",
    "task_names",
]
