"""A tool-using model's accuracy with its calls executed, for the warm start of the tiny tool model.

Sampled through the generation backend with tools enabled (services.tasks.sampling_eval): the
rollout of RL runs stops decoding at a closed ```python fence, runs the call, appends the
observation in the `<output>` wrapper and decodes on. Here the call runs with no sandbox server:
the calls the tiny model makes are `print` of integer arithmetic, and `ArithmeticRunner` runs
exactly those (anything else gets an error observation); it never runs a model's code.
"""

from __future__ import annotations

import ast
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from services.generation.base import GenerationBackend
from services.messages import Prompt
from services.tasks.answers import is_correct
from services.tasks.sampling_eval import sample_responses
from services.tools.sandbox import ToolResult

# Integers the evaluator computes with: far beyond any task operand, far below a slow product.
_MAX_DIGITS = 100


class _Refused(Exception):
    """Code the arithmetic evaluator does not run."""


def _value(node: ast.expr) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _value(node.operand)
        value = -operand if isinstance(node.op, ast.USub) else operand
    elif isinstance(node, ast.BinOp):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Add):
            value = left + right
        elif isinstance(node.op, ast.Sub):
            value = left - right
        elif isinstance(node.op, ast.Mult):
            value = left * right
        elif isinstance(node.op, ast.FloorDiv):
            value = left // right
        elif isinstance(node.op, ast.Mod):
            value = left % right
        else:
            raise _Refused
    else:
        raise _Refused
    if len(str(abs(value))) > _MAX_DIGITS:
        raise _Refused
    return value


def run_arithmetic(code: str) -> str:
    """What Python prints for `code` made of `print(...)` calls of integer + - * // %: stdout,
    then the error's last line if it fails (an error line for any other code, which it does
    not run), with one trailing newline dropped, as the rollout's observation has it."""
    lines: list[str] = []
    try:
        with warnings.catch_warnings():  # a sampled call may be any text: no SyntaxWarnings
            warnings.simplefilter("ignore")
            tree = ast.parse(code)
        for statement in tree.body:
            if not (
                isinstance(statement, ast.Expr)
                and isinstance(statement.value, ast.Call)
                and isinstance(statement.value.func, ast.Name)
                and statement.value.func.id == "print"
                and not statement.value.keywords
            ):
                raise _Refused
            lines.append(" ".join(str(_value(arg)) for arg in statement.value.args))
    except SyntaxError as error:
        lines.append(f"SyntaxError: {error.msg}")
    except ZeroDivisionError:
        lines.append("ZeroDivisionError: integer division or modulo by zero")
    except _Refused:
        lines.append("error: the warm-start evaluator runs only print() of integer arithmetic")
    return "\n".join(lines)


class ArithmeticRunner:
    """A `ToolRunner` that runs `run_arithmetic` in this process: the warm start's stand-in for
    the sandbox."""

    def run(self, code: str) -> ToolResult:
        started = time.perf_counter()
        output = run_arithmetic(code)
        return ToolResult(output, "ok", time.perf_counter() - started)


@dataclass(frozen=True)
class ToolEvaluation:
    """Rates over one sample per prompt.

    accuracy: correct with the calls executed.
    accuracy_without_tool: correct without any call (what the same samples score when a call
      is never run: a response that calls gets no answer).
    call_rate: fraction of responses that made at least one call.
    call_accuracy: accuracy among those responses (0 when there are none).
    """

    accuracy: float
    accuracy_without_tool: float
    call_rate: float
    call_accuracy: float

    def details(self) -> dict[str, float]:
        return {
            "accuracy_without_tool": self.accuracy_without_tool,
            "tool_call_rate": self.call_rate,
            "accuracy_of_calling_responses": self.call_accuracy,
        }


def evaluate_with_tool(
    backend: GenerationBackend,
    prompts: Sequence[Prompt],
    *,
    seed: int,
    max_new_tokens: int,
) -> ToolEvaluation:
    """Accuracy and call rates of one sample per prompt, sampled by `backend` with its tools
    enabled (`enable_tools`, e.g. with an `ArithmeticRunner`): its calls are executed."""
    if not prompts:
        raise ValueError("evaluate_with_tool needs at least one prompt")
    samples = sample_responses(backend, prompts, seed=seed, max_new_tokens=max_new_tokens)
    correct = [is_correct(s.text, p.answer) for s, p in zip(samples, prompts, strict=True)]
    calling = [bool(s.tool_calls) for s in samples]
    n, calls = len(prompts), sum(calling)
    return ToolEvaluation(
        accuracy=sum(correct) / n,
        accuracy_without_tool=sum(c and not k for c, k in zip(correct, calling, strict=True)) / n,
        call_rate=calls / n,
        call_accuracy=(
            sum(c and k for c, k in zip(correct, calling, strict=True)) / calls if calls else 0.0
        ),
    )
