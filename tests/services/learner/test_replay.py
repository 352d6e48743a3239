"""Truncated-sampling replay end to end: the `hf` sampler records each token's kept set, the
batch carries them ([B, T, K], -1 padded), and the learner takes its log-probs over them.

With the weights that sampled, the learner's replayed log-prob of every sampled token equals
the sampler's behaviour log-prob to 1e-5 in float32 (measured: at most 5e-6 here), for top-k,
top-p, min-p and all three at once, so every on-policy ratio is 1; unreplayed, the ratio is the
kept mass S of the full softmax instead (below 1). A token whose set was over the limit is
dropped from the loss and counted, never trained on a wrong set.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kpo_core.config import AlgorithmConfig
from services.generation.base import SamplingSettings
from services.generation.hf_backend import HFBackend
from services.learner.batch import TrainingBatch, collate
from services.learner.distributed import RankGroup
from services.learner.logprobs import ResponseLogProbs, response_logprobs
from services.learner.metrics import replay_metric_tensors
from services.learner.packed_attention import register_learner_attention
from services.learner.step import LearnerCore, ratio_file
from services.messages import Response, ScoredGroup, ScoredResponse
from services.spec import LearnerConfig
from tests.services.learner.conftest import GROUP_SIZE, MAX_NEW_TOKENS, PROMPTS, make_core
from tests.services.learner.ranks import run_ranks

TOLERANCE = 1e-5
PAD = 0
SETTINGS = {
    "top_k": SamplingSettings(temperature=0.7, top_k=5, seed=31),
    "top_p": SamplingSettings(temperature=1.3, top_p=0.8, seed=32),
    "min_p": SamplingSettings(temperature=1.0, min_p=0.1, seed=33),
    "all": SamplingSettings(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05, seed=34),
}


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> HFBackend:
    return HFBackend(tiny_model_dir)


def replayed_groups(
    backend: HFBackend, sampling: SamplingSettings, max_kept: int = 64
) -> list[ScoredGroup]:
    """Groups sampled with kept sets recorded; the first response of each rewarded 1."""
    sampling = replace(sampling, max_new_tokens=MAX_NEW_TOKENS, replay_max_kept=max_kept)
    groups = backend.generate(PROMPTS, GROUP_SIZE, sampling)
    return [
        ScoredGroup(p, [ScoredResponse(r, float(i == 0), verified=True) for i, r in enumerate(g)])
        for p, g in zip(PROMPTS, groups, strict=True)
    ]


def policy(model_dir: Path, packed: bool = False) -> ResponseLogProbs:
    """The learner's log-prob model, with vocabulary blocks of 7: kept sets straddle them."""
    extra = {"attn_implementation": register_learner_attention()} if packed else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, **extra)
    return ResponseLogProbs(model, chunk_tokens=16, vocab_chunk=7, packed=packed)


def kept_mass(backend: HFBackend, batch: TrainingBatch, temperature: float) -> torch.Tensor:
    """[B, T] S: the full softmax's mass on each token's kept set, from one plain forward per
    row (no batching, no cache, no replay code); 1 off the mask."""
    mass = torch.ones(batch.response_mask.shape)
    assert batch.kept is not None
    for row in range(batch.num_rows):
        start = batch.prompt_width - batch.prompt_lengths[row]
        end = batch.prompt_width + batch.response_lengths[row]
        with torch.no_grad():
            logits = backend.model(input_ids=batch.input_ids[row : row + 1, start:end]).logits[0]
        probs = (logits[batch.prompt_lengths[row] - 1 : -1].float() / temperature).softmax(-1)
        kept = batch.kept[row, : batch.response_lengths[row]]
        # One-hot over [padding, vocabulary]: the padding (-1) lands in the dropped column.
        inside = torch.nn.functional.one_hot(kept + 1, probs.shape[-1] + 1).any(-2)[..., 1:]
        mass[row, : batch.response_lengths[row]] = (probs * inside).sum(-1)
    return torch.where(batch.response_mask, mass, 1.0)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_replayed_log_probs_are_the_behaviour_log_probs(
    tiny_model_dir: Path, backend: HFBackend, name: str
) -> None:
    sampling = SETTINGS[name]
    batch = collate(replayed_groups(backend, sampling), PAD, learner_version=0)
    assert batch.kept is not None and batch.kept.dtype == torch.long
    mask = batch.response_mask
    with torch.no_grad():
        replayed, _ = response_logprobs(policy(tiny_model_dir), batch, sampling.temperature, False)
        full, _ = response_logprobs(
            policy(tiny_model_dir), replace(batch, kept=None), sampling.temperature, False
        )
    error = float((replayed - batch.behaviour_logp)[mask].abs().max())
    print(f"{name}: max |replayed - behaviour| log-prob {error:.2e}")
    assert error < TOLERANCE
    # Unreplayed, the on-policy ratio is the kept mass S, not 1: below 1 where mass was cut.
    mass = kept_mass(backend, batch, sampling.temperature)
    unreplayed = (full - batch.behaviour_logp).exp()
    torch.testing.assert_close(unreplayed[mask], mass[mask], rtol=0, atol=1e-5)
    assert float(mass[mask].min()) < 0.9


