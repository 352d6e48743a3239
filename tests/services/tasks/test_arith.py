"""The arithmetic task: deterministic generation, disjoint splits, correct worked solutions."""

from __future__ import annotations

import ast
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from services.messages import Prompt
from services.tasks import arith
from services.tasks.answers import extract_final_answer, is_correct
from services.tasks.registry import get_task, task_names

REPO_ROOT = Path(__file__).resolve().parents[3]


def evaluate(expression: str) -> int:
    """Evaluate + - * over non-negative integers with Python's precedence (no eval())."""

    def walk(node: ast.expr) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp):
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
        raise AssertionError(f"unexpected syntax in {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


def texts(prompts: list[Prompt]) -> list[str]:
    return [p.text for p in prompts]


def test_docstring_example_is_exact() -> None:
    assert arith.reference_solution("7+12-5+9=") == "  19-5+9;    14+9;      23;####23"
    assert arith.reference_solution("(3+4)*2-5=") == "    7*2-5;     14-5;        9;####9"


def test_same_seed_same_prompts() -> None:
    assert arith.generate_prompts(50, seed=7) == arith.generate_prompts(50, seed=7)


def test_prefix_stable() -> None:
    # Asking for more prompts extends the list instead of reshuffling it.
    assert arith.generate_prompts(80, seed=3)[:20] == arith.generate_prompts(20, seed=3)


def test_different_seeds_differ() -> None:
    assert texts(arith.generate_prompts(50, seed=0)) != texts(arith.generate_prompts(50, seed=1))


def test_splits_differ_and_never_overlap() -> None:
    for seed in (0, 1):
        for difficulty in arith.LEVELS:
            train = set(texts(arith.generate_prompts(2000, seed, difficulty, "train")))
            evals = set(texts(arith.generate_prompts(300, seed, difficulty, "eval")))
            assert train and evals
            assert not train & evals, (seed, difficulty)


def test_split_is_a_property_of_the_text() -> None:
    for split in arith.SPLITS:
        for prompt in arith.generate_prompts(200, seed=5, split=split):
            assert arith.prompt_split(prompt.text) == split
            assert prompt.meta["split"] == split


def test_same_prompts_in_another_process() -> None:
    # A different PYTHONHASHSEED would change anything built on hash().
    code = (
        "import json; from services.tasks.arith import generate_prompts; "
        "print(json.dumps([p.text for p in generate_prompts(30, 11, 5, 'eval')]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == texts(arith.generate_prompts(30, 11, 5, "eval"))


def test_prompt_ids_unique_and_meta_set() -> None:
    prompts = arith.generate_prompts(300, seed=2, difficulty=4)
    assert len({p.prompt_id for p in prompts}) == 300
    assert all(p.meta["difficulty"] == "4" and p.meta["task"] == "arith" for p in prompts)


@pytest.mark.parametrize("difficulty", sorted(arith.LEVELS))
def test_reference_solutions_are_correct(difficulty: int) -> None:
    for prompt in arith.generate_prompts(300, seed=difficulty, difficulty=difficulty):
        expression = prompt.text.removesuffix("=")
        # The prompt means what ordinary precedence says, parentheses included.
        assert evaluate(expression) == int(prompt.answer)
        solution = arith.reference_solution(prompt)
        assert solution.endswith(f"####{prompt.answer}")
        assert extract_final_answer(solution) == prompt.answer
        lines = solution.split("####")[0].split(";")[:-1]
        first, steps = arith.parse_expression(prompt.text)
        assert len(lines) == len(steps) == arith.LEVELS[difficulty].terms - 1
        running = first
        for line, (op, operand) in zip(lines, steps, strict=True):
            running = arith.apply_op(running, op, operand)
            assert len(line) == len(expression)  # right-aligned to the prompt's width
            assert evaluate(line.strip()) == int(prompt.answer)  # each rewrite keeps the value
            leading = re.match(r"\(*(\d+)", line.strip())
            assert leading is not None and int(leading.group(1)) == running
            assert running >= 0


def test_default_lengths_are_long_enough() -> None:
    prompts = arith.generate_prompts(500, seed=0)
    lengths = [len(arith.reference_solution(p)) for p in prompts]
    within = sum(48 <= n <= 256 for n in lengths) / len(lengths)
    assert within >= 0.95
    assert 48 <= statistics.median(lengths) <= 256


def test_difficulty_changes_lengths() -> None:
    medians = [
        statistics.median(
            len(arith.reference_solution(p)) for p in arith.generate_prompts(200, 0, difficulty)
        )
        for difficulty in sorted(arith.LEVELS)
    ]
    assert medians == sorted(medians)
    assert len(set(medians)) == len(medians)
    assert max(medians) <= 256


def test_hardest_level_uses_multiplication_and_parentheses() -> None:
    prompts = texts(arith.generate_prompts(200, seed=0, difficulty=5))
    assert any("*" in t for t in prompts)
    assert any("(" in t for t in prompts)
    assert not any("*" in t for t in texts(arith.generate_prompts(200, seed=0, difficulty=3)))


@pytest.mark.parametrize("text", ["7+12", "7+12-5+9=", "(3+4)*2-5=", "((3+4)*2-5)*3="])
def test_parse_round_trip(text: str) -> None:
    first, steps = arith.parse_expression(text)
    assert arith.format_expression(first, steps) == text.removesuffix("=") + "="


@pytest.mark.parametrize(
    "text", ["", "7=", "hello", "7 + 12 =", "7+(2*3)=", "3+4*2=", "-3+4=", "7++2="]
)
def test_parse_rejects_non_canonical(text: str) -> None:
    with pytest.raises(ValueError, match="arith prompt"):
        arith.reference_solution(text)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="difficulty"):
        arith.generate_prompts(1, difficulty=9)
    with pytest.raises(ValueError, match="split"):
        arith.generate_prompts(1, split="test")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be"):
        arith.generate_prompts(-1)


def test_answers() -> None:
    assert extract_final_answer("a####1;####23 ") == "23"
    assert extract_final_answer("no marker") is None
    assert is_correct("  19-5+9;####23", "23")
    assert not is_correct("####24", "23")
    assert not is_correct("23", "23")


def test_registry() -> None:
    assert "arith" in task_names()
    task = get_task("arith")
    assert task.default_difficulty in task.difficulties
    prompts = task.generate_prompts(5, 0, task.default_difficulty, "train")
    assert prompts == arith.generate_prompts(5, 0)
    assert task.reference_solution(prompts[0]) == arith.reference_solution(prompts[0])
    with pytest.raises(ValueError, match="valid tasks: arith"):
        get_task("gsm8k")


def test_a_mixed_stream_draws_every_level_in_its_range_reproducibly() -> None:
    from services.tasks import iter_mixed_prompts

    first = list(itertools.islice(iter_mixed_prompts(3, 1, 5), 200))
    again = list(itertools.islice(iter_mixed_prompts(3, 1, 5), 200))
    assert first == again
    levels = [int(p.meta["difficulty"]) for p in first]
    assert set(levels) == {1, 2, 3, 4, 5}
    assert min(levels.count(level) for level in range(1, 6)) > 20  # roughly uniform
    assert len({p.prompt_id for p in first}) == 200
    # Each level's prompts are that level's own stream: the same texts as drawn alone.
    alone = arith.generate_prompts(levels.count(4), seed=3, difficulty=4)
    assert [p.text for p in first if p.meta["difficulty"] == "4"] == [p.text for p in alone]


def test_difficulty_max_below_difficulty_is_refused() -> None:
    from pydantic import ValidationError

    from services.spec import ArithTask

    with pytest.raises(ValidationError, match="difficulty_max"):
        ArithTask(difficulty=3, difficulty_max=2)
