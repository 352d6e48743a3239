"""The multi-turn tests, written once and run over every backend with tools.

test_hf_tools.py runs them on the `hf` backend here, test_vllm_tools.py on a real vLLM engine in
the vLLM stage: each imports the tests below and supplies the `harness` fixture (how to get its
backend with tools enabled: a fresh one, or the module's engine re-enabled; and the tolerance of
its log-probs against a transformers forward). This module's name keeps pytest from collecting
it on its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.generation.base import GroupRequest, SamplingSettings
from services.generation.hf_backend import processed_logprobs
from services.messages import Response
from services.tools.calls import CallFormatSetting
from services.tools.config import ToolsConfig
from services.tools.rollout import ToolRollout
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


class MultiTurnBackend(Protocol):
    """The part of a backend the checks drive."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def tools(self) -> ToolRollout | None: ...

    @property
    def policy_version(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    def generate(
        self, prompts: list[Any], group_size: int, sampling: SamplingSettings
    ) -> list[list[Response]]: ...

    def submit(self, requests: list[GroupRequest]) -> None: ...

    def step(self) -> list[list[Response]]: ...

    def enable_tools(self, settings: ToolsConfig, runner: Any) -> None: ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None: ...


@dataclass
class Harness:
    """One backend under the checks. `with_tools(runner, call_format, **limits)`: the backend
    with tools enabled under those settings; `tolerance`: the largest log-prob difference
    between it and a transformers forward (float32 summation order, or another kernel)."""

    model_dir: Path
    backend_with_tools: Any  # (runner, call_format="fenced", **limits) -> MultiTurnBackend
    tolerance: float

    def with_tools(
        self, runner: PrintingRunner, call_format: CallFormatSetting = "fenced", **limits: int
    ) -> MultiTurnBackend:
        backend: MultiTurnBackend = self.backend_with_tools(runner, call_format, **limits)
        return backend

    def weights(self) -> dict[str, torch.Tensor]:
        model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
        return {name: t.detach().clone() for name, t in model.state_dict().items()}

    def offline_logprobs(
        self,
        response: Response,
        settings: SamplingSettings,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Processed log-probs (under `settings`) of every response token under the model with
        `weights` (its saved ones by default): one forward over the whole context (prompt,
        model and observation tokens)."""
        model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
        if weights is not None:
            model.load_state_dict(weights)
        ids = response.prompt_token_ids + response.response_token_ids
        with torch.no_grad():
            logits = model.eval()(torch.tensor([ids])).logits[0].float()
        start = len(response.prompt_token_ids)
        logprobs = processed_logprobs(logits[start - 1 : len(ids) - 1], settings)
        out: torch.Tensor = logprobs.gather(-1, torch.tensor(response.response_token_ids)[:, None])
        return out[:, 0]


FORMATS = [(PLAIN, "fenced"), (CHAT, "fenced"), (HERMES, "hermes")]
FORMAT_IDS = ["fenced-plain", "fenced-chat", "hermes"]


def step_to_the_end(backend: MultiTurnBackend) -> list[list[Response]]:
    ended: list[list[Response]] = []
    while backend.in_flight:
        ended += backend.step()
    return ended


def check_two_turns(
    harness: Harness, transcript: Transcript, call_format: CallFormatSetting
) -> tuple[MultiTurnBackend, Response]:
    """Model tokens (the call), observation tokens, model tokens (the answer, ended by EOS)."""
    runner = PrintingRunner()
    backend = harness.with_tools(runner, call_format)
    response = generate_one(backend, transcript)
    tools = backend.tools
    assert tools is not None

    call = call_tokens(backend, transcript)
    observation = tools.encoder.encode(OUTPUT, chat=transcript.chat)
    assert response.prompt_token_ids == prompt_ids(backend.tokenizer, transcript)
    assert spans(response.observation_mask)[:2] == [(False, len(call)), (True, len(observation))]
    assert len(spans(response.observation_mask)) == 3
    ids = response.response_token_ids
    assert ids[: len(call)] == call
    assert ids[len(call) : len(call) + len(observation)] == observation
    assert ids[-1] == backend.tokenizer.eos_token_id
    assert response.finish_reason == "stop" and response.tool_calls == ["ok"]
    assert runner.codes == ["print(6*7)\n" if call_format == "fenced" else "print(6*7)"]
    if transcript.chat:  # a tool message through the chat template, then the next turn
        text = backend.tokenizer.decode(observation)
        assert text == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    else:
        assert backend.tokenizer.decode(observation) == "<output>\n42\n</output>\n"

    # Observation tokens: log-prob 0.0, and the version of the model token before them.
    observed = [i for i, o in enumerate(response.observation_mask) if o]
    assert all(response.behaviour_logprobs[i] == 0.0 for i in observed)
    assert response.token_versions == [] and response.policy_version == backend.policy_version
    return backend, response


def check_logprobs_over_the_whole_context(
    harness: Harness, transcript: Transcript, call_format: CallFormatSetting
) -> float:
    """Every model token's reported log-prob is that of one forward over the whole context;
    returns the largest difference."""
    # Hotter than the other checks: at 0.7 the fitted model is so sure of its tokens that
    # every log-prob is within the tolerance of 0, and the comparison could not tell.
    hot = replace(sampling(), temperature=HOT)
    backend = harness.with_tools(PrintingRunner(), call_format)
    [responses] = backend.generate([prompt_of(transcript)], 12, hot)
    two_turns = [r for r in responses if any(r.observation_mask)]
    assert len(two_turns) >= 2
    error, lowest = 0.0, 0.0
    for response in two_turns:
        model = torch.tensor(response.is_model_token())
        reported = torch.tensor(response.behaviour_logprobs)
        expected = harness.offline_logprobs(response, hot)
        error = max(error, float((reported[model] - expected[model]).abs().max()))
        lowest = min(lowest, float(reported[model].min()))
    assert error < harness.tolerance, f"max abs log-prob error {error:.3g}"
    # Log-probs a hundred tolerances from 0: a wrong context or temperature would show.
    assert lowest < -100 * harness.tolerance
    return error


def test_a_call_in_the_last_turn_ends_the_response_unrun(harness: Harness) -> None:
    runner = PrintingRunner()
    backend = harness.with_tools(runner, max_turns=1)
    response = generate_one(backend, PLAIN)
    assert response.finish_reason == "max_turns"
    assert response.response_token_ids == call_tokens(backend, PLAIN)
    assert response.observation_mask == [] and runner.codes == []


def test_a_call_beyond_max_calls_ends_the_response_unrun(harness: Harness) -> None:
    runner = PrintingRunner()
    backend = harness.with_tools(runner, max_turns=5, max_calls=0)
    response = generate_one(backend, PLAIN)
    assert response.finish_reason == "max_calls"
    assert response.response_token_ids == call_tokens(backend, PLAIN) and runner.codes == []


def test_max_new_tokens_counts_model_tokens_only(harness: Harness) -> None:
    backend = harness.with_tools(PrintingRunner())
    limit = len(call_tokens(backend, PLAIN)) + 3
    response = generate_one(backend, PLAIN, max_new_tokens=limit)
    assert response.finish_reason == "length"
    assert sum(response.is_model_token()) == limit
    assert len(response.response_token_ids) > limit  # the observation came on top


def test_the_context_limit_ends_a_response_while_decoding(harness: Harness) -> None:
    runner = PrintingRunner()
    prompt = len(prompt_ids(harness.with_tools(runner).tokenizer, PLAIN))
    backend = harness.with_tools(runner, max_context_tokens=prompt + 10)
    response = generate_one(backend, PLAIN)
    assert response.finish_reason == "max_context"
    assert len(response.response_token_ids) == 10 and runner.codes == []


def test_an_observation_that_leaves_no_room_ends_the_response_after_its_call(
    harness: Harness,
) -> None:
    runner = PrintingRunner()
    probe = harness.with_tools(runner)
    prompt, call = len(prompt_ids(probe.tokenizer, PLAIN)), len(call_tokens(probe, PLAIN))
    # Room for the call and a few tokens more, not for the observation (22 tokens).
    backend = harness.with_tools(runner, max_context_tokens=prompt + call + 5)
    response = generate_one(backend, PLAIN)
    assert response.finish_reason == "max_context"
    assert response.response_token_ids == call_tokens(backend, PLAIN)
    assert response.observation_mask == [] and len(runner.codes) == 1


def test_a_running_call_does_not_hold_up_responses_that_are_not_waiting_on_one(
    harness: Harness,
) -> None:
    runner = GatedRunner()
    backend = harness.with_tools(runner)  # fenced: HERMES's call is plain text
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


def test_tools_are_enabled_only_on_an_idle_backend(harness: Harness) -> None:
    backend = harness.with_tools(PrintingRunner())
    backend.submit([GroupRequest(prompt_of(PLAIN), 1, sampling())])
    with pytest.raises(RuntimeError, match="idle"):
        backend.enable_tools(ToolsConfig(enabled=True), PrintingRunner())
    step_to_the_end(backend)


def test_a_response_spans_the_versions_that_sampled_its_turns(harness: Harness) -> None:
    """Weights loaded while a call runs: the second turn is sampled, over its whole context,
    by the new weights, and says so token by token."""
    runner = GatedRunner()
    backend = harness.with_tools(runner)
    old = harness.weights()
    generator = torch.Generator().manual_seed(3)
    new = {
        name: tensor + 0.02 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in old.items()
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
        backend.load_weights(old, version=old_version + 2)
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
    under_old = harness.offline_logprobs(response, sampling(), old)
    under_new = harness.offline_logprobs(response, sampling(), new)
    assert float((reported[:call] - under_old[:call]).abs().max()) < harness.tolerance
    # The second turn was sampled over a context re-read by the new weights: exactly theirs.
    assert float((reported[turn_two] - under_new[turn_two]).abs().max()) < harness.tolerance
    assert (reported[turn_two] - under_old[turn_two]).abs().max() > 1e-3  # the test can tell


@pytest.mark.parametrize(("transcript", "call_format"), FORMATS, ids=FORMAT_IDS)
def test_a_two_turn_response_is_model_tokens_observation_model_tokens(
    harness: Harness, transcript: Transcript, call_format: CallFormatSetting
) -> None:
    check_two_turns(harness, transcript, call_format)


@pytest.mark.parametrize(("transcript", "call_format"), FORMATS, ids=FORMAT_IDS)
def test_model_token_logprobs_equal_one_forward_over_the_whole_context(
    harness: Harness, transcript: Transcript, call_format: CallFormatSetting
) -> None:
    error = check_logprobs_over_the_whole_context(harness, transcript, call_format)
    print(f"max |backend - transformers| log-prob error over two turns: {error:.3g}")


@pytest.mark.parametrize("transcript", [PLAIN, CHAT], ids=["plain", "chat"])
def test_a_single_turn_agent_row_is_answered_without_tools(
    harness: Harness, transcript: Transcript
) -> None:
    runner = PrintingRunner()
    check_single_turn_rows_skip_tools(harness.with_tools(runner), runner, transcript)


def test_a_replayed_multi_turn_response_records_no_set_at_its_observation_tokens(
    harness: Harness,
) -> None:
    backend = harness.with_tools(PrintingRunner(), "fenced")
    replayed = replace(sampling(), temperature=HOT, top_k=4, replay_max_kept=20)
    [responses] = backend.generate([prompt_of(PLAIN)], 6, replayed)
    two_turns = [r for r in responses if any(r.observation_mask)]
    assert two_turns
    for response in two_turns:
        assert len(response.kept_ids) == len(response.response_token_ids)
        for token, kept, model in zip(
            response.response_token_ids, response.kept_ids, response.is_model_token(), strict=True
        ):
            assert (token in kept and len(kept) == 4) if model else kept == []
