"""Multi-turn (tool-integrated) rollouts: the part every generation backend shares.

A response alternates model turns and observations. Per response, `ResponseTurns` decides after
each sampled token whether decoding goes on, ends (and with which finish reason), or stops at a
tool call; `ToolCalls` runs the calls on threads of its own through a `ToolRunner`, so the
decoding thread only polls futures (responses not waiting on a call keep decoding while one
runs); `ObservationEncoder` turns a call's result into the observation tokens appended to the
context. services/tools/rows.py holds a response as both backends decode it (its tokens, its
turns, the call it is parked on) and the rows parked on calls; each backend keeps only what
talks to its engine: feeding tokens, and resuming a row over its whole context.

Limits, each with its finish reason (checked in this order after every model token):
- "stop": the model sampled an end-of-sequence token;
- "length": `max_new_tokens` model tokens (observation tokens do not count);
- "max_context": prompt + response (model and observation tokens) reached
  `max_context_tokens`; an observation that would leave no room for one more model token is not
  appended, and the response ends after its call with this reason;
- "max_turns": a call in the last of `max_turns` model turns (not run);
- "max_calls": a call beyond `max_calls` (not run).

Observations (`ObservationEncoder`): for a response to a chat prompt, when the chat template
renders a `tool` message, the tokens of what the template puts between the assistant's text and
the next assistant turn (end of the assistant turn, the tool message, the generation prompt);
otherwise a fixed wrapper "<output>\\n...\\n</output>\\n". The tool's output is tokenized with its
special tokens split, so a program cannot print its way into the chat's control tokens.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from services.messages import ChatMessage, FinishReason
from services.tools.calls import (
    PYTHON_TOOL,
    CallDetector,
    CallFormat,
    ToolCall,
    resolve_call_format,
)
from services.tools.config import ToolsConfig
from services.tools.sandbox import ToolResult, ToolRunner, observation_text

OUTPUT_OPEN = "<output>\n"
OUTPUT_CLOSE = "\n</output>\n"
TRUNCATED = "\n[output truncated]"

# What happened after a model token: go on, stop at a tool call, or end the response.
Decision = Literal["continue", "call"] | FinishReason


def build_runner(config: ToolsConfig) -> ToolRunner:
    """Where `config`'s calls run: the sandbox server's client, or sandboxed processes of this
    process. The token is read here, in the process that calls, from its environment: it never
    travels in a spec or a message. Either runner blocks its caller for one call; `ToolCalls`
    owns the threads (and so the one bound on calls in flight)."""
    from services.tools.client import HttpSandbox, LocalSandbox
    from services.tools.sandbox import SandboxLimits

    if config.sandbox_url is not None:
        token = os.environ.get(config.sandbox_token_env) or None
        return HttpSandbox(config.sandbox_url, token, config.timeout_s)
    limits = SandboxLimits(timeout_s=config.timeout_s, max_output_chars=config.max_output_chars)
    return LocalSandbox(limits=limits, max_concurrency=config.max_concurrent_calls)


def truncate_observation(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars` characters, saying so when it was cut."""
    return text if len(text) <= max_chars else text[:max_chars] + TRUNCATED


class ResponseTurns:
    """Turn bookkeeping of one response: what each model token means for it."""

    def __init__(
        self, call_format: CallFormat, settings: ToolsConfig, max_new_tokens: int, context: int
    ) -> None:
        self._format = call_format
        self._settings = settings
        self._max_new_tokens = max_new_tokens
        self._context_limit = context
        self.detector = CallDetector(call_format)
        self.model_tokens = 0
        self.turns = 1  # the model turn in progress
        self.calls = 0  # calls run (their observation appended)
        self.call: ToolCall | None = None  # the call the response stopped at, if any

    def after_model_token(self, piece: str, eos: bool, context_tokens: int) -> Decision:
        """The decision after a model token whose decoded text is `piece`; `context_tokens`:
        prompt + response tokens with it."""
        self.model_tokens += 1
        if eos:
            return "stop"
        if self.model_tokens >= self._max_new_tokens:
            return "length"
        if context_tokens >= self._context_limit:
            return "max_context"
        call = self.detector.feed(piece)
        if call is None:
            return "continue"
        self.call = call
        if self.turns >= self._settings.max_turns:
            return "max_turns"
        if self.calls >= self._settings.calls_allowed:
            return "max_calls"
        return "call"

    def fits(self, context_tokens: int, observation_tokens: int) -> bool:
        """Whether an observation leaves room for at least one more model token."""
        return context_tokens + observation_tokens < self._context_limit

    def observed(self) -> None:
        """The call's observation was appended: the next model turn begins."""
        self.calls += 1
        self.turns += 1
        self.call = None
        self.detector = CallDetector(self._format)


