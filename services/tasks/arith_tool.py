"""Multi-digit multiplication and integer division: a task where calling the Python tool pays.

A prompt is one operation followed by `=`: `3417*86=` or `9991//37=`. Division is Python's
integer (floor) division `//` of non-negative integers, so the quotient is exact whether or not
the division is, and it is what `print(9991//37)` prints. The answer goes after `####`.

The tiny model cannot multiply four digits by two in its head, but it can copy the expression
into a tool call and the printed result into its answer. The tool-using reference response is,
with the fenced call and the observation exactly as the multi-turn rollout writes them
(decoding stops at the closing fence; the observation is appended in the `<output>` wrapper):

    prompt:    3417*86=
    response:  ```python
               print(3417*86)
               ```<output>
               293862
               </output>
               ####293862

The direct response, `####293862`, is the one the model has to compute itself: right for
one-digit operands, out of its reach for long ones. Difficulty is the number of digits of the
operands (`LEVELS`). Train and eval prompts never overlap (the split is a property of the text:
`services.tasks.prompt_streams`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from services.messages import Prompt
from services.tasks.answers import ANSWER_MARKER
from services.tasks.demonstration import Segment
from services.tasks.prompt_streams import PromptStreams

TASK_NAME = "arith-tool"

# The call and observation format of the rollout (services/tools): a closed fenced block of
# Python ends a model turn, and the call's output (one trailing newline dropped) comes back in
# this wrapper. A test checks that these agree with the rollout's own constants.
FENCE_OPEN = "```python\n"
FENCE_CLOSE = "```"
OUTPUT_OPEN = "<output>\n"
OUTPUT_CLOSE = "\n</output>\n"

OPERATORS = ("*", "//")


@dataclass(frozen=True)
class ArithToolLevel:
    """Digits of the left and right operand of each operation at one difficulty level."""

    multiply: tuple[int, int]
    divide: tuple[int, int]


# Level 1 is the model's own multiplication table (and one-digit quotients); from level 3 on,
# a product or quotient is far beyond what a model of this size computes in its head.
LEVELS: dict[int, ArithToolLevel] = {
    1: ArithToolLevel(multiply=(1, 1), divide=(2, 1)),
    2: ArithToolLevel(multiply=(2, 1), divide=(3, 1)),
    3: ArithToolLevel(multiply=(3, 2), divide=(3, 2)),
    4: ArithToolLevel(multiply=(4, 2), divide=(4, 2)),
    5: ArithToolLevel(multiply=(5, 3), divide=(6, 3)),
}
DEFAULT_DIFFICULTY = 4

_PROMPT = re.compile(r"(\d+)(\*|//)(\d+)=")


def _operand(rng: random.Random, digits: int) -> int:
    """A number of exactly `digits` digits, at least 2 (no `*1`, no `//1`, no `//0`)."""
    return rng.randrange(max(2, 10 ** (digits - 1)), 10**digits)


def apply(left: int, op: str, right: int) -> int:
    """The value of `left op right` (`*` or `//`)."""
    if op == "*":
        return left * right
    if op == "//":
        return left // right
    raise ValueError(f"unknown operator {op!r}")


def parse_prompt(text: str) -> tuple[int, str, int]:
    """(left, operator, right) of a prompt; ValueError for anything else."""
    match = _PROMPT.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not an arith-tool prompt: {text!r}")
    left, op, right = match.groups()
    if int(right) == 0:
        raise ValueError(f"division by zero in {text!r}")
    return int(left), op, int(right)


def _text_of(prompt: Prompt | str) -> str:
    return prompt.text if isinstance(prompt, Prompt) else prompt


def answer_of(prompt: Prompt | str) -> int:
    """The exact answer of a prompt."""
    return apply(*parse_prompt(_text_of(prompt)))


def tool_call(prompt: Prompt | str) -> str:
    """The fenced call that computes the prompt's answer: ```python\\nprint(a*b)\\n```."""
    expression = _text_of(prompt).strip().removesuffix("=")
    parse_prompt(expression + "=")
    return f"{FENCE_OPEN}print({expression})\n{FENCE_CLOSE}"


def observation(output: str) -> str:
    """The observation the rollout appends for a call that printed `output`."""
    return f"{OUTPUT_OPEN}{output.removesuffix(chr(10))}{OUTPUT_CLOSE}"


def tool_segments(prompt: Prompt | str) -> list[Segment]:
    """The tool-using reference response: the call, its observation (no loss), the answer."""
    value = str(answer_of(prompt))
    return [
        Segment(tool_call(prompt)),
        Segment(observation(value), observation=True),
        Segment(f"{ANSWER_MARKER}{value}"),
    ]


def reference_solution(prompt: Prompt | str) -> str:
    """The tool-using reference response as text (call, observation and answer)."""
    return "".join(segment.text for segment in tool_segments(prompt))


def direct_solution(prompt: Prompt | str) -> str:
    """The answer with no tool call: `####<answer>`."""
    return f"{ANSWER_MARKER}{answer_of(prompt)}"


def format_prompt(left: int, op: str, right: int) -> str:
    """The prompt text of one operation."""
    return f"{left}{op}{right}="


def _draw_prompt(rng: random.Random, level: ArithToolLevel) -> tuple[str, str]:
    """One prompt and its answer, each operation drawn with probability 1/2."""
    op = rng.choice(OPERATORS)
    digits = level.multiply if op == "*" else level.divide
    left, right = _operand(rng, digits[0]), _operand(rng, digits[1])
    return format_prompt(left, op, right), str(apply(left, op, right))


# The task's seeded streams (services/tasks/prompt_streams.py): `iter_prompts(seed, difficulty,
# split)`, `iter_mixed_prompts(seed, low, high, split)` and `generate_prompts(n, seed, difficulty,
# split)`, the same arguments always giving the same prompts.
_STREAMS = PromptStreams(TASK_NAME, LEVELS, _draw_prompt, DEFAULT_DIFFICULTY)
iter_prompts = _STREAMS.iter_prompts
iter_mixed_prompts = _STREAMS.iter_mixed_prompts
generate_prompts = _STREAMS.generate_prompts
