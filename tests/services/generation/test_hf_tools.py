"""Multi-turn rollouts of the hf backend, with a tiny model that really calls the tool.

The model (`tool_model.py`) was fitted to write a call after each of three prompts; the engine
decodes it from the model's logits, stops at it, runs it through a ToolRunner, appends the
observation and decodes the answer. The runners (`tool_rollouts.py`) stand in for the sandbox
(its own tests cover it).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from services.generation.base import GroupRequest, SamplingSettings
from services.generation.hf_backend import HFBackend
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
    TEMPERATURE,
    GatedRunner,
    PrintingRunner,
    call_tokens,
    check_single_turn_rows_skip_tools,
    generate_one,
    prompt_of,
    sampling,
    spans,
)

TOLERANCE = 5e-5  # as tests/services/learner/test_logprobs.py: float32 summation order


def backend_with_tools(
    model_dir: Path,
    runner: PrintingRunner,
    call_format: CallFormatSetting = "fenced",
    **limits: int,
) -> HFBackend:
    backend = HFBackend(model_dir)
    backend.enable_tools(ToolSettings(call_format=call_format, **limits), runner)
    return backend


def offline_logprobs(
    model: PreTrainedModel, response: Response, temperature: float = TEMPERATURE
) -> torch.Tensor:
    """Log-prob of every response token under `model` at `temperature`: one forward over the
    whole context (prompt, model and observation tokens)."""
    ids = torch.tensor([response.prompt_token_ids + response.response_token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    start = len(response.prompt_token_ids) - 1
    tokens = torch.tensor(response.response_token_ids)[:, None]
    out: torch.Tensor = logits[start : start + len(tokens)].log_softmax(-1).gather(-1, tokens)
    return out[:, 0]


@pytest.mark.parametrize(
    ("transcript", "call_format"),
    [(PLAIN, "fenced"), (CHAT, "fenced"), (HERMES, "hermes")],
    ids=["fenced-plain", "fenced-chat", "hermes"],
)
def test_a_two_turn_response_is_model_tokens_observation_model_tokens(
    tool_model_dir: Path, transcript: Transcript, call_format: CallFormatSetting
) -> None:
    runner = PrintingRunner()
    backend = backend_with_tools(tool_model_dir, runner, call_format)
    response = generate_one(backend, transcript)
    tools = backend.tools
    assert tools is not None

    call = call_tokens(backend, transcript)
    observation = tools.encoder.encode(OUTPUT, chat=transcript.chat)
    assert response.prompt_token_ids == prompt_ids(backend.tokenizer, transcript)
    # Model turn (the call), observation, model turn (the answer, ended by EOS).
    assert spans(response.observation_mask)[:2] == [(False, len(call)), (True, len(observation))]
    assert len(spans(response.observation_mask)) == 3
    ids = response.response_token_ids
    assert ids[: len(call)] == call
    assert ids[len(call) : len(call) + len(observation)] == observation
    assert ids[-1] == backend.tokenizer.eos_token_id
    assert response.finish_reason == "stop"
    assert runner.codes == ["print(6*7)\n" if call_format == "fenced" else "print(6*7)"]
    if transcript.chat:  # a tool message through the chat template, then the next turn
        text = backend.tokenizer.decode(observation)
        assert text == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    else:
        assert backend.tokenizer.decode(observation) == "<output>\n42\n</output>\n"

    # Observation tokens: log-prob 0.0, and the version of the model token before them.
    observed = [i for i, o in enumerate(response.observation_mask) if o]
    assert all(response.behaviour_logprobs[i] == 0.0 for i in observed)
    assert response.token_versions == [] and response.policy_version == 0


@pytest.mark.parametrize(
    ("transcript", "call_format"), [(PLAIN, "fenced"), (CHAT, "fenced"), (HERMES, "hermes")]
)
def test_model_token_logprobs_equal_one_forward_over_the_whole_context(
    tool_model_dir: Path, transcript: Transcript, call_format: CallFormatSetting
) -> None:
    # Hotter than the other tests: at 0.7 the fitted model is so sure of its tokens that every
    # log-prob is within the tolerance of 0, and the comparison could not tell.
    hot = replace(sampling(), temperature=HOT)
    backend = backend_with_tools(tool_model_dir, PrintingRunner(), call_format)
    responses = backend.generate([prompt_of(transcript)], 16, hot)[0]
    two_turns = [r for r in responses if any(r.observation_mask)]
    assert len(two_turns) >= 2
    lowest = 0.0
    for response in two_turns:
        model = torch.tensor(response.is_model_token())
        reported = torch.tensor(response.behaviour_logprobs)
        expected = offline_logprobs(backend.model, response, HOT)
        torch.testing.assert_close(reported[model], expected[model], rtol=0, atol=TOLERANCE)
        lowest = min(lowest, float(reported[model].min()))
    # Log-probs a hundred tolerances from 0: a wrong context or temperature would show.
    assert lowest < -100 * TOLERANCE


def test_a_call_in_the_last_turn_ends_the_response_unrun(tool_model_dir: Path) -> None:
    runner = PrintingRunner()
    backend = backend_with_tools(tool_model_dir, runner, max_turns=1)
    response = generate_one(backend, PLAIN)
    assert response.finish_reason == "max_turns"
    assert response.response_token_ids == call_tokens(backend, PLAIN)
    assert response.observation_mask == [] and runner.codes == []


def test_a_call_beyond_max_calls_ends_the_response_unrun(tool_model_dir: Path) -> None:
    runner = PrintingRunner()
    backend = backend_with_tools(tool_model_dir, runner, max_turns=5, max_calls=0)
    response = generate_one(backend, PLAIN)
    assert response.finish_reason == "max_calls"
    assert response.response_token_ids == call_tokens(backend, PLAIN) and runner.codes == []


def test_max_new_tokens_counts_model_tokens_only(tool_model_dir: Path) -> None:
    backend = backend_with_tools(tool_model_dir, PrintingRunner())
    limit = len(call_tokens(backend, PLAIN)) + 3
    response = generate_one(backend, PLAIN, max_new_tokens=limit)
    assert response.finish_reason == "length"
    assert sum(response.is_model_token()) == limit
    assert len(response.response_token_ids) > limit  # the observation came on top


def test_the_context_limit_ends_a_response_while_decoding(tool_model_dir: Path) -> None:
    runner = PrintingRunner()
    prompt = len(prompt_ids(HFBackend(tool_model_dir).tokenizer, PLAIN))
    backend = backend_with_tools(tool_model_dir, runner, max_context_tokens=prompt + 10)
    response = generate_one(backend, PLAIN)
    assert response.finish_reason == "max_context"
    assert len(response.response_token_ids) == 10 and runner.codes == []


def test_an_observation_that_leaves_no_room_ends_the_response_after_its_call(
    tool_model_dir: Path,
) -> None:
    runner = PrintingRunner()
    probe = HFBackend(tool_model_dir)
    prompt, call = len(prompt_ids(probe.tokenizer, PLAIN)), len(call_tokens(probe, PLAIN))
    # Room for the call and a few tokens more, not for the observation (22 tokens).
    backend = backend_with_tools(tool_model_dir, runner, max_context_tokens=prompt + call + 5)
    response = generate_one(backend, PLAIN)
    assert response.finish_reason == "max_context"
    assert response.response_token_ids == call_tokens(backend, PLAIN)
    assert response.observation_mask == [] and len(runner.codes) == 1


def test_a_response_spans_the_versions_that_sampled_its_turns(tool_model_dir: Path) -> None:
    runner = GatedRunner()
    backend = backend_with_tools(tool_model_dir, runner)
    old = {name: tensor.clone() for name, tensor in backend.model.state_dict().items()}
    generator = torch.Generator().manual_seed(3)
    new = {
        name: tensor + 0.02 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in old.items()
    }
    backend.submit([_request(prompt_of(PLAIN), sampling())])
    ended: list[list[Response]] = []
    while not runner.started.is_set():  # decode until the call runs
        ended += backend.step()
    backend.load_weights(new, version=1)  # between the turns
    runner.release()
    while backend.in_flight:
        ended += backend.step()
    [[response]] = ended

    call = len(call_tokens(backend, PLAIN))
    model = response.is_model_token()
    observed_at = model.index(False, call)
    turn_two = [i for i in range(observed_at, len(model)) if model[i]]
    assert response.policy_version == 0
    assert response.token_versions[:call] == [0] * call
    # Observation tokens carry the version of the model token before them.
    assert all(response.token_versions[i] == 0 for i in range(call, turn_two[0]))
    assert all(response.token_versions[i] == 1 for i in turn_two)

    reported = torch.tensor(response.behaviour_logprobs)
    backend.load_weights(old, version=2)
    under_old = offline_logprobs(backend.model, response)
    backend.load_weights(new, version=3)
    under_new = offline_logprobs(backend.model, response)
    torch.testing.assert_close(reported[:call], under_old[:call], rtol=0, atol=TOLERANCE)
    # The second turn was sampled over a context re-read by the new weights: exactly theirs.
    torch.testing.assert_close(reported[turn_two], under_new[turn_two], rtol=0, atol=TOLERANCE)
    assert (reported[turn_two] - under_old[turn_two]).abs().max() > 1e-3  # the test can tell


def test_a_running_call_does_not_hold_up_responses_that_are_not_waiting_on_one(
    tool_model_dir: Path,
) -> None:
    runner = GatedRunner()
    backend = backend_with_tools(tool_model_dir, runner)  # fenced: HERMES's call is plain text
    backend.submit(
        [
            _request(prompt_of(PLAIN, "calls"), sampling()),
            _request(prompt_of(HERMES, "no-call"), sampling(max_new_tokens=60)),
        ]
    )
    ended: list[list[Response]] = []
    while not ended:
        ended += backend.step()
    [[other]] = ended
    assert other.prompt_id == "no-call" and other.observation_mask == []
    assert runner.started.is_set() and backend.in_flight == 1  # the call is still running
    runner.release()
    while backend.in_flight:
        ended += backend.step()
    assert ended[1][0].prompt_id == "calls" and ended[1][0].finish_reason == "stop"
    assert any(ended[1][0].observation_mask)


def test_tools_are_enabled_only_on_an_idle_backend(tool_model_dir: Path) -> None:
    backend = HFBackend(tool_model_dir)
    backend.submit([_request(prompt_of(PLAIN), sampling())])
    with pytest.raises(RuntimeError, match="idle"):
        backend.enable_tools(ToolSettings(), PrintingRunner())


def _request(prompt: Prompt, settings: SamplingSettings) -> GroupRequest:
    return GroupRequest(prompt, 1, settings)


@pytest.mark.parametrize("transcript", [PLAIN, CHAT], ids=["plain", "chat"])
def test_a_single_turn_agent_row_is_answered_without_tools(
    tool_model_dir: Path, transcript: Transcript
) -> None:
    runner = PrintingRunner()
    check_single_turn_rows_skip_tools(
        backend_with_tools(tool_model_dir, runner), runner, transcript
    )
