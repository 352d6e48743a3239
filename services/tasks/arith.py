"""Multi-step arithmetic worked as column-aligned rewrites: a verifiable task with long answers.

A prompt is an expression followed by `=`, e.g. `7+12-5+9=`. The reference response rewrites the
expression once per operation, left to right, replacing the leading operation by its value, and
right-aligns every line to the width of the expression; then it gives the answer after `####`:

    prompt:    7+12-5+9=
    response:    19-5+9;    14+9;      23;####23

Each line equals the prompt in value and starts with the running partial sum. The alignment is
deliberate: the untouched rest of each line sits in the same columns as in the line above, so a
line is a constant-offset copy of the previous one plus one local calculation. That is what lets
a tiny model learn the task in seconds, while answers stay long enough (about 66 characters at
the default difficulty) for per-token importance ratios to matter.

Every running value is a non-negative integer (a `-` never takes it below zero), so the alphabet
needs no unary minus. When `*` occurs, the prompt wraps the part before it in parentheses, so
that ordinary precedence and the left-to-right steps agree: `(3+4)*2-5=` is worked as
`    7*2-5;     14-5;        9;####9`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from services.messages import Prompt
from services.tasks.answers import ANSWER_MARKER

# The splits live with the shared prompt streams; re-exported for the callers that name them here.
from services.tasks.prompt_streams import SPLITS as SPLITS
from services.tasks.prompt_streams import PromptStreams
from services.tasks.prompt_streams import Split as Split
from services.tasks.prompt_streams import prompt_split as prompt_split

TASK_NAME = "arith"
LINE_END = ";"


@dataclass(frozen=True)
class ArithLevel:
    """How hard one difficulty level is: number of terms, operand range and allowed operators."""

    terms: int
    max_operand: int
    ops: str  # a subset of "+-*"
    max_multiplier: int = 5  # operands of `*` are drawn from 2..max_multiplier
    max_value: int = 9999  # running values stay at or below this (a `+` or `*` that would
    # exceed it is turned into `-` or `+`), which bounds both line width and the facts to learn


# Typical response lengths (characters): level 1 30, 2 46, 3 66, 4 ~125, 5 ~175; all under 256.
LEVELS: dict[int, ArithLevel] = {
    1: ArithLevel(terms=4, max_operand=9, ops="+"),
    2: ArithLevel(terms=5, max_operand=9, ops="+-"),
    3: ArithLevel(terms=6, max_operand=9, ops="+-"),
    4: ArithLevel(terms=7, max_operand=99, ops="+-"),
    5: ArithLevel(terms=8, max_operand=99, ops="+-*"),
}
DEFAULT_DIFFICULTY = 3

_CANONICAL = re.compile(r"[()\d+\-*]+")
_TERM = re.compile(r"([+\-*]?)(\d+)")

Step = tuple[str, int]  # (operator, operand) applied to the running value


def apply_op(value: int, op: str, operand: int) -> int:
    """One step of left-to-right evaluation."""
    if op == "+":
        return value + operand
    if op == "-":
        return value - operand
    if op == "*":
        return value * operand
    raise ValueError(f"unknown operator {op!r}")


def _draw_steps(rng: random.Random, level: ArithLevel) -> tuple[int, list[Step]]:
    """Draw a first term and the operations after it, keeping every running value in range."""
    value = rng.randrange(1, level.max_operand + 1)
    first = value
    steps: list[Step] = []
    for _ in range(level.terms - 1):
        op = rng.choice(level.ops)
        if op == "*":
            operand = rng.randrange(2, level.max_multiplier + 1)
            if value * operand > level.max_value:
                op = "+"
        room_up = min(level.max_operand, level.max_value - value)
        room_down = min(level.max_operand, value)
        if op == "+" and room_up < 1:
            op = "-"
        if op == "-" and room_down < 1:
            op = "+"
        if op == "+":
            operand = rng.randrange(1, room_up + 1)
        elif op == "-":
            operand = rng.randrange(1, room_down + 1)
        steps.append((op, operand))
        value = apply_op(value, op, operand)
    return first, steps


def _terms(steps: list[Step]) -> list[str]:
    """Each step as written in the prompt: `)` closes the group that a later `*` needs."""
    closes = [False] * len(steps)
    additive = False  # whether the running group has a + or - outside parentheses
    for i, (op, _) in enumerate(steps):
        if op == "*" and additive:
            closes[i - 1] = True
            additive = False
        additive = additive or op in "+-"
    return [
        f"{op}{operand}" + (")" if close else "")
        for (op, operand), close in zip(steps, closes, strict=True)
    ]


def _line(value: int, terms: list[str]) -> str:
    """The expression `value` followed by `terms`, opening as many groups as they close."""
    opens = sum(term.endswith(")") for term in terms)
    return "(" * opens + str(value) + "".join(terms)


def format_expression(first: int, steps: list[Step]) -> str:
    """The prompt text: the expression in canonical form followed by `=`."""
    return _line(first, _terms(steps)) + "="


def parse_expression(text: str) -> tuple[int, list[Step]]:
    """Read a canonical prompt back into its first term and steps.

    Raises ValueError for anything `format_expression` would not have written (other spacing or
    parentheses included), because left-to-right steps are only right for the canonical form.
    """
    body = text.strip().removesuffix("=")
    if not _CANONICAL.fullmatch(body):
        raise ValueError(f"not an arith prompt: {text!r}")
    terms = _TERM.findall(body.replace("(", "").replace(")", ""))
    if len(terms) < 2 or terms[0][0]:
        raise ValueError(f"not an arith prompt: {text!r}")
    first = int(terms[0][1])
    steps = [(op, int(operand)) for op, operand in terms[1:]]
    if format_expression(first, steps) != body + "=":
        raise ValueError(f"not an arith prompt in canonical form: {text!r}")
    return first, steps


def final_value(first: int, steps: list[Step]) -> int:
    """The value of the expression, evaluated left to right."""
    value = first
    for op, operand in steps:
        value = apply_op(value, op, operand)
    return value


def solve_steps(first: int, steps: list[Step]) -> str:
    """The worked response: one right-aligned rewrite per step, then `####<answer>`."""
    terms = _terms(steps)
    width = len(_line(first, terms))
    value = first
    lines: list[str] = []
    for i, (op, operand) in enumerate(steps):
        value = apply_op(value, op, operand)
        lines.append(_line(value, terms[i + 1 :]).rjust(width) + LINE_END)
    return "".join(lines) + f"{ANSWER_MARKER}{value}"


def reference_solution(prompt: Prompt | str) -> str:
    """The full worked response to an arith prompt, used as the supervised warm-start target."""
    text = prompt.text if isinstance(prompt, Prompt) else prompt
    return solve_steps(*parse_expression(text))


def _draw_prompt(rng: random.Random, level: ArithLevel) -> tuple[str, str]:
    first, steps = _draw_steps(rng, level)
    return format_expression(first, steps), str(final_value(first, steps))


# The task's seeded streams (services/tasks/prompt_streams.py): `iter_prompts(seed, difficulty,
# split)`, `iter_mixed_prompts(seed, low, high, split)` and `generate_prompts(n, seed, difficulty,
# split)`, the same arguments always giving the same prompts.
_STREAMS = PromptStreams(TASK_NAME, LEVELS, _draw_prompt, DEFAULT_DIFFICULTY)
iter_prompts = _STREAMS.iter_prompts
iter_mixed_prompts = _STREAMS.iter_mixed_prompts
generate_prompts = _STREAMS.generate_prompts
