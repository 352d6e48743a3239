"""Multi-step arithmetic with running partial sums: a verifiable task with long worked answers.

A prompt is an expression followed by `=`, e.g. `7+12-5+9=`. The reference response writes one
step per operation, left to right, each as `<running value><op><operand>=<new value>;`, then the
final answer after the marker: `7+12=19;19-5=14;14+9=23;####23`.

Every intermediate value is a non-negative integer (a `-` never takes the running value below
zero), so the alphabet needs no unary minus. When `*` occurs, the prompt wraps the part before it
in parentheses, so that ordinary operator precedence and the left-to-right steps agree:
`(3+4)*2-5=` is worked as `3+4=7;7*2=14;14-5=9;####9`.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Literal, get_args

from services.messages import Prompt
from services.tasks.answers import ANSWER_MARKER

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = get_args(Split)

TASK_NAME = "arith"


@dataclass(frozen=True)
class ArithLevel:
    """How hard one difficulty level is: number of terms, operand range and allowed operators."""

    terms: int
    max_operand: int
    ops: str  # a subset of "+-*"
    max_multiplier: int = 9  # operands of `*` are drawn from 2..max_multiplier
    max_value: int = 9999  # a `*` that would exceed this becomes `+`, bounding response length


# Level 3 is the default: 9 single-digit terms give responses of about 55-70 characters, long
# enough for per-token ratio dynamics while a tiny model still learns the task in seconds.
LEVELS: dict[int, ArithLevel] = {
    1: ArithLevel(terms=4, max_operand=9, ops="+"),
    2: ArithLevel(terms=6, max_operand=9, ops="+-"),
    3: ArithLevel(terms=9, max_operand=9, ops="+-"),
    4: ArithLevel(terms=9, max_operand=99, ops="+-"),
    5: ArithLevel(terms=10, max_operand=99, ops="+-*", max_multiplier=5),
}
DEFAULT_DIFFICULTY = 3

# A prompt belongs to the eval split when the first byte of its digest is below this (1 in 8).
# Membership is a property of the text alone, so train and eval never share a prompt, whatever
# the seeds.
_EVAL_BUCKET = 32

_EXPRESSION = re.compile(r"\d+(?:[+\-*]\d+)+")
_TERM = re.compile(r"([+\-*]?)(\d+)")

Step = tuple[str, int]  # (operator, operand) applied to the running value


def prompt_split(text: str) -> Split:
    """Which split a prompt text belongs to (a stable digest of the text, not `hash()`)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return "eval" if digest[0] < _EVAL_BUCKET else "train"


def _stream_seed(seed: int, difficulty: int, split: Split) -> int:
    """An integer seed for one (seed, difficulty, split) stream, stable across processes."""
    key = f"{TASK_NAME}|{seed}|{difficulty}|{split}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big")


def _apply(value: int, op: str, operand: int) -> int:
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
                op, operand = "+", rng.randrange(1, level.max_operand + 1)
        elif op == "-" and value > 0:
            operand = rng.randrange(1, min(level.max_operand, value) + 1)
        else:
            op, operand = "+", rng.randrange(1, level.max_operand + 1)
        steps.append((op, operand))
        value = _apply(value, op, operand)
    return first, steps


def format_expression(first: int, steps: list[Step]) -> str:
    """Write the prompt text, parenthesising before `*` so that precedence matches the steps."""
    text = str(first)
    additive = False  # whether `text` has a + or - outside parentheses
    for op, operand in steps:
        if op == "*" and additive:
            text = f"({text})"
            additive = False
        additive = additive or op in "+-"
        text += f"{op}{operand}"
    return text + "="


def parse_expression(text: str) -> tuple[int, list[Step]]:
    """Read a prompt back into its first term and steps; ValueError if it is not this task's."""
    body = text.strip().removesuffix("=").replace("(", "").replace(")", "")
    if not _EXPRESSION.fullmatch(body):
        raise ValueError(f"not an arith prompt: {text!r}")
    terms = _TERM.findall(body)
    first = int(terms[0][1])
    return first, [(op, int(operand)) for op, operand in terms[1:]]


def solve_steps(first: int, steps: list[Step]) -> str:
    """The worked response for an expression: one `a<op>b=c;` per step, then `####<answer>`."""
    value = first
    parts: list[str] = []
    for op, operand in steps:
        new = _apply(value, op, operand)
        parts.append(f"{value}{op}{operand}={new};")
        value = new
    return "".join(parts) + f"{ANSWER_MARKER}{value}"


def reference_solution(prompt: Prompt | str) -> str:
    """The full worked response to an arith prompt, used as the supervised warm-start target."""
    text = prompt.text if isinstance(prompt, Prompt) else prompt
    return solve_steps(*parse_expression(text))


def final_value(first: int, steps: list[Step]) -> int:
    """The value of the expression, evaluated left to right."""
    value = first
    for op, operand in steps:
        value = _apply(value, op, operand)
    return value


def iter_prompts(
    seed: int, difficulty: int = DEFAULT_DIFFICULTY, split: Split = "train"
) -> Iterator[Prompt]:
    """An endless, deterministic stream of prompts of one split and difficulty."""
    if difficulty not in LEVELS:
        raise ValueError(f"difficulty must be one of {sorted(LEVELS)}, got {difficulty}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    level = LEVELS[difficulty]
    rng = random.Random(_stream_seed(seed, difficulty, split))
    index = 0
    while True:
        first, steps = _draw_steps(rng, level)
        text = format_expression(first, steps)
        # Rejection keeps each split inside its own half of the prompt space.
        if prompt_split(text) != split:
            continue
        yield Prompt(
            prompt_id=f"{TASK_NAME}/{split}/d{difficulty}/s{seed}/{index}",
            text=text,
            answer=str(final_value(first, steps)),
            meta={
                "task": TASK_NAME,
                "difficulty": str(difficulty),
                "split": split,
                "seed": str(seed),
            },
        )
        index += 1


def generate_prompts(
    n: int, seed: int = 0, difficulty: int = DEFAULT_DIFFICULTY, split: Split = "train"
) -> list[Prompt]:
    """The first `n` prompts of the (seed, difficulty, split) stream."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return list(islice(iter_prompts(seed, difficulty, split), n))