def test_packed_rows_replay_the_same_sets(tiny_model_dir: Path, backend: HFBackend) -> None:
    sampling = SETTINGS["all"]
    batch = collate(replayed_groups(backend, sampling), PAD, learner_version=0)
    with torch.no_grad():
        packed, _ = response_logprobs(
            policy(tiny_model_dir, packed=True), batch, sampling.temperature, False
        )
    error = float((packed - batch.behaviour_logp)[batch.response_mask].abs().max())
    assert error < TOLERANCE


def response(
    tokens: list[int], kept: list[list[int]], observed: list[bool] | None = None
) -> Response:
    return Response(
        "p", [1, 2], tokens, [0.0] * len(tokens), "stop", 0, "",
        observation_mask=observed or [], kept_ids=kept,
    )  # fmt: skip


def scored(*responses: Response) -> list[ScoredGroup]:
    from services.messages import Prompt

    return [ScoredGroup(Prompt("p", "", ""), [ScoredResponse(r, 1.0, True) for r in responses])]


def test_the_batch_carries_the_kept_sets_padded_with_minus_one() -> None:
    batch = collate(
        scored(
            response([5, 6, 7], [[5, 9], [3, 6, 8], []]),  # the last over the limit
            response([4, 4, 4, 4], [[4], [], [4, 7], [4]], [False, True, False, False]),
            response([], []),
        ),
        PAD,
        learner_version=0,
    )
    assert batch.kept is not None and batch.kept.shape == (3, 4, 3)
    assert batch.kept[0].tolist() == [[5, 9, -1], [3, 6, 8], [-1, -1, -1], [-1, -1, -1]]
    assert batch.kept[1].tolist() == [[4, -1, -1], [-1, -1, -1], [4, 7, -1], [4, -1, -1]]
    assert bool((batch.kept[2] == -1).all())
    # Dropped: the model token over the limit, not the observation token nor the padding.
    assert batch.replay_dropped is not None
    assert batch.replay_dropped.nonzero().tolist() == [[0, 2]]
    part = batch.select([1]).cropped()
    assert part.kept is not None and part.kept.tolist() == [batch.kept[1].tolist()]
    assert batch.to("cpu").kept is not None
    # Without kept sets nothing is carried, and nothing is dropped.
    plain = collate(scored(response([5, 6], [])), PAD, learner_version=0)
    assert plain.kept is None and plain.replay_dropped is None
    assert plain.select([0]).cropped().kept is None


def test_kept_sets_recorded_for_some_responses_only_or_of_the_wrong_length_are_refused() -> None:
    with pytest.raises(ValueError, match="replayed whole or not at all"):
        collate(scored(response([5], [[5]]), response([6], [])), PAD, learner_version=0)
    with pytest.raises(ValueError, match="2 response tokens but 1 kept sets"):
        collate(scored(response([5, 6], [[5]])), PAD, learner_version=0)


def test_the_replay_metrics_take_the_sizes_of_the_recorded_sets() -> None:
    sets = [list(range(size)) for size in range(1, 101)]  # sizes 1 .. 100
    batch = collate(
        scored(response([0] * 100, sets), response([0, 0, 0], [[0], [], []])),
        PAD,
        learner_version=0,
    )
    metrics = {key: float(value) for key, value in replay_metric_tensors(batch).items()}
    # 101 recorded sets, sizes 1, 1, 2, .. 100: the nearest rank of 0.99 is the 100th, 99.
    assert metrics == {
        "replay_kept_mean": (5050 + 1) / 101,
        "replay_kept_p99": 99.0,
        "replay_dropped_tokens": 2.0,
    }
    small = collate(scored(response([0, 0], [[0, 1], [0]])), PAD, learner_version=0)
    assert float(replay_metric_tensors(small)["replay_kept_p99"]) == 2.0


