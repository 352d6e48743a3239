"""The learner on a multi-turn (tool) response: model tokens, observation tokens, model tokens.

Observation tokens (tool output placed in the context) are context for the learner: they stay
in the model's input, so the second turn's log-probs are conditioned on them, but they carry no
loss and no gradient, and the token counts leave them out (SPEC.md, "Multi-turn responses").

The response is built by hand on the tiny model (character tokenizer), and its behaviour
log-probs are an offline recomputation over the full context (prompt, turn 1, observation,
turn 2) with the same weights: on-policy, as a generation backend would report them.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from kpo_core.losses import aggregate_loss, token_policy_loss
from services.learner.batch import TrainingBatch, collate
from services.learner.logprobs import response_logprobs
from services.learner.sharding import compute_context
from services.learner.step import LearnerCore
from services.messages import Prompt, Response, ScoredGroup, ScoredResponse
from tests.services.learner.conftest import make_core

# Turn 1 asks the tool, the observation is its output, turn 2 reads the answer off it.
PROMPT = "12+30="
TURN_1 = "6+6;"
OBSERVATION = "#42#"
TURN_2 = "42;"
# Measured between the learner (padded: 4.7e-7; packed rows: 1.4e-6) and one full HF forward:
# float32 summation order. A log-prob computed without the observation in the context is off by
# orders of magnitude more (asserted below).
TOLERANCE = 2e-5


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def offline_logprobs(model_dir: Path, prompt: list[int], response: list[int]) -> list[float]:
    """log softmax(logits / T) at each response token, T = 1, from one forward of the HF model
    over prompt + response (every earlier token, observation tokens included, is context)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double()
    start = len(prompt) - 1
    predicted = logits[start : start + len(response)].log_softmax(-1)
    chosen = predicted.gather(-1, torch.tensor(response)[:, None])[:, 0]
    return [float(value) for value in chosen]


def two_turn_response(model_dir: Path) -> Response:
    """prompt | turn 1 (model) | observation | turn 2 (model) + EOS, behaviour log-probs
    recomputed offline over the full context (0.0 at the observation, as generation gives)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = list(tokenizer(PROMPT)["input_ids"])  # <bos> first
    turn_1, observed = encode(tokenizer, TURN_1), encode(tokenizer, OBSERVATION)
    turn_2 = [*encode(tokenizer, TURN_2), tokenizer.eos_token_id]
    tokens = turn_1 + observed + turn_2
    mask = [False] * len(turn_1) + [True] * len(observed) + [False] * len(turn_2)
    full = offline_logprobs(model_dir, prompt, tokens)
    behaviour = [0.0 if obs else logp for logp, obs in zip(full, mask, strict=True)]
    text = TURN_1 + OBSERVATION + TURN_2
    return Response("t", prompt, tokens, behaviour, "stop", 0, text, observation_mask=mask)


def single_turn_response(model_dir: Path, like: Response) -> Response:
    """The same prompt answered without the tool: turn 2 straight away."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokens = [*encode(tokenizer, TURN_2), tokenizer.eos_token_id]
    behaviour = offline_logprobs(model_dir, like.prompt_token_ids, tokens)
    return Response("t", like.prompt_token_ids, tokens, behaviour, "stop", 0, TURN_2)


@pytest.fixture(scope="module")
def groups(tiny_model_dir: Path) -> list[ScoredGroup]:
    """One group: the two-turn response (reward 1) and a single-turn one (reward 0)."""
    tool = two_turn_response(tiny_model_dir)
    plain = single_turn_response(tiny_model_dir, tool)
    scored = [ScoredResponse(tool, 1.0, verified=True), ScoredResponse(plain, 0.0, verified=True)]
    return [ScoredGroup(Prompt("t", PROMPT, "42"), scored)]


def observed_columns(response: Response) -> list[int]:
    return [i for i, observed in enumerate(response.observation_mask) if observed]


def model_columns(response: Response) -> list[int]:
    return [i for i, sampled in enumerate(response.is_model_token()) if sampled]


