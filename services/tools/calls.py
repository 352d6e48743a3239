"""Tool calls in a model's response: what ends a turn, found while the response streams.

Two formats (`tools.call_format`):
- fenced: a closed Markdown block of Python, "```python\\n<code>```". The block is the call.
- hermes: `<tool_call>{"name": "python", "arguments": {"code": "<code>"}}</tool_call>`, the
  format of chat templates that declare tools (Qwen2.5/3, Hermes, Llama-3-Groq). Declared to
  the template as `PYTHON_TOOL`.
`auto` picks hermes when the tokenizer's chat template mentions tools, else fenced.

Decoding stops as soon as the text so far ends a call, so the engine feeds each response's new
text to its own `CallDetector` after every decoded token. A detector scans only the text it has
not scanned (plus a marker's length of overlap, so a marker split across two tokens is found),
so a response of n characters costs O(n) in all, never O(n^2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

CallFormat = Literal["fenced", "hermes"]
CallFormatSetting = Literal["auto", "fenced", "hermes"]

FENCE_OPEN = "```python\n"
FENCE_CLOSE = "```"
HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
TOOL_NAME = "python"

# The tool as chat templates take it (`apply_chat_template(..., tools=[PYTHON_TOOL])`): an
# OpenAI-style function schema.
PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run Python code in a sandbox and return what it prints (stdout), or "
        "the last line of its error.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python program"}},
            "required": ["code"],
        },
    },
}


@dataclass(frozen=True)
class ToolCall:
    """One call found in a response. `error` is set for a call that cannot run (malformed JSON,
    an unknown tool): it still ends the turn, and the error becomes its observation."""

    code: str
    text: str  # the call as the model wrote it, markers included
    error: str | None = None


def template_declares_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a `tools` list (a template that declares
    tools to the model mentions the variable)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: {"default": ..., "tool_use": ...}
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def resolve_call_format(setting: CallFormatSetting, tokenizer: Any) -> CallFormat:
    """The call format to detect: `setting`, with auto resolved against the tokenizer."""
    if setting == "auto":
        return "hermes" if template_declares_tools(tokenizer) else "fenced"
    return setting


def parse_hermes(body: str, text: str) -> ToolCall:
    """The call inside `<tool_call>...</tool_call>` (`body`, markers excluded)."""
    try:
        payload = json.loads(body.strip())
    except json.JSONDecodeError as error:
        return ToolCall("", text, f"malformed tool call: {error.msg}")
    if not isinstance(payload, dict):
        return ToolCall("", text, "malformed tool call: not a JSON object")
    name = payload.get("name")
    if name != TOOL_NAME:
        return ToolCall("", text, f"unknown tool {name!r}; the only tool is {TOOL_NAME!r}")
    arguments = payload.get("arguments", payload.get("parameters"))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return ToolCall("", text, f"malformed tool call arguments: {error.msg}")
    code = arguments.get("code") if isinstance(arguments, dict) else None
    if not isinstance(code, str):
        return ToolCall("", text, 'malformed tool call: arguments need a string "code"')
    return ToolCall(code, text)


class CallDetector:
    """Finds the first complete call in text fed to it piece by piece (one detector per turn).

    `feed(piece)` returns the call once the text fed so far holds a closed one (and the same
    call on later feeds); until then None. Work per feed is O(len(piece) + marker length).
    """

    def __init__(self, call_format: CallFormat) -> None:
        self.format = call_format
        self._open, self._close = (
            (FENCE_OPEN, FENCE_CLOSE) if call_format == "fenced" else (HERMES_OPEN, HERMES_CLOSE)
        )
        # The unscanned tail that may hold the start of a marker split across two pieces; the
        # text before it is dropped (outside a call) or kept in `_body` (inside one).
        self._carry = ""
        self._body: list[str] | None = None  # pieces of the call's body, once it opened
        self._call: ToolCall | None = None

    @property
    def call(self) -> ToolCall | None:
        return self._call

    def feed(self, piece: str) -> ToolCall | None:
        if self._call is not None or not piece:
            return self._call
        window = self._carry + piece
        if self._body is None:
            found = window.find(self._open)
            if found < 0:
                self._carry = _tail(window, len(self._open) - 1)
                return None
            self._body = []
            window = window[found + len(self._open) :]
        found = window.find(self._close)
        if found < 0:
            self._carry = _tail(window, len(self._close) - 1)
            self._body.append(window[: len(window) - len(self._carry)])
            return None
        body = "".join(self._body) + window[:found]
        text = self._open + body + self._close
        self._call = ToolCall(body, text) if self.format == "fenced" else parse_hermes(body, text)
        return self._call


def _tail(text: str, length: int) -> str:
    """The last `length` characters of `text` (all of it when shorter)."""
    return text[len(text) - length :] if length < len(text) else text
