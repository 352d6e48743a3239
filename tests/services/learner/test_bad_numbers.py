"""The learner on bad numbers, with the real tiny model (policy: docs/numerics.md).

Every case checks the same three things: the step does not fail, the metrics record is all
finite and carries every bad-number counter, and the parameters and AdamW's state stay finite.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kpo_core.config import AlgorithmConfig
from kpo_core.losses import NonFiniteInputError
from kpo_core.ratios import ESTIMATORS
from services.learner.batch import TrainingBatch, collate
from services.learner.step import LearnerCore
from services.messages import ScoredGroup
from services.spec import LearnerConfig
from tests.services.learner.conftest import MAX_NEW_TOKENS, make_core
from tests.services.learner.test_group_equivalence import assert_same_parameters
from tests.services.learner.test_step import (
    METRICS,
    parameters,
    same_parameters,
)

NAN, INF = math.nan, math.inf
ESTIMATOR_NAMES = sorted(ESTIMATORS)
# The scheduler steps once per learner step even when no optimiser step was taken.
NO_STEP_WARNING = "ignore:Detected call of `lr_scheduler.step\\(\\)`"


def assert_healthy(core: LearnerCore, metrics: dict[str, float]) -> None:
    """Finite parameters, finite optimiser state, and a finite, complete metrics record."""
    for name, parameter in core.model.named_parameters():
        assert bool(torch.isfinite(parameter).all()), name
        for key, value in core.optimizer.state.get(parameter, {}).items():
            if isinstance(value, torch.Tensor):
                assert bool(torch.isfinite(value).all()), (name, key)
    bad = {key: value for key, value in metrics.items() if not math.isfinite(value)}
    assert not bad, bad
    missing = (METRICS - {"grad_norm", "entropy"}) - metrics.keys()
    assert not missing, sorted(missing)


def named_weights(core: LearnerCore) -> dict[str, torch.Tensor]:
    return {name: tensor.detach() for name, tensor in core.model.named_parameters()}


def rewarded(groups: list[ScoredGroup], rewards: dict[int, float]) -> list[ScoredGroup]:
    """The groups with the rewards of the given rows (batch order) replaced."""
    out, row = [], 0
    for group in groups:
        responses = []
        for scored in group.responses:
            if row in rewards:
                scored = dataclasses.replace(scored, reward=rewards[row])
            responses.append(scored)
            row += 1
        out.append(ScoredGroup(group.prompt, responses))
    return out


def without_rows(groups: list[ScoredGroup], rows: set[int]) -> list[ScoredGroup]:
    """The groups without the responses of the given rows (batch order)."""
    out, row = [], 0
    for group in groups:
        kept = []
        for scored in group.responses:
            if row not in rows:
                kept.append(scored)
            row += 1
        out.append(ScoredGroup(group.prompt, kept))
    return out


def with_responses(
    groups: list[ScoredGroup], change: Callable[[int, Any], Any]
) -> list[ScoredGroup]:
    """The groups with every Response replaced by change(row, response)."""
    out, row = [], 0
    for group in groups:
        responses = []
        for scored in group.responses:
            responses.append(dataclasses.replace(scored, response=change(row, scored.response)))
            row += 1
        out.append(ScoredGroup(group.prompt, responses))
    return out


def with_behaviour(
    groups: list[ScoredGroup], cells: dict[tuple[int, int], float]
) -> list[ScoredGroup]:
    """The groups with behaviour log-prob (row, token) set to the given values."""

    def change(row: int, response: Any) -> Any:
        logprobs = list(response.behaviour_logprobs)
        for (r, token), value in cells.items():
            if r == row:
                logprobs[token] = value
        return dataclasses.replace(response, behaviour_logprobs=logprobs)

    return with_responses(groups, change)


def core_with(model_dir: Path, algorithm: dict[str, Any], **learner: Any) -> LearnerCore:
    config = LearnerConfig(**{"lr": 1e-3, **learner})
    return LearnerCore(
        model_dir,
        config,
        AlgorithmConfig.model_validate(algorithm),
        temperature=1.0,
        response_length=MAX_NEW_TOKENS,
    )


# --- NaN/inf rewards ----------------------------------------------------------------------------


@pytest.mark.parametrize("reference", ["behaviour", "proximal"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_a_nonfinite_reward_drops_its_response(
    tiny_model_dir: Path, groups: list[ScoredGroup], bad: float, reference: str
) -> None:
    """Rows 1 and 6 (rewarded 0, in groups 0 and 1) get a bad reward: the step is the step on
    the batch without those two responses."""
    core = make_core(tiny_model_dir, reference=reference)
    metrics = core.train_step(rewarded(groups, {1: bad, 6: bad}))
    assert_healthy(core, metrics)
    assert metrics["nonfinite_rewards"] == 2.0
    assert metrics["reward_mean"] == 0.3  # 3 correct of the 10 finite rewards
    assert metrics["skipped_minibatches"] == 0.0
    clean = make_core(tiny_model_dir, reference=reference)
    clean.train_step(without_rows(groups, {1, 6}))
    # Dropping rows changes the summation order: AdamW may amplify round-off (see there).
    assert_same_parameters(named_weights(core), named_weights(clean), lr=1e-3)


def test_nonfinite_raise_refuses_a_nan_reward_before_any_update(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    core = make_core(tiny_model_dir, nonfinite="raise")
    before = parameters(core)
    with pytest.raises(NonFiniteInputError, match="1 of 12 rewards"):
        core.train_step(rewarded(groups, {5: NAN}))
    assert same_parameters(core, before) and core.version == 0


@pytest.mark.filterwarnings(NO_STEP_WARNING)
def test_a_batch_without_a_finite_reward_trains_nothing(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    core = make_core(tiny_model_dir, minibatches=2)
    before = parameters(core)
    metrics = core.train_step(rewarded(groups, dict.fromkeys(range(12), NAN)))
    assert_healthy(core, metrics)
    assert metrics["nonfinite_rewards"] == 12.0 and metrics["reward_mean"] == 0.0
    assert metrics["empty_minibatches"] == 2.0 and metrics["skipped_minibatches"] == 0.0
    assert "grad_norm" not in metrics
    assert same_parameters(core, before) and core.version == 1


# --- zero-variance groups -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_zero_variance_groups_give_zero_advantages_even_with_eps_zero(
    tiny_model_dir: Path, groups: list[ScoredGroup], mode: str
) -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point: a naive mean would leave a residue to divide by 0.
    algorithm = {"advantages": {"mode": mode, "eps": 0.0}}
    core = core_with(tiny_model_dir, algorithm)
    before = parameters(core)
    metrics = core.train_step(rewarded(groups, dict.fromkeys(range(12), 0.1)))
    assert_healthy(core, metrics)
    assert metrics["zero_variance_group_fraction"] == 1.0
    assert metrics["grad_norm"] == 0.0 and metrics["policy_loss"] == 0.0
    assert same_parameters(core, before)
    # One constant group among two with a signal: counted, and the others still train.
    mixed = core_with(tiny_model_dir, algorithm)
    metrics = mixed.train_step(rewarded(groups, {4: 0.1, 5: 0.1, 6: 0.1, 7: 0.1}))
    assert_healthy(mixed, metrics)
    assert metrics["zero_variance_group_fraction"] == pytest.approx(1 / 3)
    assert metrics["grad_norm"] > 0 and not same_parameters(mixed, before)


# --- empty and truncated responses --------------------------------------------------------------


def emptied(groups: list[ScoredGroup], rows: set[int]) -> list[ScoredGroup]:
    def change(row: int, response: Any) -> Any:
        if row not in rows:
            return response
        return dataclasses.replace(response, response_token_ids=[], behaviour_logprobs=[])

    return with_responses(groups, change)


def test_empty_responses_are_counted_and_trained_around(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    core = make_core(tiny_model_dir, minibatches=3)
    before = parameters(core)
    metrics = core.train_step(emptied(groups, {1, 2, 7}))
    assert_healthy(core, metrics)
    assert metrics["empty_responses"] == 3.0 and metrics["skipped_minibatches"] == 0.0
    assert not same_parameters(core, before)


@pytest.mark.filterwarnings(NO_STEP_WARNING)
@pytest.mark.parametrize("estimator", ESTIMATOR_NAMES)
def test_a_batch_of_empty_responses_trains_nothing(
    tiny_model_dir: Path, groups: list[ScoredGroup], estimator: str
) -> None:
    core = make_core(tiny_model_dir, estimator=estimator, reference="proximal")
    before = parameters(core)
    metrics = core.train_step(emptied(groups, set(range(12))))
    assert_healthy(core, metrics)
    assert metrics["empty_responses"] == 12.0 and metrics["tokens_trained"] == 0.0
    assert metrics["empty_minibatches"] == 1.0
    assert same_parameters(core, before) and core.version == 1


def test_truncated_responses_train_like_any_other(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    """No implicit penalty or mask: only truncated_fraction tells them apart."""

    def cut(row: int, response: Any) -> Any:
        return dataclasses.replace(response, finish_reason="length")

    truncated = make_core(tiny_model_dir)
    metrics = truncated.train_step(with_responses(groups, cut))
    assert_healthy(truncated, metrics)
    assert metrics["truncated_fraction"] == 1.0
    plain = make_core(tiny_model_dir)
    assert plain.train_step(groups)["truncated_fraction"] < 1.0
    for trained, expected in zip(
        truncated.model.parameters(), plain.model.parameters(), strict=True
    ):
        assert torch.equal(trained, expected)


# --- NaN/inf log-probs: from generation, and from the learner's own forward ---------------------


@pytest.mark.parametrize("reference", ["behaviour", "proximal"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_behaviour_logprobs_mask_their_tokens(
    tiny_model_dir: Path, groups: list[ScoredGroup], bad: float, reference: str
) -> None:
    core = make_core(tiny_model_dir, reference=reference, ppo_epochs=2)
    before = parameters(core)
    metrics = core.train_step(with_behaviour(groups, {(0, 0): bad, (0, 1): bad, (5, 0): bad}))
    assert_healthy(core, metrics)
    assert metrics["nonfinite_tokens"] == 3.0 and metrics["skipped_minibatches"] == 0.0
    assert not same_parameters(core, before)


def poison_hidden(core: LearnerCore) -> list[torch.utils.hooks.RemovableHandle]:
    """NaN in the logits of the first two scored positions (row-major) of every forward and
    +-inf in those of the third, through one feature of the final hidden state there (the
    head's input: the log-prob path takes the head's weight, not the `lm_head` module).

    The forward's batch (`core.model`'s argument) tells where its scored positions are: slot j
    of row r is scored from padded column P - 1 + j of its hidden states. Added rather than
    assigned, as an overflow would make them: an assignment would also cut the gradient at
    those cells, hiding what the NaN does to the backward pass.
    """
    seen: list[TrainingBatch] = []

    def remember(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        seen.append(args[0])

    def hook(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        batch = seen[-1]
        assert not core.model.packed and output.shape[:2] == (
            batch.num_rows,
            batch.prompt_width + batch.response_width,
        )
        cells = batch.response_mask.nonzero().tolist()[:3]
        assert len(cells) == 3, "a forward with fewer than 3 response tokens"
        poison = torch.zeros_like(output)
        for (row, slot), value in zip(cells, (NAN, NAN, INF), strict=True):
            poison[row, batch.prompt_width - 1 + slot, 0] = value
        return output + poison

    policy: Any = core.model.policy
    norm: torch.nn.Module = policy.model.norm
    return [
        core.model.register_forward_pre_hook(remember),
        norm.register_forward_hook(hook),
    ]


@pytest.mark.parametrize("estimator", ESTIMATOR_NAMES)
def test_nonfinite_logits_mask_their_tokens_and_the_rest_trains(
    tiny_model_dir: Path, groups: list[ScoredGroup], estimator: str
) -> None:
    core = make_core(tiny_model_dir, estimator=estimator, ppo_epochs=2)
    handles = poison_hidden(core)
    before = parameters(core)
    metrics = core.train_step(groups)
    for handle in handles:
        handle.remove()
    assert_healthy(core, metrics)
    assert metrics["nonfinite_tokens"] == 3.0  # per pass over the batch
    # Without the logit guard the 0 * NaN of the masked tokens' gradient would skip the step.
    assert metrics["skipped_minibatches"] == 0.0 and math.isfinite(metrics["grad_norm"])
    assert not same_parameters(core, before)


def test_nan_hidden_states_skip_the_minibatch_they_reach(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    """NaN written into the first decoder layer's output of one row, in the first forward only:
    the row's log-probs are masked, but NaN activations bring NaN into the gradient of the
    weights, so that minibatch is skipped; the second minibatch trains."""
    core = make_core(tiny_model_dir, minibatches=2)
    batch = collate(groups, core.pad_id, 0)
    width_p = batch.input_ids.shape[1] - batch.response_width
    calls = []

    def hook(module: torch.nn.Module, args: object, output: Any) -> Any:
        calls.append(1)
        if len(calls) > 1:
            return output
        hidden = output[0] if isinstance(output, tuple) else output
        poison = torch.zeros_like(hidden)
        poison[0, width_p - 1] = NAN  # the last prompt position: every response token sees it
        hidden = hidden + poison
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = core.model.policy.model.layers[0].register_forward_hook(hook)
    before = parameters(core)
    metrics = core.train_step(groups)
    handle.remove()
    assert_healthy(core, metrics)
    assert metrics["skipped_minibatches"] == 1.0 and metrics["nonfinite_tokens"] > 0
    assert not same_parameters(core, before)  # the clean minibatch was applied


# --- extreme ratios -----------------------------------------------------------------------------


@pytest.mark.parametrize("log_ratio", [50.0, -50.0, 1e4, -1e4])
@pytest.mark.parametrize("estimator", ESTIMATOR_NAMES)
def test_extreme_ratios_are_trained_saturated_and_counted(
    tiny_model_dir: Path, groups: list[ScoredGroup], estimator: str, log_ratio: float
) -> None:
    """Behaviour log-probs moved by -log_ratio on two tokens of a rewarded row (A > 0) and two
    of an unrewarded one (A < 0): z = log_ratio there."""
    behaviour = {
        (row, token): groups[row // 4].responses[row % 4].response.behaviour_logprobs[token]
        - log_ratio
        for row in (0, 1)
        for token in (0, 1)
    }
    core = make_core(tiny_model_dir, estimator=estimator, ppo_epochs=2)
    metrics = core.train_step(with_behaviour(groups, behaviour))
    assert_healthy(core, metrics)
    assert metrics["extreme_ratio_tokens"] == 4.0  # per pass
    assert metrics["skipped_minibatches"] == 0.0 and metrics["nonfinite_tokens"] == 0.0


@pytest.mark.parametrize("log_weight", [50.0, -50.0, 1e4, -1e4])
def test_extreme_behaviour_weights_are_counted_with_the_proximal_reference(
    tiny_model_dir: Path, groups: list[ScoredGroup], log_weight: float
) -> None:
    behaviour = {(0, 0): -log_weight, (6, 1): -log_weight}
    core = make_core(tiny_model_dir, reference="proximal")
    metrics = core.train_step(with_behaviour(groups, behaviour))
    assert_healthy(core, metrics)
    assert metrics["extreme_ratio_tokens"] == 2.0 and metrics["skipped_minibatches"] == 0.0


# --- finite but absurd rewards ------------------------------------------------------------------


@pytest.mark.filterwarnings(NO_STEP_WARNING)
@pytest.mark.parametrize(("reward", "applied"), [(1e18, True), (1e30, False)])
def test_absurd_finite_rewards_never_reach_the_weights_as_inf(
    tiny_model_dir: Path, groups: list[ScoredGroup], reward: float, applied: bool
) -> None:
    """Dr. GRPO does not normalise: advantages of 1e18 give a finite gradient norm (~2e18,
    AdamW's squared-gradient state still finite), 1e30 an infinite one: skipped."""
    algorithm = {"advantages": {"mode": "dr_grpo"}, "estimator": {"name": "token"}}
    core = core_with(tiny_model_dir, algorithm, max_grad_norm=None)
    before = parameters(core)
    metrics = core.train_step(rewarded(groups, {0: reward, 4: reward, 8: reward}))
    assert_healthy(core, metrics)
    assert metrics["skipped_minibatches"] == float(not applied)
    assert same_parameters(core, before) != applied
