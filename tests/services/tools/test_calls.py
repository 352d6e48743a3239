"""Tool-call detection on streamed text (services/tools/calls.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.tools.calls import CallDetector, ToolCall, parse_hermes, resolve_call_format

FENCED = "Let me check.\n```python\nx = 6 * 7\nprint(x)\n```"
HERMES = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'


def feed_in_pieces(detector: CallDetector, text: str, size: int) -> list[ToolCall | None]:
    """What `feed` returns after each piece of `size` characters."""
    return [detector.feed(text[i : i + size]) for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
def test_a_fenced_call_is_found_when_it_closes_however_the_text_is_split(size: int) -> None:
    results = feed_in_pieces(CallDetector("fenced"), FENCED, size)
    assert results[:-1] == [None] * (len(results) - 1), "found before the block closed"
    assert results[-1] == ToolCall("x = 6 * 7\nprint(x)\n", FENCED.removeprefix("Let me check.\n"))


@pytest.mark.parametrize("size", [1, 4, 7, 1000])
def test_a_hermes_call_is_found_when_it_closes_however_the_text_is_split(size: int) -> None:
    results = feed_in_pieces(CallDetector("hermes"), "I will run it. " + HERMES, size)
    assert results[:-1] == [None] * (len(results) - 1)
    assert results[-1] == ToolCall("print(1)", HERMES)


def test_text_that_is_no_call_finds_nothing() -> None:
    detector = CallDetector("fenced")
    # An unclosed block, a block of another language, a bare fence: none is a Python call.
    for piece in ["```js\nx\n```", " ``` ", "```python", " print(1)", "\n"]:
        assert detector.feed(piece) is None
    assert CallDetector("hermes").feed(FENCED) is None
    assert CallDetector("fenced").feed(HERMES) is None


def test_the_first_call_is_kept_and_later_text_ignored() -> None:
    detector = CallDetector("fenced")
    first = detector.feed(FENCED)
    assert first is not None
    assert detector.feed("```python\nprint(2)\n```") == first == detector.call


def test_a_marker_split_across_pieces_mid_body_is_found() -> None:
    detector = CallDetector("fenced")
    for piece in ["``", "`pyt", "hon\nprint(1)\n`", "`", "`"]:
        found = detector.feed(piece)
    assert found == ToolCall("print(1)\n", "```python\nprint(1)\n```")


def test_work_per_piece_is_bounded_by_the_piece_not_the_response() -> None:
    # The detector keeps at most a marker's length of text it has scanned outside a call.
    detector = CallDetector("fenced")
    for _ in range(10_000):
        detector.feed("no call here; ")
    assert len(detector._carry) < len("```python\n")


def hermes_body(payload: Any) -> str:
    return json.dumps(payload)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("{not json", "malformed tool call"),
        ("[1, 2]", "not a JSON object"),
        (hermes_body({"name": "shell", "arguments": {"code": "ls"}}), "unknown tool 'shell'"),
        (hermes_body({"name": "python", "arguments": {"src": "1"}}), 'string "code"'),
        (hermes_body({"name": "python", "arguments": "{bad"}), "malformed tool call arguments"),
    ],
)
def test_a_malformed_hermes_call_is_a_call_with_an_error(body: str, error: str) -> None:
    call = parse_hermes(body, f"<tool_call>{body}</tool_call>")
    assert call.error is not None and error in call.error and call.code == ""


def test_hermes_arguments_may_be_a_json_string() -> None:
    body = hermes_body({"name": "python", "arguments": json.dumps({"code": "print(3)"})})
    assert parse_hermes(body, "").code == "print(3)"


class Tokenizer:
    def __init__(self, chat_template: object) -> None:
        self.chat_template = chat_template


def test_auto_is_hermes_when_the_chat_template_declares_tools() -> None:
    with_tools = Tokenizer("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}")
    assert resolve_call_format("auto", with_tools) == "hermes"
    assert resolve_call_format("auto", Tokenizer("{{ messages }}")) == "fenced"
    assert resolve_call_format("auto", Tokenizer(None)) == "fenced"
    assert resolve_call_format("auto", Tokenizer({"default": "x", "tool_use": "{{ tools }}"})) == (
        "hermes"
    )
    assert resolve_call_format("fenced", with_tools) == "fenced"
