"""The tool model's warm start: observation tokens carry no loss, the arithmetic evaluator runs
calls as Python would, and the evaluation loop stops at calls and appends their output."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.messages import Prompt
from services.tasks import arith_tool
from services.tasks.demonstration import Demonstration, Segment, demonstration_text
from services.tasks.tiny_model import (
    BUILD_INFO,
    build_tiny_model,
    default_settings,
    tool_demonstration,
    uses_tool,
)
from services.tasks.tokenizer import build_tokenizer
from services.tasks.tool_eval import run_arithmetic
from services.tasks.warmstart import IGNORE, encode_batch


def prompt(text: str) -> Prompt:
    return Prompt(prompt_id=text, text=text, answer=str(arith_tool.answer_of(text)))


def test_observation_tokens_get_no_label() -> None:
    tokenizer = build_tokenizer()
    prompts = [prompt("3417*86="), prompt("12*3=")]
    segments = arith_tool.tool_segments(prompts[0])
    demonstrations: list[Demonstration] = [segments, arith_tool.direct_solution(prompts[1])]
    input_ids, labels = encode_batch(tokenizer, prompts, demonstrations)
    call, observed, answer = segments

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    p, c, o, a = ids("3417*86="), ids(call.text), ids(observed.text), ids(answer.text)
    assert input_ids[0].tolist() == [*p, *c, *o, *a, eos]
    # The prompt and the observation are context only; the call, the answer and EOS are trained.
    assert labels[0].tolist() == [
        *[IGNORE] * len(p),
        *c,
        *[IGNORE] * len(o),
        *a,
        eos,
    ]
    assert len(o) == len("<output>\n293862\n</output>\n")  # one token per character
    # A plain string demonstration: everything after the prompt is trained; padding is not.
    short = [*ids("12*3="), *ids("####36"), eos]
    assert input_ids[1, : len(short)].tolist() == short
    assert (input_ids[1, len(short) :] == pad).all()
    assert labels[1].tolist() == [
        *[IGNORE] * len(ids("12*3=")),
        *ids("####36"),
        eos,
        *[IGNORE] * (input_ids.shape[1] - len(short)),
    ]


def test_a_string_and_its_one_segment_encode_alike() -> None:
    tokenizer = build_tokenizer()
    prompts = [prompt("3417*86=")]
    text = arith_tool.reference_solution(prompts[0])
    as_text = encode_batch(tokenizer, prompts, [text])
    as_segment = encode_batch(tokenizer, prompts, [[Segment(text)]])
    assert all(torch.equal(x, y) for x, y in zip(as_text, as_segment, strict=True))
    # The same text with its observation marked differs only in the observation's labels.
    marked = encode_batch(tokenizer, prompts, [arith_tool.tool_segments(prompts[0])])
    assert torch.equal(marked[0], as_text[0])
    ignored = (marked[1] == IGNORE) & (as_text[1] != IGNORE)
    assert int(ignored.sum()) == len("<output>\n293862\n</output>\n")


REFUSED = "error: the warm-start evaluator runs only print() of integer arithmetic"


@pytest.mark.parametrize(
    ("code", "output"),
    [
        ("print(3417*86)\n", "293862"),
        ("print(9991//37)\n", "270"),
        ("print(7 % 3, -2 + 5)\nprint(10-4)\n", "1 3\n6"),
        ("print(1//0)\n", "ZeroDivisionError: integer division or modulo by zero"),
        ("print(12*\n", "SyntaxError: '(' was never closed"),
        ("print(2)\nimport os\n", f"2\n{REFUSED}"),
        ("print(2**10)\n", REFUSED),
        (f"print({'9' * 60}*{'9' * 60})", REFUSED),  # a 120-digit product is not computed
        ("open('/etc/passwd')\n", REFUSED),
        ("print(len('abc'))\n", REFUSED),
    ],
)
def test_the_arithmetic_evaluator_prints_what_python_would(code: str, output: str) -> None:
    assert run_arithmetic(code) == output


def test_demonstrations_mix_calls_and_direct_answers_stably() -> None:
    prompts = arith_tool.generate_prompts(400, seed=0, difficulty=4)
    chosen = [uses_tool(p, 0, 0.5) for p in prompts]
    assert 0.4 < sum(chosen) / len(chosen) < 0.6
    assert chosen == [uses_tool(p, 0, 0.5) for p in prompts]
    assert chosen != [uses_tool(p, 1, 0.5) for p in prompts]
    assert not any(uses_tool(p, 0, 0.0) for p in prompts)
    assert all(uses_tool(p, 0, 1.0) for p in prompts)
    for p, tool in zip(prompts[:20], chosen[:20], strict=True):
        demonstration = tool_demonstration(p, 0, 0.5)
        assert demonstration_text(demonstration).endswith(f"####{p.answer}")
        assert isinstance(demonstration, str) != tool


def test_a_tool_model_build_is_bit_reproducible(tmp_path: Path) -> None:
    defaults = default_settings("arith-tool")
    settings = dataclasses.replace(
        defaults,
        eval_size=4,
        warm_start=dataclasses.replace(defaults.warm_start, max_steps=3, batch_size=8),
    )
    for name in ("a", "b"):
        info = build_tiny_model(
            tmp_path / name, seed=0, settings=settings, progress=False, strict=False
        )
        assert info.task == "arith-tool" and info.steps == 3 and not info.in_band
    first = load_file(tmp_path / "a" / "model.safetensors")
    second = load_file(tmp_path / "b" / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert '"task": "arith-tool"' in (tmp_path / "a" / BUILD_INFO).read_text()
