"""Multi-turn rollouts of the vLLM backend, on a real vLLM engine with a tiny model that really
calls the tool (`tool_model.py`), mirroring test_hf_tools.py.

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

import torch
from transformers import AutoModelForCausalLM

from services.generation.base import GroupRequest, SamplingSettings
from services.generation.hf_backend import processed_logprobs
from services.generation.vllm_backend import VLLMBackend
from services.messages import Prompt, Response
from services.tools.calls import CallFormatSetting
from services.tools.rollout import ToolSettings
from tests.services.generation.tool_model import (
    CHAT,
    HERMES,
    OUTPUT,
    PLAIN,
    Transcript,
    prompt_ids,
)
from tests.services.generation.tool_rollouts import (
    HOT,
    GatedRunner,
    PrintingRunner,
    call_tokens,
    check_single_turn_rows_skip_tools,
    generate_one,
    prompt_of,
    sampling,
    spans,
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


@pytest.fixture(scope="module")
def reference(tool_model_dir: Path) -> torch.nn.Module:
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        str(tool_model_dir), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def original_weights(reference: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in reference.state_dict().items()}


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
    backend.enable_tools(ToolSettings(call_format=call_format, **limits), runner)
    return backend


def offline_logprobs(
    model: torch.nn.Module, response: Response, settings: SamplingSettings | None = None
) -> torch.Tensor:
    """Processed log-probs (under `settings`, default `sampling()`) of every response token
    under `model`: one forward over the whole context (prompt, model and observation tokens)."""
    ids = response.prompt_token_ids + response.response_token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    start = len(response.prompt_token_ids)
    logprobs = processed_logprobs(logits[start - 1 : len(ids) - 1], settings or sampling())
    return logprobs.gather(-1, torch.tensor(response.response_token_ids)[:, None])[:, 0]


def step_to_the_end(backend: VLLMBackend) -> list[list[Response]]:
    ended: list[list[Response]] = []
    while backend.in_flight:
        ended += backend.step()
    return ended


@pytest.mark.parametrize(
    ("transcript", "call_format", "segments"),
    [(PLAIN, "fenced", 3), (CHAT, "fenced", 3), (HERMES, "hermes", 2)],
    ids=["fenced-plain", "fenced-chat", "hermes"],
)
def test_a_two_turn_response_is_model_tokens_observation_model_tokens(
    backend: VLLMBackend,
    enqueued: list[list[int]],
    transcript: Transcript,
    call_format: CallFormatSetting,
    segments: int,
) -> None:
    runner = PrintingRunner()
    response = generate_one(with_tools(backend, runner, call_format), transcript)
    tools = backend.tools
    assert tools is not None

    call = call_tokens(backend, transcript)
    observation = tools.encoder.encode(OUTPUT, chat=transcript.chat)
    prompt = prompt_ids(backend.tokenizer, transcript)
    assert response.prompt_token_ids == prompt
    # Model turn (the call), observation, model turn (the answer, ended by EOS).
    assert spans(response.observation_mask)[:2] == [(False, len(call)), (True, len(observation))]
    assert len(spans(response.observation_mask)) == 3
    ids = response.response_token_ids
    assert ids[: len(call)] == call
    assert ids[len(call) : len(call) + len(observation)] == observation
    assert ids[-1] == backend.tokenizer.eos_token_id
    assert response.finish_reason == "stop" and response.tool_calls == ["ok"]
    assert runner.codes == ["print(6*7)\n" if call_format == "fenced" else "print(6*7)"]
    if transcript.chat:
        text = backend.tokenizer.decode(observation)
        assert text == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    else:
        assert backend.tokenizer.decode(observation) == "<output>\n42\n</output>\n"

    # Segments: vLLM stopped at the opening fence (decoding went on), at the call's close, then
    # the answer came from the whole context resubmitted as a token prompt.
    assert len(enqueued) == segments
    assert enqueued[0] == prompt
    assert enqueued[-1] == prompt + ids[: len(call) + len(observation)]

    observed = [i for i, o in enumerate(response.observation_mask) if o]
    assert all(response.behaviour_logprobs[i] == 0.0 for i in observed)
    assert response.token_versions == [] and response.policy_version == backend.policy_version


@pytest.mark.parametrize(
    ("transcript", "call_format"), [(PLAIN, "fenced"), (CHAT, "fenced"), (HERMES, "hermes")]
)
def test_model_token_logprobs_equal_one_forward_over_the_whole_context(
    backend: VLLMBackend,
    reference: torch.nn.Module,
    transcript: Transcript,
    call_format: CallFormatSetting,
) -> None:
    with_tools(backend, PrintingRunner(), call_format)
    hot = replace(sampling(), temperature=HOT)
    [responses] = backend.generate([prompt_of(transcript)], 8, hot)
    two_turns = [r for r in responses if any(r.observation_mask)]
    assert len(two_turns) >= 4
    error, lowest = 0.0, 0.0
    for response in two_turns:
        model = torch.tensor(response.is_model_token())
        reported = torch.tensor(response.behaviour_logprobs)
        expected = offline_logprobs(reference, response, hot)
        error = max(error, float((reported[model] - expected[model]).abs().max()))
        lowest = min(lowest, float(reported[model].min()))
    print(f"max |vLLM - transformers| log-prob error over two turns: {error:.3g}")
    assert error < LOGPROB_ATOL, f"max abs log-prob error {error:.3g}"
    assert lowest < -1.0  # log-probs far from 0: the comparison can tell


def test_a_seeded_group_is_reproducible(backend: VLLMBackend) -> None:
    with_tools(backend, PrintingRunner())
    first = backend.generate([prompt_of(PLAIN)], 3, sampling(seed=5))
    again = backend.generate([prompt_of(PLAIN)], 3, sampling(seed=5))
    assert [r.response_token_ids for r in first[0]] == [r.response_token_ids for r in again[0]]


def test_a_call_in_the_last_turn_ends_the_response_unrun(backend: VLLMBackend) -> None:
    runner = PrintingRunner()
    response = generate_one(with_tools(backend, runner, max_turns=1), PLAIN)
    assert response.finish_reason == "max_turns"
    assert response.response_token_ids == call_tokens(backend, PLAIN)
    assert response.observation_mask == [] and runner.codes == []


def test_a_call_beyond_max_calls_ends_the_response_unrun(backend: VLLMBackend) -> None:
    runner = PrintingRunner()
    response = generate_one(with_tools(backend, runner, max_turns=5, max_calls=0), PLAIN)
    assert response.finish_reason == "max_calls"
    assert response.response_token_ids == call_tokens(backend, PLAIN) and runner.codes == []


def test_max_new_tokens_counts_model_tokens_only(backend: VLLMBackend) -> None:
    with_tools(backend, PrintingRunner())
    limit = len(call_tokens(backend, PLAIN)) + 3
    response = generate_one(backend, PLAIN, max_new_tokens=limit)
    assert response.finish_reason == "length"
    assert sum(response.is_model_token()) == limit
    assert len(response.response_token_ids) > limit  # the observation came on top


def test_the_context_limit_ends_a_response_while_decoding(backend: VLLMBackend) -> None:
    runner = PrintingRunner()
    prompt = len(prompt_ids(backend.tokenizer, PLAIN))
    response = generate_one(with_tools(backend, runner, max_context_tokens=prompt + 10), PLAIN)
    assert response.finish_reason == "max_context"
    assert len(response.response_token_ids) == 10 and runner.codes == []


def test_an_observation_that_leaves_no_room_ends_the_response_after_its_call(
    backend: VLLMBackend,
) -> None:
    runner = PrintingRunner()
    prompt = len(prompt_ids(backend.tokenizer, PLAIN))
    call = len(call_tokens(backend, PLAIN))
    # Room for the call and a few tokens more, not for the observation (22 tokens).
    with_tools(backend, runner, max_context_tokens=prompt + call + 5)
    response = generate_one(backend, PLAIN)
    assert response.finish_reason == "max_context"
    assert response.response_token_ids == call_tokens(backend, PLAIN)
    assert response.observation_mask == [] and len(runner.codes) == 1


def test_the_engines_model_length_bounds_the_context(backend: VLLMBackend) -> None:
    """tools.max_context_tokens above max_model_len: the engine's length is the limit."""
    with_tools(backend, PrintingRunner(), max_context_tokens=10 * MAX_MODEL_LEN)
    filler = "Q: 6*7?\n" * ((MAX_MODEL_LEN - 8) // 8)
    prompt = Prompt("long", filler, OUTPUT)
    [[response]] = backend.generate([prompt], 1, sampling(max_new_tokens=200))
    assert len(response.prompt_token_ids) + len(response.response_token_ids) <= MAX_MODEL_LEN
    assert response.finish_reason in {"stop", "max_context"}


def test_a_running_call_does_not_hold_up_responses_that_are_not_waiting_on_one(
    backend: VLLMBackend,
) -> None:
    runner = GatedRunner()
    with_tools(backend, runner)  # fenced: HERMES's call is plain text
    backend.submit(
        [
            GroupRequest(prompt_of(PLAIN, "calls"), 1, sampling()),
            GroupRequest(prompt_of(HERMES, "no-call"), 1, sampling(max_new_tokens=60)),
        ]
    )
    try:
        ended: list[list[Response]] = []
        while not ended:
            ended += backend.step()
        [[other]] = ended
        assert other.prompt_id == "no-call" and other.observation_mask == []
        assert runner.started.is_set() and backend.in_flight == 1  # the call is still running
    finally:
        runner.release()
    ended += step_to_the_end(backend)
    assert ended[1][0].prompt_id == "calls" and ended[1][0].finish_reason == "stop"
    assert any(ended[1][0].observation_mask)


def test_tools_are_enabled_only_on_an_idle_backend(backend: VLLMBackend) -> None:
    with_tools(backend, PrintingRunner())
    backend.submit([GroupRequest(prompt_of(PLAIN), 1, sampling())])
    with pytest.raises(RuntimeError, match="idle"):
        backend.enable_tools(ToolSettings(), PrintingRunner())
    step_to_the_end(backend)


def test_a_response_spans_the_versions_that_sampled_its_turns(
    backend: VLLMBackend,
    tool_model_dir: Path,
    reference: torch.nn.Module,
    original_weights: dict[str, torch.Tensor],
) -> None:
    runner = GatedRunner()
    with_tools(backend, runner)
    generator = torch.Generator().manual_seed(3)
    new = {
        name: tensor + 0.02 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in original_weights.items()
    }
    old_version = backend.policy_version
    backend.submit([GroupRequest(prompt_of(PLAIN), 1, sampling())])
    ended: list[list[Response]] = []
    try:
        while not runner.started.is_set():  # decode until the call runs
            ended += backend.step()
        backend.load_weights(new, version=old_version + 1)  # between the turns
    finally:
        runner.release()
    try:
        ended += step_to_the_end(backend)
    finally:
        backend.load_weights(original_weights, version=old_version + 2)
    [[response]] = ended

    call = len(call_tokens(backend, PLAIN))
    model = response.is_model_token()
    observed_at = model.index(False, call)
    turn_two = [i for i in range(observed_at, len(model)) if model[i]]
    assert response.policy_version == old_version
    assert response.token_versions[:call] == [old_version] * call
    # Observation tokens carry the version of the model token before them.
    assert all(response.token_versions[i] == old_version for i in range(call, turn_two[0]))
    assert all(response.token_versions[i] == old_version + 1 for i in turn_two)
    assert response.version_span == 2

    reported = torch.tensor(response.behaviour_logprobs)
    under_old = offline_logprobs(reference, response)
    new_model = replace_weights(tool_model_dir, new)
    under_new = offline_logprobs(new_model, response)
    error_old = float((reported[:call] - under_old[:call]).abs().max())
    # The second turn was resubmitted after the load: its whole context was re-read by the new
    # weights (a new prefix-cache salt), so its log-probs are exactly theirs.
    error_new = float((reported[turn_two] - under_new[turn_two]).abs().max())
    print(f"max log-prob error, turn 1 (old) {error_old:.3g}, turn 2 (new) {error_new:.3g}")
    assert error_old < LOGPROB_ATOL and error_new < LOGPROB_ATOL
    assert (reported[turn_two] - under_old[turn_two]).abs().max() > 1e-3  # the test can tell


def replace_weights(model_dir: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32
    )
    model.load_state_dict(weights)
    return model.eval()


def test_greedy_decoding_repeats_one_multi_turn_response(backend: VLLMBackend) -> None:
    with_tools(backend, PrintingRunner())
    greedy = replace(sampling(), temperature=0.0)
    [group] = backend.generate([prompt_of(PLAIN)], 3, greedy)
    assert len(group) == 3 and all(r == group[0] for r in group)
    assert any(group[0].observation_mask) and set(group[0].behaviour_logprobs) == {0.0}


@pytest.mark.parametrize("transcript", [PLAIN, CHAT], ids=["plain", "chat"])
def test_a_single_turn_agent_row_is_answered_without_tools(
    backend: VLLMBackend, transcript: Transcript
) -> None:
    runner = PrintingRunner()
    check_single_turn_rows_skip_tools(with_tools(backend, runner), runner, transcript)
