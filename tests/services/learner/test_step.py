"""LearnerCore.train_step on the random tiny model with groups it sampled itself."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from kpo_core.config import AlgorithmConfig
from kpo_core.losses import NonFiniteInputError
from kpo_core.ratios import ESTIMATORS
from services.learner.batch import collate
from services.learner.logprobs import response_logprobs
from services.learner.step import LearnerCore, ratio_file
from services.messages import ScoredGroup, ScoredResponse
from services.spec import LearnerConfig
from tests.services.learner.conftest import MAX_NEW_TOKENS, make_core

DIAGNOSTICS = (
    "switch_frequency",
    "run_length_up",
    "run_length_down",
    "run_length_on",
    "low_frequency_ratio",
    "global_variance",
    "local_variance",
)
METRICS = {
    "reward_mean",
    "reward_std",
    "accuracy",
    "response_length_mean",
    "truncated_fraction",
    "zero_variance_group_fraction",
    "entropy",
    "clip_fraction",
    "policy_loss",
    "approx_kl",
    "grad_norm",
    "lr",
    "ratio_mean",
    "ratio_max",
    "ratio_min",
    "nonfinite_tokens",
    "nonfinite_rewards",
    "extreme_ratio_tokens",
    "empty_responses",
    "skipped_minibatches",
    "empty_minibatches",
    "staleness_mean",
    "staleness_max",
    "tokens_trained",
    "policy_version",
    *(f"raw_{name}" for name in DIAGNOSTICS),
    *(f"filtered_{name}" for name in DIAGNOSTICS),
}
BAD_NUMBER_COUNTERS = (
    "nonfinite_rewards",
    "nonfinite_tokens",
    "extreme_ratio_tokens",
    "empty_responses",
    "skipped_minibatches",
    "empty_minibatches",
)
KALMAN_METRICS = {"kalman_gain_mean", "filtered_ratio_mean"}
BEHAVIOUR_WEIGHT_METRICS = {"behaviour_weight_mean", "behaviour_weight_max"}


def parameters(core: LearnerCore) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in core.model.named_parameters()}


def same_parameters(core: LearnerCore, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[name]) for name, p in core.model.named_parameters())


def all_finite(core: LearnerCore) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in core.model.parameters())


def with_rewards(groups: list[ScoredGroup], reward: float) -> list[ScoredGroup]:
    """The same responses, every one rewarded `reward` (no learning signal)."""
    return [
        ScoredGroup(g.prompt, [dataclasses.replace(s, reward=reward) for s in g.responses])
        for g in groups
    ]


def with_behaviour_logprob(groups: list[ScoredGroup], value: float) -> list[ScoredGroup]:
    """The groups with the second behaviour log-prob of the first response set to `value`."""
    first = groups[0].responses[0]
    logprobs = list(first.response.behaviour_logprobs)
    logprobs[1] = value
    response = dataclasses.replace(first.response, behaviour_logprobs=logprobs)
    responses = [dataclasses.replace(first, response=response), *groups[0].responses[1:]]
    return [ScoredGroup(groups[0].prompt, responses), *groups[1:]]


def test_a_step_updates_the_weights_and_reports_every_metric(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    core = make_core(tiny_model_dir)
    before = parameters(core)
    metrics = core.train_step(groups)
    assert core.version == 1 and metrics["policy_version"] == 1.0
    assert not same_parameters(core, before)
    missing = (METRICS | KALMAN_METRICS) - metrics.keys()
    assert not missing, f"missing metrics: {sorted(missing)}"
    assert not any(key.startswith(("raw_window", "filtered_window")) for key in metrics)
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values()), metrics
    batch = collate(groups, core.pad_id, 0)
    # One correct response of four per group.
    assert metrics["reward_mean"] == 0.25 and metrics["accuracy"] == 0.25
    assert metrics["reward_std"] == pytest.approx(math.sqrt(0.25 * 0.75), abs=1e-12)
    assert metrics["zero_variance_group_fraction"] == 0.0
    assert metrics["tokens_trained"] == float(batch.response_mask.sum())
    assert metrics["staleness_mean"] == metrics["staleness_max"] == 0.0
    assert metrics["lr"] == 1e-3 and metrics["skipped_minibatches"] == 0.0
    # Good data: every bad-number counter is present and 0.
    for key in BAD_NUMBER_COUNTERS:
        assert metrics[key] == 0.0, key


def test_on_policy_ratios_are_one_and_stale_ones_are_not(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    core = make_core(tiny_model_dir, estimator="token", lr=1e-2)
    first = core.train_step(groups)
    # The weights that sampled the batch: exp(logp - behaviour) = 1 up to float32 rounding.
    assert abs(first["ratio_max"] - 1) < 1e-4 and abs(first["ratio_min"] - 1) < 1e-4
    assert first["raw_global_variance"] < 1e-8 and abs(first["approx_kl"]) < 1e-8
    second = core.train_step(groups)  # the same batch, now one version stale
    assert second["staleness_mean"] == second["staleness_max"] == 1.0
    assert second["ratio_max"] > 1.01 and second["ratio_min"] < 0.99


def test_epochs_and_minibatches_step_the_optimiser_per_minibatch_and_the_schedule_per_step(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    core = make_core(tiny_model_dir, ppo_epochs=2, minibatches=3, warmup_steps=4)
    first = core.train_step(groups)
    parameter = next(core.model.parameters())
    assert int(core.optimizer.state[parameter]["step"]) == 6  # 2 epochs x 3 minibatches
    # Linear warm-up over 4 steps: the lr factor is (step + 1) / 4.
    assert first["lr"] == pytest.approx(1e-3 / 4, rel=1e-12)
    assert core.train_step(groups)["lr"] == pytest.approx(1e-3 * 2 / 4, rel=1e-12)
    assert first["tokens_trained"] == float(collate(groups, 0, 0).response_mask.sum())


def test_zero_advantages_give_a_zero_gradient(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    core = make_core(tiny_model_dir)
    before = parameters(core)
    metrics = core.train_step(with_rewards(groups, 1.0))
    assert metrics["zero_variance_group_fraction"] == 1.0
    assert metrics["grad_norm"] == 0.0
    # AdamW with a zero gradient and weight decay 0 moves nothing.
    assert same_parameters(core, before) and core.version == 1


def test_every_registered_estimator_runs_a_step(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    assert set(ESTIMATORS) == {"token", "sequence", "geometric", "kalman", "cumulative"}
    for name in sorted(ESTIMATORS):
        core = make_core(tiny_model_dir, estimator=name)
        before = parameters(core)
        metrics = core.train_step(groups)
        assert metrics.keys() >= METRICS, name
        assert all(math.isfinite(v) for v in metrics.values()), (name, metrics)
        assert metrics["grad_norm"] > 0 and not same_parameters(core, before), name


def test_proximal_reference_ratios_start_at_one_and_weight_by_the_behaviour_policy(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    behaviour = make_core(tiny_model_dir, estimator="token", reference="behaviour", lr=1e-2)
    proximal = make_core(tiny_model_dir, estimator="token", reference="proximal", lr=1e-2)
    for core in (behaviour, proximal):
        core.train_step(groups)
    # Second step on the now stale batch, one minibatch: against the proximal policy the
    # ratios start at 1, and the staleness moves into the weights pi_prox / pi_behaviour.
    stale_behaviour = behaviour.train_step(groups)
    stale_proximal = proximal.train_step(groups)
    assert not BEHAVIOUR_WEIGHT_METRICS & stale_behaviour.keys()
    assert stale_proximal.keys() >= BEHAVIOUR_WEIGHT_METRICS
    assert abs(stale_proximal["ratio_max"] - 1) < 1e-4
    assert abs(stale_proximal["ratio_min"] - 1) < 1e-4
    assert stale_proximal["behaviour_weight_max"] > 1.01
    assert stale_behaviour["ratio_max"] > 1.01  # same weights, so the same staleness


@pytest.mark.parametrize("reference", ["behaviour", "proximal"])
def test_a_nan_behaviour_logprob_is_masked_and_counted(
    tiny_model_dir: Path, groups: list[ScoredGroup], reference: str
) -> None:
    core = make_core(tiny_model_dir, reference=reference, ppo_epochs=2)
    before = parameters(core)
    metrics = core.train_step(with_behaviour_logprob(groups, math.nan))
    assert metrics["nonfinite_tokens"] == 1.0  # per pass over the batch, not times 2 epochs
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert not same_parameters(core, before) and all_finite(core)


def test_nonfinite_raise_fails_the_step_before_any_update(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    core = make_core(tiny_model_dir, nonfinite="raise")
    before = parameters(core)
    with pytest.raises(NonFiniteInputError):
        core.train_step(with_behaviour_logprob(groups, math.inf))
    assert same_parameters(core, before) and core.version == 0


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_a_nonfinite_gradient_skips_the_update(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    core = make_core(tiny_model_dir)
    with torch.no_grad():
        # Finite, but the final norm's output overflows: logits and log-probs become NaN, the
        # loss masks every token (finite, 0), and the backward pass brings NaN gradients.
        core.model.policy.model.norm.weight.fill_(3e38)
    before = parameters(core)
    metrics = core.train_step(groups)
    assert metrics["skipped_minibatches"] == 1.0
    assert metrics["nonfinite_tokens"] == metrics["tokens_trained"]
    assert "grad_norm" not in metrics  # no finite norm to report
    assert same_parameters(core, before) and all_finite(core) and core.version == 1


def test_an_empty_response_trains_alongside_the_others(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    first = groups[0].responses[0]
    empty = dataclasses.replace(first.response, response_token_ids=[], behaviour_logprobs=[])
    padded = [
        ScoredGroup(groups[0].prompt, [*groups[0].responses, ScoredResponse(empty, 0.0, True)])
    ]
    metrics = make_core(tiny_model_dir).train_step(padded + groups[1:])
    assert all(math.isfinite(v) for v in metrics.values()), metrics


def test_repeated_steps_raise_the_logprob_of_the_correct_responses(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    """The default estimator (KPO) with proximal ratios, 5 steps on one fixed batch."""
    core = make_core(tiny_model_dir, reference="proximal")
    batch = collate(groups, core.pad_id, 0)

    def mean_sequence_logp() -> tuple[float, float]:
        with torch.no_grad():
            logp, _ = response_logprobs(core.model, batch, 1.0, with_entropy=False)
        total = logp.sum(-1)
        return float(total[batch.correct].mean()), float(total[~batch.correct].mean())

    correct_before, wrong_before = mean_sequence_logp()
    for _ in range(5):
        core.train_step(groups)
    correct_after, wrong_after = mean_sequence_logp()
    # Measured: correct -18.8 -> -7.0 nats, wrong -26.1 -> -41.2.
    assert correct_after > correct_before + 5.0
    assert wrong_after < wrong_before - 5.0


def test_without_clipping_the_same_gradient_norm_is_reported(
    tiny_model_dir: Path, groups: list[ScoredGroup]
) -> None:
    clipped = make_core(tiny_model_dir, max_grad_norm=0.5).train_step(groups)
    unclipped = make_core(tiny_model_dir, max_grad_norm=None).train_step(groups)
    # The norm is taken before clipping, on the same first-step gradient.
    assert clipped["grad_norm"] > 0.5
    assert unclipped["grad_norm"] == pytest.approx(clipped["grad_norm"], rel=1e-6)


def test_a_zero_temperature_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="temperature must be > 0"):
        LearnerCore(tiny_model_dir, LearnerConfig(), AlgorithmConfig(), temperature=0.0)


RATIO_KEYS = {
    "log_ratio",
    "mask",
    "row",
    "staleness",
    "advantage",
    "minibatch",
    "version",
    "token_versions",
}


def recording_core(model_dir: Path, ratio_dir: Path, **learner: object) -> LearnerCore:
    """The default (KPO) learner, lr 1e-3, saving log-ratios under `ratio_dir`."""
    config = LearnerConfig.model_validate({"lr": 1e-3, **learner})
    return LearnerCore(
        model_dir,
        config,
        AlgorithmConfig(),
        temperature=1.0,
        ratio_dir=ratio_dir,
        response_length=MAX_NEW_TOKENS,
    )


def check_ratio_record(record: dict[str, torch.Tensor], groups: list[ScoredGroup]) -> None:
    """Keys, shapes and masking of one saved file, against the batch it was taken on."""
    assert record.keys() == RATIO_KEYS
    batch = collate(groups, 0, 0)
    rows, width = batch.response_mask.shape
    log_ratio, mask = record["log_ratio"], record["mask"]
    assert log_ratio.shape == mask.shape == (rows, width)
    for key in ("row", "staleness", "advantage", "minibatch"):
        assert record[key].shape == (rows,)
    assert mask.dtype == torch.bool and log_ratio.dtype == torch.float32
    assert bool(torch.isfinite(log_ratio).all())
    assert bool((log_ratio[~mask] == 0).all())
    # Every row once (first epoch), in minibatch order, traceable to the batch by its index.
    assert sorted(record["row"].tolist()) == list(range(rows))
    assert torch.equal(mask, batch.response_mask[record["row"]])
    versions = batch.token_versions[record["row"]]
    assert torch.equal(record["token_versions"][mask], versions[mask])
    # The first response of each group is the rewarded one: a positive advantage.
    first = record["row"] % 4 == 0
    assert bool((record["advantage"][first] > 0).all())
    assert bool((record["advantage"][~first] < 0).all())


def test_record_ratios_every_two_saves_steps_two_and_four(
    tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    core = recording_core(tiny_model_dir, tmp_path, record_ratios_every=2, minibatches=2)
    for _ in range(4):
        core.train_step(groups)
    saved = sorted(tmp_path.iterdir())
    assert len(saved) == 2
    records = [torch.load(path) for path in saved]
    for record, started_from in zip(records, (1, 3), strict=True):
        check_ratio_record(record, groups)
        # Two minibatches of the 12 rows, in order: 6 rows each.
        assert record["minibatch"].tolist() == [0] * 6 + [1] * 6
        # The groups were sampled by version 0: staleness is the version the step started from.
        assert record["staleness"].tolist() == [started_from] * 12
    # Steps 2 and 4 started from versions 1 and 3 (ratio_file's doc and naming).
    assert [int(record["version"]) for record in records] == [1, 3]
    assert saved == [ratio_file(tmp_path, 1), ratio_file(tmp_path, 3)]


def test_saved_on_policy_log_ratios_are_zero_once_per_row(
    tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    core = recording_core(tiny_model_dir, tmp_path, record_ratios_every=1, ppo_epochs=2)
    core.train_step(groups)
    saved = sorted(tmp_path.iterdir())
    assert len(saved) == 1
    record = torch.load(saved[0])
    check_ratio_record(record, groups)  # 12 rows, not 24: the second epoch is not saved
    mask = record["mask"]
    assert bool(mask.any())
    # The weights that sampled the batch: log(pi / pi_behaviour) = 0 up to float32 rounding.
    assert float(record["log_ratio"][mask].abs().max()) < 1e-4
    assert record["staleness"].tolist() == [0] * 12
    assert record["minibatch"].tolist() == [0] * 12
    assert saved == [ratio_file(tmp_path, 0)] and int(record["version"]) == 0


def test_a_nonfinite_token_is_off_the_saved_mask(
    tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    core = recording_core(tiny_model_dir, tmp_path, record_ratios_every=1)
    core.train_step(with_behaviour_logprob(groups, math.nan))
    (path,) = tmp_path.iterdir()
    record = torch.load(path)
    assert bool(torch.isfinite(record["log_ratio"]).all())
    tokens = int(collate(groups, 0, 0).response_mask.sum())
    assert int(record["mask"].sum()) == tokens - 1


def test_record_ratios_every_zero_writes_nothing(
    tiny_model_dir: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    ratio_dir = tmp_path / "ratios"
    core = recording_core(tiny_model_dir, ratio_dir, record_ratios_every=0)
    for _ in range(2):
        core.train_step(groups)
    assert not ratio_dir.exists()


def test_the_shipped_reference_length_resolves_to_the_response_limit(tiny_model_dir: Path) -> None:
    # `reference_length: auto`, the default, is the run's response limit; a learner built
    # without one is refused rather than left on the paper's 4,096-token constants.
    with pytest.raises(ValueError, match=r"reference_length: auto .* generation\.max_new_tokens"):
        LearnerCore(tiny_model_dir, LearnerConfig(), AlgorithmConfig(), temperature=1.0)
    core = make_core(tiny_model_dir)
    estimator = core.algorithm.estimator
    assert estimator.name == "kalman" and estimator.reference_length == MAX_NEW_TOKENS
    assert estimator.effective_q == pytest.approx(1e-6 * (4096 / MAX_NEW_TOKENS) ** 2)
    # Another estimator, or an explicit length, needs none.
    token = AlgorithmConfig.model_validate({"estimator": {"name": "token"}})
    assert LearnerCore(tiny_model_dir, LearnerConfig(), token, 1.0).algorithm == token
