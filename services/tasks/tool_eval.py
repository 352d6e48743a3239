"""Sampling a tool-using model with its calls executed: the warm-start's own evaluation loop.

The multi-turn rollout of RL runs (services/tools, in the generation backends) stops decoding at
a closed ```python fence, runs the call in the sandbox, appends the observation in the
`<output>` wrapper and decodes on. This module does the same with `transformers`' `generate`,
one turn per call to it, so that the tiny tool model's warm start measures its accuracy the way
RL will see it, with no sandbox server: the calls it makes are `print` of integer arithmetic,
and `run_arithmetic` runs exactly those (anything else gets an error observation). Only the
warm start uses it; it never runs a model's code.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

import torch
from torch import Tensor
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.utils import GenerationMixin

from services.messages import Prompt
from services.tasks.answers import is_correct
from services.tasks.arith_tool import FENCE_CLOSE, FENCE_OPEN, OUTPUT_CLOSE, OUTPUT_OPEN
from services.tasks.demonstration import Segment

# The first closed call in a turn's text, as the rollout's fenced call detector finds it.
_CALL = re.compile(re.escape(FENCE_OPEN) + r"(.*?)" + re.escape(FENCE_CLOSE), re.DOTALL)
# Integers the evaluator computes with: far beyond any task operand, far below a slow product.
_MAX_DIGITS = 100

TurnEnd = Literal["stop", "length", "call", "max_turns"]


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


@dataclass
class ToolSample:
    """One sampled response: its segments (model text and observations), the calls it made
    (their observations appended) and how it ended."""

    segments: list[Segment] = field(default_factory=list)
    calls: int = 0
    model_tokens: int = 0
    finish: TurnEnd | None = None

    @property
    def text(self) -> str:
        return "".join(segment.text for segment in self.segments)


class _StopAtCall(StoppingCriteria):
    """Ends a row once its text since `start` holds a closed call."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, start: int) -> None:
        self._tokenizer = tokenizer
        self._start = start

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs: object) -> Tensor:
        texts = self._tokenizer.batch_decode(input_ids[:, self._start :])
        return torch.tensor([_CALL.search(t) is not None for t in texts], device=input_ids.device)


def _decode(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool = False
) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str)  # one sequence of ids decodes to one string
    return text


def _turn_end(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], budget: int
) -> tuple[list[int], TurnEnd]:
    """The model tokens of one turn (cut where it ended) and why it ended."""
    eos = tokenizer.eos_token_id
    for count in range(1, min(len(ids), budget) + 1):
        if ids[count - 1] == eos:
            return ids[:count], "stop"
        # Decoding each prefix is cheap for these short turns and needs no knowledge of ids.
        if _CALL.search(_decode(tokenizer, ids[:count])) is not None:
            return ids[:count], "call"
    return ids[:budget], "length"


def sample_with_tool(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    seed: int,
    max_new_tokens: int,
    max_turns: int = 3,
    run: Callable[[str], str] = run_arithmetic,
    temperature: float = 1.0,
) -> list[ToolSample]:
    """One multi-turn response per prompt, sampled from the full softmax at `temperature`.

    As the rollout does it: decoding stops at a closed ```python fence, `run(code)` gives the
    output, `<output>\\n{output}\\n</output>\\n` is appended (its tokens are observation
    segments) and decoding goes on; `max_new_tokens` counts model tokens only; a call in the
    last of `max_turns` turns is not run (finish `max_turns`). The global torch RNG is seeded
    inside a fork, so the result depends only on `seed` and the weights.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    samples = [ToolSample() for _ in prompts]
    contexts = [
        list(ids)
        for ids in tokenizer([p.text for p in prompts], add_special_tokens=False)["input_ids"]
    ]
    was_training = model.training
    model.train(False)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for turn in range(1, max_turns + 1):
                active = [i for i, s in enumerate(samples) if s.finish is None]
                if not active:
                    break
                budget = max(max_new_tokens - samples[i].model_tokens for i in active)
                width = max(len(contexts[i]) for i in active)
                input_ids = torch.full((len(active), width), pad, dtype=torch.long)
                attention = torch.zeros((len(active), width), dtype=torch.long)
                for row, i in enumerate(active):  # left padding
                    input_ids[row, width - len(contexts[i]) :] = torch.tensor(contexts[i])
                    attention[row, width - len(contexts[i]) :] = 1
                # transformers leaves this constructor unannotated.
                config = GenerationConfig(  # type: ignore[no-untyped-call]
                    do_sample=True,
                    temperature=temperature,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=budget,
                    eos_token_id=eos,
                    pad_token_id=pad,
                )
                out = cast(GenerationMixin, model).generate(
                    input_ids=input_ids.to(model.device),
                    attention_mask=attention.to(model.device),
                    generation_config=config,
                    stopping_criteria=StoppingCriteriaList([_StopAtCall(tokenizer, width)]),
                )
                for row, i in enumerate(active):
                    sample = samples[i]
                    new = [int(t) for t in out[row, width:].tolist()]
                    ids, end = _turn_end(tokenizer, new, max_new_tokens - sample.model_tokens)
                    sample.model_tokens += len(ids)
                    text = _decode(tokenizer, ids, skip_special_tokens=True)
                    sample.segments.append(Segment(text))
                    contexts[i] += ids
                    if end != "call":
                        sample.finish = end
                        continue
                    if turn == max_turns:
                        sample.finish = "max_turns"
                        continue
                    match = _CALL.search(text)
                    assert match is not None
                    observed = [
                        *tokenizer(OUTPUT_OPEN, add_special_tokens=False)["input_ids"],
                        *tokenizer(run(match.group(1)), add_special_tokens=False)["input_ids"],
                        *tokenizer(OUTPUT_CLOSE, add_special_tokens=False)["input_ids"],
                    ]
                    sample.calls += 1
                    sample.segments.append(
                        Segment(_decode(tokenizer, observed, skip_special_tokens=True), True)
                    )
                    contexts[i] += observed
                    if sample.model_tokens >= max_new_tokens:
                        sample.finish = "length"
    finally:
        model.train(was_training)
    return samples


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
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    seed: int,
    max_new_tokens: int,
    max_turns: int = 3,
) -> ToolEvaluation:
    """Accuracy and call rates of one sample per prompt (`sample_with_tool`)."""
    if not prompts:
        raise ValueError("evaluate_with_tool needs at least one prompt")
    samples = sample_with_tool(
        model, tokenizer, prompts, seed=seed, max_new_tokens=max_new_tokens, max_turns=max_turns
    )
    correct = [is_correct(s.text, p.answer) for s, p in zip(samples, prompts, strict=True)]
    calling = [s.calls > 0 for s in samples]
    n, calls = len(prompts), sum(calling)
    return ToolEvaluation(
        accuracy=sum(correct) / n,
        accuracy_without_tool=sum(c and not k for c, k in zip(correct, calling, strict=True)) / n,
        call_rate=calls / n,
        call_accuracy=(
            sum(c and k for c, k in zip(correct, calling, strict=True)) / calls if calls else 0.0
        ),
    )