class IncrementalText:
    """The text each new token adds to a token sequence, decoded incrementally.

    Decodes a short window (from the last token boundary that decoded cleanly) rather than the
    whole sequence, so each token costs O(1): a token that ends inside a multi-byte character
    adds nothing until the character is complete (the window's text then ends in U+FFFD).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], start: int = 0) -> None:
        self._decode = decode
        self._prefix = start  # window start
        self._read = start  # tokens before this were turned into text

    def restart(self, start: int) -> None:
        """Begin a new turn at token `start` (observation tokens are not model text)."""
        self._prefix = self._read = start

    def push(self, tokens: Sequence[int]) -> str:
        """The new text of `tokens` (the whole sequence so far, its last token new)."""
        before = (
            self._decode(tokens[self._prefix : self._read]) if self._read > self._prefix else ""
        )
        after = self._decode(tokens[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(tokens)
        return after[len(before) :]


class ObservationEncoder:
    """Token ids of observations (see the module docstring)."""

    _PLACEHOLDER = "\x00kpo-assistant\x00"
    _OBSERVATION = "\x00kpo-observation\x00"

    def __init__(self, tokenizer: Any, declare_tools: bool) -> None:
        self._tokenizer = tokenizer
        self._tools = [PYTHON_TOOL] if declare_tools else None
        self._chat = self._chat_frame()

    @property
    def chat_supported(self) -> bool:
        """Whether the chat template renders tool messages (else the wrapper is used)."""
        return self._chat is not None

    def _chat_frame(self) -> tuple[str, str] | None:
        """The template's text before and after a tool message's content, between the end of an
        assistant's text and the next assistant turn; None when it renders no tool message."""
        if not getattr(self._tokenizer, "chat_template", None):
            return None
        messages: list[ChatMessage] = [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": self._PLACEHOLDER},
            {"role": "tool", "content": self._OBSERVATION},
        ]
        try:
            rendered = self._tokenizer.apply_chat_template(
                messages, tools=self._tools, add_generation_prompt=True, tokenize=False
            )
        except Exception:  # a template that refuses the tool role: use the wrapper
            return None
        if not isinstance(rendered, str) or self._PLACEHOLDER not in rendered:
            return None
        delta = rendered.split(self._PLACEHOLDER, 1)[1]
        if self._OBSERVATION not in delta:
            return None
        before, after = delta.split(self._OBSERVATION, 1)
        return before, after

    def encode(self, observation: str, chat: bool) -> list[int]:
        """The observation's tokens: through the chat template for a response to a chat prompt
        (where it renders tool messages), else in the `<output>` wrapper."""
        before, after = (
            self._chat if chat and self._chat is not None else (OUTPUT_OPEN, OUTPUT_CLOSE)
        )
        return [*self._ids(before, False), *self._ids(observation, True), *self._ids(after, False)]

    def _ids(self, text: str, split_special: bool) -> list[int]:
        if not text:
            return []
        encoded = self._tokenizer(
            text, add_special_tokens=False, split_special_tokens=split_special
        )
        return [int(token) for token in encoded["input_ids"]]

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools to declare when rendering a chat prompt (None: none)."""
        return self._tools


@dataclass
class ToolCallStats:
    """Counters of a backend's calls (read for metrics)."""

    calls: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class ToolCalls:
    """Runs calls through a `ToolRunner` on `max_concurrent` threads of its own.

    `submit` returns at once; the caller polls the future (`done()`) between decoding steps. A
    runner that raises (it should not: failures are results) gives an "unavailable" result, so
    a call never fails the run.
    """

    def __init__(self, runner: ToolRunner, max_concurrent: int, max_output_chars: int) -> None:
        self.runner = runner
        self._max_output_chars = max_output_chars
        self._pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="tool-call")
        self._lock = threading.Lock()
        self.stats = ToolCallStats()

    def submit(self, call: ToolCall) -> Future[ToolResult]:
        if call.error is not None:  # never reaches the sandbox: its error is the observation
            done: Future[ToolResult] = Future()
            done.set_result(ToolResult(output=f"error: {call.error}", status="error", seconds=0.0))
            self._count(done.result())
            return done
        return self._pool.submit(self._run, call.code)

    def _run(self, code: str) -> ToolResult:
        try:
            result = self.runner.run(code)
        except Exception:  # the observation says the sandbox failed; the run goes on
            result = ToolResult(output="", status="unavailable", seconds=0.0)
        self._count(result)
        return result

    def _count(self, result: ToolResult) -> None:
        with self._lock:
            self.stats.calls += 1
            self.stats.by_status[result.status] = self.stats.by_status.get(result.status, 0) + 1
            self.stats.seconds += result.seconds

    def counts(self) -> dict[str, int]:
        """Calls by result status (safe from any thread)."""
        with self._lock:
            return dict(self.stats.by_status)

    def observation(self, result: ToolResult) -> str:
        """The text appended for `result`, at most `max_output_chars` (plus a truncation mark)."""
        # One trailing newline (print's) is dropped: the wrappers put their own around it.
        text = observation_text(result).removesuffix("\n")
        return truncate_observation(text, self._max_output_chars)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class ToolRollout:
    """What a backend needs for multi-turn rollouts: settings, the resolved call format, the
    observation encoder and the call runner (one per backend)."""

    def __init__(self, settings: ToolsConfig, runner: ToolRunner, tokenizer: Any) -> None:
        self.settings = settings
        self.call_format: CallFormat = resolve_call_format(settings.call_format, tokenizer)
        self.encoder = ObservationEncoder(tokenizer, declare_tools=self.call_format == "hermes")
        self.calls = ToolCalls(runner, settings.max_concurrent_calls, settings.max_output_chars)

    def turns(self, max_new_tokens: int, context_limit: int) -> ResponseTurns:
        """Turn bookkeeping for a new response."""
        limit = self.settings.max_context_tokens
        return ResponseTurns(
            self.call_format,
            self.settings,
            max_new_tokens,
            context_limit if limit is None else min(limit, context_limit),
        )

    def close(self) -> None:
        """End the calls in flight and close the runner (an HTTP client's connections)."""
        self.calls.close()
        close = getattr(self.calls.runner, "close", None)
        if close is not None:
            close()
