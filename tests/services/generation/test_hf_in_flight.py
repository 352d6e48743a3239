"""Weights loaded between two steps of the `hf` backend, with responses in flight.

What is compared, per response token, with the version that sampled it (`Response.versions()`):

- tokens of the old version: a plain forward of the old weights over prompt + response;
- tokens of the new version, KV cache kept (the default): the same cache the backend used, i.e.
  the old weights' forward over the prompt and the tokens fed before the swap, then the new
  weights' forward over the rest, continuing that cache. The behaviour log-prob is the one of
  the distribution the new weights sampled from, over old keys and values: this is the bias of
  keeping the cache, and the test also shows it is real (a plain forward of the new weights
  differs), so the comparison can tell the two apart;
- tokens of the new version with `recompute_kv`: a plain forward of the new weights.

A row sampled k tokens before the swap has fed k - 1 of them (the k-th is fed by the first step
after it), so its cache then covers prompt + tokens[:k-1]. Tolerance as in test_hf_logprobs.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.generation.base import GroupRequest, SamplingSettings
from services.generation.hf_backend import HFBackend
from services.messages import Prompt, Response
from services.weights.base import StateDictMismatchError, TensorSpec, WeightsManifest
from services.weights.buckets import plan_buckets
from tests.services.generation.offline_logprobs import kept_cache_logprobs, plain_logprobs

TOLERANCE = 1e-4
REQUESTS = [
    GroupRequest(Prompt("a", "1+2=", ""), 4, SamplingSettings(max_new_tokens=24, seed=5)),
    GroupRequest(Prompt("b", "99-3=;# 5", ""), 3, SamplingSettings(max_new_tokens=24, seed=6)),
]
STEPS_BEFORE_SWAP = 4

StateDict = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def versions(tiny_model_dir: Path) -> tuple[StateDict, StateDict]:
    """Version 0 (the weights on disk) and version 1 (those plus noise)."""
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    generator = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.3 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    return {k: v.clone() for k, v in state.items()}, noisy


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path, versions: tuple[StateDict, StateDict]) -> list[PreTrainedModel]:
    """Reference models holding version 0 and version 1."""
    out: list[PreTrainedModel] = []
    for state in versions:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # in eval mode
        model.load_state_dict(state)
        out.append(model)
    return out


def run_with_swap(backend: HFBackend, load: Callable[[], None]) -> list[Response]:
    """Submit REQUESTS, step STEPS_BEFORE_SWAP times, call `load`, step to the end."""
    backend.submit(REQUESTS)
    groups: list[list[Response]] = []
    for _ in range(STEPS_BEFORE_SWAP):
        groups.extend(backend.step())
    load()
    while backend.in_flight:
        groups.extend(backend.step())
    return [response for group in groups for response in group]


def split(response: Response) -> int:
    """How many leading tokens version 0 sampled (the rest were version 1's)."""
    versions = response.versions()
    assert versions == sorted(versions) and set(versions) <= {0, 1}
    return versions.count(0)


def check_tags(responses: list[Response]) -> list[Response]:
    """Version tags are consistent; return the responses that span both versions."""
    spanning = []
    for response in responses:
        k = split(response)
        assert response.policy_version == (0 if k else 1)
        if 0 < k < len(response.response_token_ids):
            assert response.token_versions == response.versions()
            assert response.version_span == 2
            spanning.append(response)
        else:
            assert response.token_versions == []
    assert len(spanning) >= 3, "the swap should land mid-response for several rows"
    return spanning


def error(actual: list[float], expected: torch.Tensor) -> float:
    return float((torch.tensor(actual) - expected).abs().max()) if len(actual) else 0.0


def test_kept_cache_logprobs_are_those_of_the_weights_and_cache_that_sampled(
    tiny_model_dir: Path, versions: tuple[StateDict, StateDict], models: list[PreTrainedModel]
) -> None:
    backend = HFBackend(tiny_model_dir)
    responses = run_with_swap(backend, lambda: backend.load_weights(versions[1], version=1))
    bias = 0.0
    for response in check_tags(responses):
        k = split(response)
        old_part = response.behaviour_logprobs[:k]
        assert error(old_part, plain_logprobs(models[0], response)[:k]) < TOLERANCE
        new_part = response.behaviour_logprobs[k:]
        assert error(new_part, kept_cache_logprobs(models[0], models[1], response, k)) < TOLERANCE
        bias = max(bias, error(new_part, plain_logprobs(models[1], response)[k:]))
    assert bias > 100 * TOLERANCE, "keeping the old cache should change the new log-probs"


def test_recomputed_cache_logprobs_are_the_new_weights_own(
    tiny_model_dir: Path, versions: tuple[StateDict, StateDict], models: list[PreTrainedModel]
) -> None:
    backend = HFBackend(tiny_model_dir, recompute_kv=True)
    responses = run_with_swap(backend, lambda: backend.load_weights(versions[1], version=1))
    for response in check_tags(responses):
        k = split(response)
        plain = [plain_logprobs(model, response) for model in models]
        assert error(response.behaviour_logprobs[:k], plain[0][:k]) < TOLERANCE
        assert error(response.behaviour_logprobs[k:], plain[1][k:]) < TOLERANCE


def manifest_of(
    state: Mapping[str, torch.Tensor], version: int, bucket_bytes: int
) -> WeightsManifest:
    specs = [TensorSpec(name, tuple(t.shape), "float32") for name, t in state.items()]
    return WeightsManifest(version, plan_buckets(specs, bucket_bytes))


def buckets_of(
    state: Mapping[str, torch.Tensor], manifest: WeightsManifest
) -> Iterator[dict[str, torch.Tensor]]:
    for specs in manifest.buckets:
        yield {spec.name: state[spec.name] for spec in specs}


def test_bucketed_load_between_steps_equals_a_whole_state_dict_load(
    tiny_model_dir: Path, versions: tuple[StateDict, StateDict]
) -> None:
    whole = HFBackend(tiny_model_dir)
    expected = run_with_swap(whole, lambda: whole.load_weights(versions[1], version=1))
    bucketed = HFBackend(tiny_model_dir)
    manifest = manifest_of(versions[1], 1, bucket_bytes=32 * 1024)
    assert len(manifest.buckets) > 3
    got = run_with_swap(
        bucketed,
        lambda: bucketed.load_weight_buckets(buckets_of(versions[1], manifest), manifest),
    )
    assert bucketed.policy_version == 1
    assert [(r.response_token_ids, r.versions()) for r in got] == [
        (r.response_token_ids, r.versions()) for r in expected
    ]


def test_a_mismatched_manifest_changes_nothing_mid_flight(
    tiny_model_dir: Path, versions: tuple[StateDict, StateDict]
) -> None:
    backend = HFBackend(tiny_model_dir)
    wrong = {**versions[1], "model.norm.weight": torch.ones(3)}
    manifest = manifest_of(wrong, 1, bucket_bytes=1 << 20)

    def load() -> None:
        with pytest.raises(StateDictMismatchError, match=r"model\.norm\.weight: got \(3,\)"):
            backend.load_weight_buckets(buckets_of(wrong, manifest), manifest)

    responses = run_with_swap(backend, load)
    assert backend.policy_version == 0
    assert {r.version_span for r in responses} == {1}
    alone = HFBackend(tiny_model_dir)
    reference = run_with_swap(alone, lambda: None)
    key = sorted((r.prompt_id, r.response_token_ids) for r in responses)
    assert key == sorted((r.prompt_id, r.response_token_ids) for r in reference)


def test_a_load_that_fails_midway_stops_generation_until_a_complete_one(
    tiny_model_dir: Path, versions: tuple[StateDict, StateDict]
) -> None:
    backend = HFBackend(tiny_model_dir)
    manifest = manifest_of(versions[1], 1, bucket_bytes=32 * 1024)

    def failing() -> Iterator[dict[str, torch.Tensor]]:
        buckets = buckets_of(versions[1], manifest)
        yield next(buckets)
        raise ConnectionError("bucket 1 lost")

    backend.submit(REQUESTS)
    backend.step()
    with pytest.raises(ConnectionError, match="bucket 1 lost"):
        backend.load_weight_buckets(failing(), manifest)
    with pytest.raises(RuntimeError, match="version 1 were only partly loaded"):
        backend.step()
    backend.load_weight_buckets(buckets_of(versions[1], manifest), manifest)
    while backend.in_flight:
        backend.step()
    assert backend.policy_version == 1