def test_a_token_over_the_limit_is_dropped_and_counted_and_the_rest_trains_on_policy(
    tiny_model_dir: Path, backend: HFBackend, tmp_path: Path
) -> None:
    """A step on groups sampled with a limit some sets exceed: those tokens are off the loss's
    mask (the ratio file's) and counted in replay_dropped_tokens, not as non-finite; every other
    token's ratio, against the proximal log-probs recomputed over the sets, and theirs against
    the behaviour log-probs (the decoupled-PPO weights), is 1."""
    sampling = SETTINGS["top_p"]
    full = collate(replayed_groups(backend, sampling), PAD, learner_version=0)
    assert full.kept is not None
    sizes = (full.kept >= 0).sum(-1)[full.response_mask]
    limit = int(sizes.median())
    assert int(sizes.min()) <= limit < int(sizes.max())
    groups = replayed_groups(backend, sampling, max_kept=limit)
    batch = collate(groups, PAD, learner_version=0)
    assert batch.kept is not None and batch.replay_dropped is not None
    dropped = batch.replay_dropped
    assert int(dropped.sum()) == int((sizes > limit).sum()) > 0

    algorithm = AlgorithmConfig.model_validate(
        {"reference": "proximal", "off_policy": {"truncated_sampling": "replay"}}
    )
    core = LearnerCore(
        tiny_model_dir,
        LearnerConfig(lr=1e-3, record_ratios_every=1),
        algorithm,
        temperature=sampling.temperature,
        ratio_dir=tmp_path,
        response_length=MAX_NEW_TOKENS,
    )
    record = core.train_step(groups)

    assert record["replay_dropped_tokens"] == float(dropped.sum())
    assert record["nonfinite_tokens"] == 0.0
    kept_sizes = (batch.kept >= 0).sum(-1)[batch.response_mask & ~dropped].double()
    assert math.isclose(record["replay_kept_mean"], float(kept_sizes.mean()))
    assert record["replay_kept_p99"] <= limit
    assert math.isclose(record["behaviour_weight_mean"], 1.0, abs_tol=1e-5)
    saved = torch.load(ratio_file(tmp_path, 0))
    rows = saved["row"]
    width = saved["mask"].shape[1]
    assert torch.equal(saved["mask"], (batch.response_mask & ~dropped)[rows, :width])
    assert float(saved["log_ratio"][saved["mask"]].abs().max()) < TOLERANCE


@pytest.mark.parametrize("reference", ["behaviour", "proximal"])
def test_the_step_reports_the_on_policy_ratio_one_with_replay_and_the_kept_mass_without(
    tiny_model_dir: Path, backend: HFBackend, tmp_path: Path, reference: str
) -> None:
    """Groups sampled by the learner's own weights (version 0, staleness 0): replayed, the
    step's onpolicy_ratio_mean is 1 with a spread of float rounding; the same groups without
    their sets (truncated_sampling: allow) report the mean kept mass S, below 1."""
    sampling = SETTINGS["top_p"]
    groups = replayed_groups(backend, sampling)
    batch = collate(groups, PAD, learner_version=0)
    unreplayed = [
        ScoredGroup(
            g.prompt,
            [ScoredResponse(replace(s.response, kept_ids=[]), s.reward, True) for s in g.responses],
        )
        for g in groups
    ]
    records = {}
    for mode, given in (("replay", groups), ("allow", unreplayed)):
        algorithm = AlgorithmConfig.model_validate(
            {"reference": reference, "off_policy": {"truncated_sampling": mode}}
        )
        core = LearnerCore(
            tiny_model_dir,
            LearnerConfig(lr=1e-3, minibatches=2),
            algorithm,
            temperature=sampling.temperature,
            ratio_dir=tmp_path / mode,
            response_length=MAX_NEW_TOKENS,
        )
        records[mode] = core.train_step(given)
    replayed = records["replay"]
    assert abs(replayed["onpolicy_ratio_mean"] - 1.0) < TOLERANCE
    assert replayed["onpolicy_ratio_std"] < TOLERANCE
    # With proximal log-probs every row counts; otherwise the first minibatch's (half).
    tokens = int(batch.response_mask.sum())
    if reference == "proximal":
        assert replayed["onpolicy_tokens"] == tokens
    else:
        assert 0 < replayed["onpolicy_tokens"] < tokens
    plain = records["allow"]
    assert plain["onpolicy_tokens"] == replayed["onpolicy_tokens"]
    assert plain["onpolicy_ratio_mean"] < 0.97 and plain["onpolicy_ratio_std"] > 100 * TOLERANCE
    if reference == "proximal":  # every token: the batch's mean kept mass exactly
        mass = kept_mass(backend, batch, sampling.temperature)[batch.response_mask]
        assert math.isclose(plain["onpolicy_ratio_mean"], float(mass.double().mean()), abs_tol=1e-5)


def onpolicy_step(
    group: RankGroup | None, model_dir: Path, groups: list[ScoredGroup], reference: str
) -> dict[str, float]:
    """One step of a learner (one rank of a group of two, or alone) replaying `groups`."""
    core = make_core(
        model_dir,
        reference=reference,
        group=group,
        algorithm={"off_policy": {"truncated_sampling": "replay"}},
        minibatches=2,
    )
    return core.train_step(groups)


@pytest.mark.parametrize("reference", ["behaviour", "proximal"])
def test_two_ranks_report_the_on_policy_ratio_of_one(
    tiny_model_dir: Path, backend: HFBackend, reference: str
) -> None:
    """The ranks' sums add up to one learner's: the same token count, a ratio of 1 (min-p's
    setting: make_core's learners score at temperature 1, as it samples)."""
    groups = replayed_groups(backend, SETTINGS["min_p"])
    alone = onpolicy_step(None, tiny_model_dir, groups, reference)
    two = run_ranks(onpolicy_step, 2, tiny_model_dir, groups, reference)[0]
    assert two["onpolicy_tokens"] == alone["onpolicy_tokens"] > 0
    for record in (alone, two):
        assert abs(record["onpolicy_ratio_mean"] - 1.0) < TOLERANCE