def test_collate_keeps_observation_tokens_in_the_row_and_off_the_mask(
    groups: list[ScoredGroup],
) -> None:
    tool = groups[0].responses[0].response
    batch = collate(groups, pad_id=0, learner_version=0)
    width_p, n = batch.prompt_width, len(tool.response_token_ids)
    # Context: every response token is in the model's input and the response ids.
    assert batch.input_ids[0, width_p : width_p + n].tolist() == tool.response_token_ids
    assert batch.response_ids[0, :n].tolist() == tool.response_token_ids
    assert bool(batch.attention_mask[0, width_p : width_p + n].all())
    # Trained on: the model tokens only.
    assert batch.response_mask[0, :n].tolist() == tool.is_model_token()
    assert not bool(batch.response_mask[0, n:].any())
    assert bool((batch.behaviour_logp[0, observed_columns(tool)] == 0).all())
    # Host lengths are positions (shapes and packing), observation tokens included.
    assert batch.response_lengths[0] == n


def test_an_observation_mask_of_the_wrong_length_names_its_row(
    groups: list[ScoredGroup],
) -> None:
    tool, plain = groups[0].responses
    short = dataclasses.replace(plain.response, observation_mask=[False, True])
    rows = [tool, plain, dataclasses.replace(plain, response=short)]
    bad = [ScoredGroup(groups[0].prompt, rows)]
    with pytest.raises(ValueError, match=r"row 2 .*observation mask of 2"):
        collate(bad, pad_id=0, learner_version=0)


def learner_logprobs(core: LearnerCore, batch: TrainingBatch) -> torch.Tensor:
    with torch.no_grad(), compute_context(core.learner, core.device):
        logp, _ = response_logprobs(core.model, batch, core.temperature, with_entropy=False)
    return logp


@pytest.mark.parametrize("packed", [False, True])
def test_model_token_logprobs_equal_an_offline_recomputation_over_the_full_context(
    tiny_model_dir: Path, groups: list[ScoredGroup], packed: bool
) -> None:
    core = make_core(tiny_model_dir, pack_rows=packed)
    assert core.model.packed == packed
    tool = groups[0].responses[0].response
    batch = collate(groups, core.pad_id, learner_version=0)
    logp = learner_logprobs(core, batch)[0]
    model, observed = model_columns(tool), observed_columns(tool)
    offline = torch.tensor(tool.behaviour_logprobs, dtype=torch.float64)[model]
    error = float((logp[model].double() - offline).abs().max())
    print(f"max |learner - offline| log-prob at model tokens (packed={packed}): {error:.1e}")
    assert error < TOLERANCE
    assert bool((logp[observed] == 0).all())
    # The check sees the context: without the observation, turn 2 is predicted differently.
    second_turn = tool.response_token_ids[observed[-1] + 1 :]
    first_turn = tool.response_token_ids[: observed[0]]
    blind = offline_logprobs(tiny_model_dir, tool.prompt_token_ids, first_turn + second_turn)
    without = torch.tensor(blind[len(first_turn) :], dtype=torch.float64)
    shift = float((without - offline[-len(second_turn) :]).abs().max())
    print(f"max shift of turn 2's log-probs without the observation: {shift:.1e}")
    assert shift > 100 * TOLERANCE


