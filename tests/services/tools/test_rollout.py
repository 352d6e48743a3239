"""The shared multi-turn pieces (services/tools/rollout.py): limits, observations, calls."""

from __future__ import annotations

import pytest

from services.tasks.tokenizer import build_tokenizer
from services.tools.calls import ToolCall
from services.tools.config import ToolsConfig
from services.tools.rollout import (
    TRUNCATED,
    IncrementalText,
    ObservationEncoder,
    ResponseTurns,
    ToolCalls,
)
from services.tools.sandbox import ToolResult

CALL = "```python\nprint(1)\n```"


def turns(max_new_tokens: int = 100, context: int = 1000, **settings: int) -> ResponseTurns:
    return ResponseTurns("fenced", ToolsConfig(enabled=True, **settings), max_new_tokens, context)


def feed(response: ResponseTurns, text: str, context_start: int = 10) -> list[str]:
    """The decision after each character of `text` (one token per character)."""
    return [
        response.after_model_token(char, False, context_start + i + 1)
        for i, char in enumerate(text)
    ]


def test_a_closed_call_stops_the_turn_and_the_next_turn_starts_afresh() -> None:
    response = turns()
    decisions = feed(response, "hi " + CALL)
    assert decisions == ["continue"] * (len(decisions) - 1) + ["call"]
    assert response.call == ToolCall("print(1)\n", CALL)
    response.observed()
    assert (response.turns, response.calls, response.call) == (2, 1, None)
    assert feed(response, "done")[-1] == "continue"


@pytest.mark.parametrize(
    ("settings", "reason"),
    [({"max_turns": 1}, "max_turns"), ({"max_turns": 3, "max_calls": 0}, "max_calls")],
)
def test_a_call_the_limits_do_not_let_run_ends_the_response(
    settings: dict[str, int], reason: str
) -> None:
    assert feed(turns(**settings), CALL)[-1] == reason


def test_the_default_max_calls_is_one_per_turn_but_the_last() -> None:
    response = turns(max_turns=3)
    for _ in range(2):
        assert feed(response, CALL)[-1] == "call"
        response.observed()
    assert feed(response, CALL)[-1] == "max_turns"


def test_token_limits_come_before_a_call_and_eos_before_everything() -> None:
    response = turns(max_new_tokens=len(CALL))
    assert feed(response, CALL)[-1] == "length"
    assert turns(max_new_tokens=1).after_model_token("x", True, 5000) == "stop"
    assert turns(context=20).after_model_token("x", False, 20) == "max_context"


def test_an_observation_fits_only_with_room_for_one_more_model_token() -> None:
    response = turns(context=100)
    assert response.fits(90, 9) and not response.fits(90, 10)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_turns"):
        ToolsConfig(enabled=True, max_turns=0)
    with pytest.raises(ValueError, match="max_output_chars"):
        ToolsConfig(enabled=True, max_output_chars=0)


def test_incremental_text_waits_for_a_whole_character() -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer("a€b", add_special_tokens=False)["input_ids"]  # € is three byte tokens
    text = IncrementalText(lambda t: tokenizer.decode(list(t)))
    pieces = [text.push(ids[: i + 1]) for i in range(len(ids))]
    assert pieces == ["a", "", "", "€", "b"]
    text.restart(len(ids))
    assert text.push([*ids, *tokenizer("c", add_special_tokens=False)["input_ids"]]) == "c"


CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_observations_in_the_wrapper_or_as_a_tool_message_through_the_template() -> None:
    tokenizer = build_tokenizer()
    plain = ObservationEncoder(tokenizer, declare_tools=False)
    assert not plain.chat_supported  # no template: the wrapper, even for a chat
    assert tokenizer.decode(plain.encode("42", chat=True)) == "<output>\n42\n</output>\n"
    tokenizer.chat_template = CHATML
    chat = ObservationEncoder(tokenizer, declare_tools=False)
    assert tokenizer.decode(chat.encode("42", chat=True)) == (
        "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(chat.encode("42", chat=False)) == "<output>\n42\n</output>\n"


def test_a_template_without_a_tool_role_falls_back_to_the_wrapper() -> None:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tools') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    encoder = ObservationEncoder(tokenizer, declare_tools=False)
    assert not encoder.chat_supported
    assert tokenizer.decode(encoder.encode("1", chat=True)) == "<output>\n1\n</output>\n"


def test_tool_output_cannot_spell_special_tokens() -> None:
    tokenizer = build_tokenizer()
    ids = ObservationEncoder(tokenizer, declare_tools=False).encode("<eos>", chat=False)
    assert tokenizer.eos_token_id not in ids


class Runner:
    def __init__(self, result: ToolResult | Exception) -> None:
        self.result = result
        self.codes: list[str] = []

    def run(self, code: str) -> ToolResult:
        self.codes.append(code)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_calls_run_off_the_caller_and_become_truncated_observations() -> None:
    runner = Runner(ToolResult(output="x" * 50 + "\n", status="ok", seconds=0.5))
    calls = ToolCalls(runner, max_concurrent=2, max_output_chars=10)
    result = calls.submit(ToolCall("print(1)", CALL)).result()
    assert runner.codes == ["print(1)"]
    assert calls.observation(result) == "x" * 10 + TRUNCATED
    assert calls.stats.calls == 1 and calls.stats.by_status == {"ok": 1}
    calls.close()


def test_a_malformed_call_never_reaches_the_runner() -> None:
    runner = Runner(ToolResult(output="", status="ok", seconds=0.0))
    calls = ToolCalls(runner, max_concurrent=1, max_output_chars=100)
    result = calls.submit(ToolCall("", "<tool_call>{</tool_call>", "malformed tool call")).result()
    assert calls.observation(result) == "error: malformed tool call" and runner.codes == []
    assert calls.stats.by_status == {"error": 1}
    calls.close()


def test_a_runner_that_raises_gives_an_unavailable_observation() -> None:
    calls = ToolCalls(Runner(ConnectionError("down")), max_concurrent=1, max_output_chars=100)
    result = calls.submit(ToolCall("print(1)", CALL)).result()
    assert result.status == "unavailable"
    assert calls.observation(result) == "error: sandbox unavailable"
    calls.close()
