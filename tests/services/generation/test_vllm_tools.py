"""Multi-turn rollouts of the vLLM backend, on a real vLLM engine with a tiny model that really
calls the tool (`tool_model.py`): the checks every backend runs (`multi_turn_checks.py`), and
what is vLLM's own (segments, the engine's model length, seeds, greedy groups).

The engine decodes the call from the model's logits, stops at it (a stop string), the call runs
through a ToolRunner standing in for the sandbox, the observation is appended and the whole
context goes back to vLLM as a token prompt for the answer. Runs only where vLLM is installed
(`make test-vllm`); elsewhere the module is skipped. One engine serves the module; each test
enables tools on it with its own settings (`enable_tools` on the idle backend).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from services.generation.vllm_backend import VLLMBackend
from services.messages import Prompt
from services.tools.calls import CallFormatSetting
from services.tools.config import ToolsConfig
from tests.services.generation import multi_turn_checks as checks
from tests.services.generation.multi_turn_checks import *  # noqa: F403 (the shared tests)
from tests.services.generation.tool_model import (
    CHAT,
    HERMES,
    OUTPUT,
    PLAIN,
    Transcript,
    prompt_ids,
)
from tests.services.generation.tool_rollouts import (
    PrintingRunner,
    prompt_of,
    sampling,
)

# As test_vllm_backend.py: vLLM's CPU kernels against transformers' eager ops, both float32.
LOGPROB_ATOL = 1e-4
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def backend(tool_model_dir: Path) -> Iterator[VLLMBackend]:
    """One engine for the module: float32 to compare with transformers, eager, a small KV cache,
    prefix caching on (each turn resubmits its whole context)."""
    engine = VLLMBackend(
        tool_model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=32 * 2**20,
        enable_prefix_caching=True,
        engine_kwargs={"block_size": 32},
    )
    yield engine
    engine.close()


@pytest.fixture
def enqueued(backend: VLLMBackend, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The token prompt of every request the backend adds to the engine (recorded on its way
    to the real `LLM.enqueue`)."""
    prompts: list[list[int]] = []
    real = backend.llm.enqueue

    def recording(prompts_in: Sequence[Any], *args: Any, **kwargs: Any) -> list[str]:
        prompts.extend(list(p["prompt_token_ids"]) for p in prompts_in)
        ids: list[str] = real(prompts_in, *args, **kwargs)
        return ids

    monkeypatch.setattr(backend.llm, "enqueue", recording)
    return prompts


def with_tools(
    backend: VLLMBackend,
    runner: PrintingRunner,
    call_format: CallFormatSetting = "fenced",
    **limits: int,
) -> VLLMBackend:
    backend.enable_tools(ToolsConfig(enabled=True, call_format=call_format, **limits), runner)
    return backend


@pytest.fixture
def harness(backend: VLLMBackend, tool_model_dir: Path) -> checks.Harness:
    def backend_with_tools(
        runner: PrintingRunner, call_format: CallFormatSetting = "fenced", **limits: int
    ) -> VLLMBackend:
        return with_tools(backend, runner, call_format, **limits)

    return checks.Harness(tool_model_dir, backend_with_tools, LOGPROB_ATOL)


@pytest.mark.parametrize(
    ("transcript", "call_format", "segments"),
    [(PLAIN, "fenced", 3), (CHAT, "fenced", 3), (HERMES, "hermes", 2)],
    ids=["fenced-plain", "fenced-chat", "hermes"],
)
def test_a_two_turn_response_is_vllm_segments_over_the_whole_context(
    harness: checks.Harness,
    enqueued: list[list[int]],
    transcript: Transcript,
    call_format: CallFormatSetting,
    segments: int,
) -> None:
    backend, response = checks.check_two_turns(harness, transcript, call_format)
    # Segments: vLLM stopped at the opening fence (decoding went on), at the call's close, then
    # the answer came from the whole context resubmitted as a token prompt.
    prompt = prompt_ids(backend.tokenizer, transcript)
    assert len(enqueued) == segments
    assert enqueued[0] == prompt
    observed = len(response.observation_mask) - response.observation_mask[::-1].index(True)
    assert enqueued[-1] == prompt + response.response_token_ids[:observed]


def test_a_seeded_group_is_reproducible(backend: VLLMBackend) -> None:
    with_tools(backend, PrintingRunner())
    first = backend.generate([prompt_of(PLAIN)], 3, sampling(seed=5))
    again = backend.generate([prompt_of(PLAIN)], 3, sampling(seed=5))
    assert [r.response_token_ids for r in first[0]] == [r.response_token_ids for r in again[0]]


def test_the_engines_model_length_bounds_the_context(backend: VLLMBackend) -> None:
    """tools.max_context_tokens above max_model_len: the engine's length is the limit."""
    with_tools(backend, PrintingRunner(), max_context_tokens=10 * MAX_MODEL_LEN)
    filler = "Q: 6*7?\n" * ((MAX_MODEL_LEN - 8) // 8)
    prompt = Prompt("long", filler, OUTPUT)
    [[response]] = backend.generate([prompt], 1, sampling(max_new_tokens=200))
    assert len(response.prompt_token_ids) + len(response.response_token_ids) <= MAX_MODEL_LEN
    assert response.finish_reason in {"stop", "max_context"}


def test_greedy_decoding_repeats_one_multi_turn_response(backend: VLLMBackend) -> None:
    with_tools(backend, PrintingRunner())
    greedy = replace(sampling(), temperature=0.0)
    [group] = backend.generate([prompt_of(PLAIN)], 3, greedy)
    assert len(group) == 3 and all(r == group[0] for r in group)
    assert any(group[0].observation_mask) and set(group[0].behaviour_logprobs) == {0.0}
