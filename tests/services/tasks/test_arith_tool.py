"""The arith-tool task: prompts, answers, splits, determinism, and responses that used the tool."""

from __future__ import annotations

import itertools
import re

import pytest

from services.messages import Prompt
from services.reward.exact_match import ExactConfig, check_exact
from services.tasks import arith_tool
from services.tasks.answers import extract_final_answer, is_correct
from services.tasks.arith import prompt_split
from services.tasks.demonstration import demonstration_text
from services.tasks.registry import BUILTIN_MODEL_TASKS, BUILTIN_MODELS, get_task, task_names
from services.tools import calls, rollout


def test_the_docstring_example_is_exact() -> None:
    assert arith_tool.reference_solution("3417*86=") == (
        "```python\nprint(3417*86)\n```<output>\n293862\n</output>\n####293862"
    )
    assert arith_tool.direct_solution("3417*86=") == "####293862"
    assert arith_tool.answer_of("9991//37=") == 270  # 37 * 270 = 9990: floor division


def test_division_is_floor_division_of_non_negative_integers() -> None:
    prompts = [
        p
        for d in arith_tool.LEVELS
        for p in arith_tool.generate_prompts(200, seed=2, difficulty=d)
        if "//" in p.text
    ]
    assert prompts
    inexact = 0
    for p in prompts:
        left, op, right = arith_tool.parse_prompt(p.text)
        assert op == "//" and left >= 0 and right >= 2
        quotient = int(p.answer)
        assert quotient * right <= left < (quotient + 1) * right
        inexact += left % right != 0
    assert inexact > len(prompts) / 2  # not restricted to exact divisions


