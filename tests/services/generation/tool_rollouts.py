"""What the multi-turn rollout tests of every backend share (test_hf_tools.py,
test_vllm_tools.py): runners standing in for the sandbox, the prompts and sampling settings of
the fitted transcripts (`tool_model.py`), and small helpers over responses.

The runners answer with what the fitted calls print: one at once, one holding its first call
until the test releases it, so a test can act while a call is running without sleeping.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from services.generation.base import SamplingSettings
from services.messages import SINGLE_TURN_AGENT, Prompt, Response
from services.tools.sandbox import ToolResult
from tests.services.generation.tool_model import OUTPUT, Transcript, prompt_ids

TEMPERATURE = 0.7
# The fitted model is all but certain of its transcripts at 0.7 (every model token's log-prob
# above -1e-4, within the tolerance of 0): the log-prob checks sample hotter, where most
# responses still call and log-probs reach -5 and below.
HOT = 1.2


class PrintingRunner:
    """Answers every call at once with what the fitted calls print."""

    def __init__(self) -> None:
        self.codes: list[str] = []
        self._lock = threading.Lock()

    def run(self, code: str) -> ToolResult:
        with self._lock:
            self.codes.append(code)
        return ToolResult(output=OUTPUT + "\n", status="ok", seconds=0.0)


class GatedRunner(PrintingRunner):
    """Holds its first call until `release()`; `started` is set once that call is running."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self._gate = threading.Event()
        self._first = True

    def release(self) -> None:
        self._gate.set()

    def run(self, code: str) -> ToolResult:
        with self._lock:
            first, self._first = self._first, False
        if first:
            self.started.set()
            self._gate.wait()
        return super().run(code)


class ToolBackend(Protocol):
    """The part of a backend these helpers use."""

    @property
    def tokenizer(self) -> Any: ...

    def generate(
        self, prompts: list[Prompt], group_size: int, sampling: SamplingSettings
    ) -> list[list[Response]]: ...


def prompt_of(transcript: Transcript, prompt_id: str = "p") -> Prompt:
    return Prompt(prompt_id, transcript.prompt, OUTPUT, messages=list(transcript.messages))


def sampling(max_new_tokens: int = 120, seed: int = 7) -> SamplingSettings:
    return SamplingSettings(temperature=TEMPERATURE, max_new_tokens=max_new_tokens, seed=seed)


def generate_one(backend: ToolBackend, transcript: Transcript, **settings: int) -> Response:
    [[response]] = backend.generate([prompt_of(transcript)], 1, sampling(**settings))
    return response


def call_tokens(backend: ToolBackend, transcript: Transcript) -> list[int]:
    ids: list[int] = backend.tokenizer(transcript.call, add_special_tokens=False)["input_ids"]
    return ids


def spans(mask: Sequence[bool]) -> list[tuple[bool, int]]:
    """Runs of equal values: [(value, length), ...]."""
    runs: list[tuple[bool, int]] = []
    for value in mask:
        if runs and runs[-1][0] == value:
            runs[-1] = (value, runs[-1][1] + 1)
        else:
            runs.append((value, 1))
    return runs


def check_single_turn_rows_skip_tools(
    backend: ToolBackend, runner: PrintingRunner, transcript: Transcript
) -> None:
    """A verl `single_turn_agent` row beside a tool row, in one batch of a backend with tools:
    the tool row calls; the single-turn row writes the same call (the model was fitted to) but
    it is not run, no observation follows, and its prompt declares no tool."""
    tool_row = prompt_of(transcript, "tool")
    single_row = replace(prompt_of(transcript, "single"), meta={"agent_name": SINGLE_TURN_AGENT})
    [[called], [single]] = backend.generate([tool_row, single_row], 1, sampling())

    assert any(called.observation_mask) and called.tool_calls == ["ok"]
    assert len(runner.codes) == 1  # the tool row's call only
    call = call_tokens(backend, transcript)
    assert single.response_token_ids[: len(call)] == call
    assert not any(single.observation_mask) and single.tool_calls == []
    assert single.prompt_token_ids == prompt_ids(backend.tokenizer, transcript)
