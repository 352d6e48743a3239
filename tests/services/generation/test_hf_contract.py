"""The backend contract suite, run against the `hf` backend on the tiny model."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.generation.base import SamplingSettings
from services.generation.hf_backend import HFBackend
from services.messages import Prompt
from tests.services.generation.contract import CHECKS, ContractSubject

TINY_PROMPTS = [
    Prompt("p0", "1+2=", "3"),
    Prompt("p1", "12+34=", "46"),
    Prompt("p2", "7", ""),
    Prompt("p3", "99-3=;# 5", ""),
]


def hf_subject(backend: HFBackend) -> ContractSubject:
    """The tiny model's facts: a random-init model stops about one time in twenty per token."""
    return ContractSubject(
        backend=backend,
        eos_token_ids=frozenset({backend.tokenizer.eos_token_id}),
        decode=lambda ids: backend.tokenizer.decode(list(ids), skip_special_tokens=True),
        prompts=TINY_PROMPTS,
        mixed_finish_sampling=SamplingSettings(max_new_tokens=16, seed=3),
        # The weights it holds: loading them again changes the version, not the outputs.
        weights=lambda: {k: v.clone() for k, v in backend.model.state_dict().items()},
    )


# One factory per backend that runs here; other backends run the same CHECKS from their own files.
SUBJECT_FACTORIES: dict[str, Callable[[HFBackend], ContractSubject]] = {"hf": hf_subject}


@pytest.fixture(params=sorted(SUBJECT_FACTORIES))
def subject(request: pytest.FixtureRequest, hf_backend: HFBackend) -> ContractSubject:
    return SUBJECT_FACTORIES[request.param](hf_backend)


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_contract(check: Callable[[ContractSubject], None], subject: ContractSubject) -> None:
    check(subject)