def loss_and_gradients(
    core: LearnerCore, batch: TrainingBatch, advantages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The step's policy loss (its estimator, behaviour reference, aggregation) on `batch`:
    the loss, d loss / d logp [B, T] and the parameters' gradients."""
    core.model.zero_grad(set_to_none=True)
    algorithm = core.algorithm
    with compute_context(core.learner, core.device):
        logp, _ = response_logprobs(core.model, batch, core.temperature, with_entropy=False)
    logp.retain_grad()
    token_loss = token_policy_loss(
        algorithm.estimator, logp, batch.behaviour_logp, advantages, batch.response_mask
    )
    loss = aggregate_loss(token_loss.per_token, token_loss.mask, algorithm.resolved_loss_agg_mode)
    loss.backward()
    assert logp.grad is not None
    grads = {n: p.grad.clone() for n, p in core.model.named_parameters() if p.grad is not None}
    core.model.zero_grad(set_to_none=True)
    return loss.detach(), logp.grad, grads


@pytest.mark.parametrize("estimator", ["kalman", "cumulative", "sequence", "token"])
def test_observation_tokens_carry_no_loss_and_no_gradient(
    tiny_model_dir: Path, groups: list[ScoredGroup], estimator: str
) -> None:
    """Perturbing what sits at the observation tokens (their behaviour log-probs, their
    advantages) leaves the loss and every gradient bitwise unchanged; d loss / d logp is 0
    there."""
    core = make_core(tiny_model_dir, estimator=estimator)
    tool = groups[0].responses[0].response
    observed = observed_columns(tool)
    batch = collate(groups, core.pad_id, learner_version=0)
    # Token-level advantages: +1 on the rewarded row, -1 on the other.
    advantages = torch.tensor([[1.0], [-1.0]]).expand(batch.response_mask.shape).clone()
    loss, logp_grad, grads = loss_and_gradients(core, batch, advantages)
    assert float(loss) != 0.0 or any(bool(g.any()) for g in grads.values())
    assert bool((logp_grad[0, observed] == 0).all())
    assert bool(logp_grad[0, model_columns(tool)].ne(0).any())  # model tokens do get a gradient

    behaviour = batch.behaviour_logp.clone()
    behaviour[0, observed] = -7.5
    perturbed_advantages = advantages.clone()
    perturbed_advantages[0, observed] = 100.0
    perturbed = dataclasses.replace(batch, behaviour_logp=behaviour)
    loss_2, logp_grad_2, grads_2 = loss_and_gradients(core, perturbed, perturbed_advantages)
    assert torch.equal(loss, loss_2)
    assert torch.equal(logp_grad, logp_grad_2)
    assert grads.keys() == grads_2.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(grad, grads_2[name]), name


def with_observation_logprobs(groups: list[ScoredGroup], value: float) -> list[ScoredGroup]:
    """The groups with the two-turn response's observation log-probs set to `value`."""
    tool = groups[0].responses[0]
    logprobs = [
        value if observed else logp
        for logp, observed in zip(
            tool.response.behaviour_logprobs, tool.response.observation_mask, strict=True
        )
    ]
    response = dataclasses.replace(tool.response, behaviour_logprobs=logprobs)
    responses = [dataclasses.replace(tool, response=response), *groups[0].responses[1:]]
    return [ScoredGroup(groups[0].prompt, responses)]


@pytest.mark.parametrize(
    ("estimator", "reference"),
    [("kalman", "behaviour"), ("cumulative", "behaviour"), ("kalman", "proximal")],
)
def test_a_step_trains_on_model_tokens_only(
    tiny_model_dir: Path, groups: list[ScoredGroup], estimator: str, reference: str
) -> None:
    """A whole train_step: the observation's behaviour log-probs (even NaN) change neither the
    weights nor the record, and the token counts split model and observation tokens."""
    tool = groups[0].responses[0].response
    records, weights = [], []
    for value in (0.0, math.nan):
        core = make_core(tiny_model_dir, estimator=estimator, reference=reference)
        records.append(core.train_step(with_observation_logprobs(groups, value)))
        weights.append({n: p.detach().clone() for n, p in core.model.named_parameters()})
    assert records[0] == records[1]
    assert all(torch.equal(p, weights[1][name]) for name, p in weights[0].items())
    record = records[0]
    observations = len(observed_columns(tool))
    positions = sum(len(s.response.response_token_ids) for s in groups[0].responses)
    assert record["observation_tokens"] == observations
    assert record["tokens_trained"] == positions - observations
    assert record["response_length_mean"] == (positions - observations) / 2
    assert record["nonfinite_tokens"] == 0.0
    assert record["grad_norm"] > 0.0