@pytest.mark.parametrize("difficulty", sorted(arith_tool.LEVELS))
def test_operands_have_the_level_s_digits(difficulty: int) -> None:
    level = arith_tool.LEVELS[difficulty]
    prompts = arith_tool.generate_prompts(300, seed=0, difficulty=difficulty)
    ops = {arith_tool.parse_prompt(p.text)[1] for p in prompts}
    assert ops == {"*", "//"}
    for p in prompts:
        left, op, right = arith_tool.parse_prompt(p.text)
        digits = level.multiply if op == "*" else level.divide
        assert (len(str(left)), len(str(right))) == digits
        assert p.text == f"{left}{op}{right}="
        assert p.answer == str(left * right if op == "*" else left // right)
        assert p.meta["difficulty"] == str(difficulty)


def test_the_default_level_asks_for_four_by_two_digits() -> None:
    assert arith_tool.DEFAULT_DIFFICULTY == 4
    prompt = arith_tool.generate_prompts(1)[0]
    assert re.fullmatch(r"\d{4}(\*|//)\d{2}=", prompt.text)


def test_same_seed_same_prompts_and_prefix_stable() -> None:
    first = arith_tool.generate_prompts(60, seed=5)
    assert first == arith_tool.generate_prompts(60, seed=5)
    assert arith_tool.generate_prompts(20, seed=5) == first[:20]
    assert first != arith_tool.generate_prompts(60, seed=6)
    assert len({p.prompt_id for p in first}) == 60


@pytest.mark.parametrize("difficulty", [2, 4, 5])
def test_train_and_eval_never_share_a_prompt(difficulty: int) -> None:
    train = {p.text for s in range(3) for p in arith_tool.generate_prompts(400, s, difficulty)}
    held = {
        p.text for s in range(3) for p in arith_tool.generate_prompts(100, s, difficulty, "eval")
    }
    assert train and held and not train & held
    for text in held:
        assert prompt_split(text) == "eval"


def test_mixed_stream_draws_every_level_deterministically() -> None:
    mixed = list(itertools.islice(arith_tool.iter_mixed_prompts(0, 1, 5), 200))
    assert mixed == list(itertools.islice(arith_tool.iter_mixed_prompts(0, 1, 5), 200))
    assert {p.meta["difficulty"] for p in mixed} == {"1", "2", "3", "4", "5"}


def test_bad_arguments_and_prompts_are_refused() -> None:
    with pytest.raises(ValueError, match="difficulty"):
        arith_tool.generate_prompts(1, difficulty=6)
    with pytest.raises(ValueError, match="split"):
        next(arith_tool.iter_prompts(0, 4, "test"))  # type: ignore[arg-type]
    for text in ("3+4=", "3417*86", "12//0=", "(3)*4=", "-3*4="):
        with pytest.raises(ValueError):
            arith_tool.parse_prompt(text)


def test_registered_with_its_model() -> None:
    assert "arith-tool" in task_names()
    task = get_task("arith-tool")
    assert task.default_difficulty == arith_tool.DEFAULT_DIFFICULTY
    assert task.difficulties == (1, 2, 3, 4, 5)
    assert task.generate_prompts(3, 1, 3, "eval") == arith_tool.generate_prompts(3, 1, 3, "eval")
    prompt = task.generate_prompts(1, 0, 4, "train")[0]
    assert task.reference_solution(prompt).endswith(f"####{prompt.answer}")
    stream = task.prompt_stream(0, 2, 4, "train")
    assert [p.meta["difficulty"] for p in itertools.islice(stream, 50)] != ["2"] * 50
    assert BUILTIN_MODEL_TASKS["tiny-arith-tool"] == "arith-tool"


def test_the_call_and_observation_are_the_rollout_s() -> None:
    # The demonstrations the tiny tool model learned from must be what the rollout writes.
    assert arith_tool.FENCE_OPEN == calls.FENCE_OPEN
    assert arith_tool.FENCE_CLOSE == calls.FENCE_CLOSE
    assert arith_tool.OUTPUT_OPEN == rollout.OUTPUT_OPEN
    assert arith_tool.OUTPUT_CLOSE == rollout.OUTPUT_CLOSE
    # The rollout's detector stops exactly where the demonstration's call segment ends, with
    # the call's code; and the observation it appends for print's output is the next segment.
    call, observed, answer = arith_tool.tool_segments("9991//37=")
    detector = calls.CallDetector("fenced")
    found = [detector.feed(char) for char in call.text]
    assert found[:-1] == [None] * (len(call.text) - 1)
    assert found[-1] is not None and found[-1].code == "print(9991//37)\n"
    shown = rollout.truncate_observation("270\n".removesuffix("\n"), 1000)
    assert observed.observation and not call.observation and not answer.observation
    assert observed.text == rollout.OUTPUT_OPEN + shown + rollout.OUTPUT_CLOSE
    assert answer.text == "####270"


def response_prompt(text: str) -> Prompt:
    return Prompt(prompt_id="p", text=text, answer=str(arith_tool.answer_of(text)))


def test_a_response_that_used_the_tool_verifies() -> None:
    prompt = response_prompt("3417*86=")
    response = demonstration_text(arith_tool.tool_segments(prompt)) + "<eos>"
    assert extract_final_answer(response) == "293862<eos>"
    assert is_correct(arith_tool.reference_solution(prompt), prompt.answer)
    assert check_exact(response, prompt.answer, ExactConfig()).correct
    # A call whose output is right, but an answer copied wrong, is wrong; so is no answer.
    wrong = arith_tool.reference_solution(prompt).replace("####293862", "####293826")
    assert not check_exact(wrong, prompt.answer, ExactConfig()).correct
    unanswered = arith_tool.tool_call(prompt) + arith_tool.observation("293862\n")
    assert not check_exact(unanswered, prompt.answer, ExactConfig()).correct


def test_the_spec_accepts_every_built_in_model_and_task() -> None:
    from services.spec import ArithTask, RunSpec

    assert set(BUILTIN_MODELS) == set(BUILTIN_MODEL_TASKS) == {"tiny-arith", "tiny-arith-tool"}
    assert [RunSpec(model=name).model for name in BUILTIN_MODELS] == list(BUILTIN_MODELS)
    assert ArithTask(name="arith-tool", difficulty=4).name in task_names()
