"""Weight updates of the `hf` backend: in place, versioned, and strictly checked."""

from __future__ import annotations

import pytest
import torch

from services.generation.base import SamplingSettings
from services.generation.hf_backend import HFBackend, StateDictMismatchError, check_state_dict
from services.messages import Prompt, Response
from tests.services.generation.tiny_model import build_model, build_tokenizer

PROMPTS = [Prompt("a", "1+2=", ""), Prompt("b", "40-13=", "")]
SAMPLING = SamplingSettings(max_new_tokens=12, seed=21)


def outputs(backend: HFBackend) -> list[tuple[list[int], list[float]]]:
    responses: list[Response] = [r for g in backend.generate(PROMPTS, 4, SAMPLING) for r in g]
    return [(r.response_token_ids, r.behaviour_logprobs) for r in responses]


def perturbed(state_dict: dict[str, torch.Tensor], scale: float = 0.3) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        key: value + scale * torch.randn(value.shape, generator=generator)
        for key, value in state_dict.items()
    }


def test_load_weights_changes_outputs_and_version_in_place(fresh_hf_backend: HFBackend) -> None:
    backend = fresh_hf_backend
    original = {k: v.clone() for k, v in backend.model.state_dict().items()}
    storage = {k: v.data_ptr() for k, v in backend.model.state_dict().items()}
    before = outputs(backend)
    assert backend.policy_version == 0

    backend.load_weights(perturbed(original), version=3)
    assert backend.policy_version == 3
    assert {k: v.data_ptr() for k, v in backend.model.state_dict().items()} == storage
    groups = backend.generate(PROMPTS, 4, SAMPLING)
    assert all(r.policy_version == 3 for g in groups for r in g)
    assert outputs(backend) != before

    # Loading the original weights back restores the original outputs exactly.
    backend.load_weights(original, version=4)
    assert outputs(backend) == before


def test_missing_key_raises_a_clear_error_and_changes_nothing(fresh_hf_backend: HFBackend) -> None:
    backend = fresh_hf_backend
    state_dict = perturbed(backend.model.state_dict())
    del state_dict["lm_head.weight"]
    before = outputs(backend)
    with pytest.raises(StateDictMismatchError, match=r"missing \['lm_head\.weight'\]"):
        backend.load_weights(state_dict, version=1)
    assert backend.policy_version == 0
    assert outputs(backend) == before


def test_unexpected_key_and_wrong_shape_are_named(fresh_hf_backend: HFBackend) -> None:
    state_dict = dict(fresh_hf_backend.model.state_dict())
    state_dict["extra.weight"] = torch.zeros(1)
    with pytest.raises(StateDictMismatchError, match=r"unexpected \['extra\.weight'\]"):
        fresh_hf_backend.load_weights(state_dict, version=1)
    del state_dict["extra.weight"]
    state_dict["model.norm.weight"] = torch.ones(3)
    with pytest.raises(StateDictMismatchError, match=r"model\.norm\.weight: got \(3,\)"):
        fresh_hf_backend.load_weights(state_dict, version=1)


def test_a_tied_alias_may_be_absent() -> None:
    """With tied embeddings, either key of the shared tensor is enough; both absent is not."""
    model = build_model(build_tokenizer())
    model.config.tie_word_embeddings = True
    model.tie_weights()
    state_dict = dict(model.state_dict())
    assert (
        state_dict["lm_head.weight"].data_ptr()
        == state_dict["model.embed_tokens.weight"].data_ptr()
    )
    del state_dict["lm_head.weight"]
    check_state_dict(model, state_dict)
    del state_dict["model.embed_tokens.weight"]
    with pytest.raises(StateDictMismatchError, match="missing"):
        check_state_dict(model, state_dict)
