"""Every decoder family is scored as it samples: the learner's padded and packed log-probs and
the `hf` engine's behaviour log-probs, against transformers' own eager forward of each row alone.

The families (`tests/services/model_families.py`) have windows shorter than the rows, rows that
are left- and right-padded in a padded batch, hybrid layer types (a mask per type), chunked
attention, layers without rotary embeddings, soft-capped attention and logits, and attention
sinks. A learner path that hands a family a mask it does not take, or the wrong one, fails here:
before this matrix existed, Llama, Mistral and Phi-3 crashed on both paths and Qwen2 with its
window, Gemma 2 and Gemma 3 were off by up to 2 nats, with no error.

float32 throughout; the reference is one row at a time with no padding and eager attention, so
what differs is only the summation order (measured: at most 7.6e-6 over the matrix).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.generation.base import GroupRequest, SamplingSettings
from services.generation.hf_backend import HFBackend
from services.learner.batch import collate
from services.learner.distributed import RankGroup
from services.learner.host_reads import HostReads
from services.learner.sharding import build_policy
from services.messages import Prompt, Response, ScoredGroup, ScoredResponse
from services.spec import LearnerConfig
from tests.services.learner.ranks import run_ranks
from tests.services.model_families import FAMILIES, WINDOW, save_family_model

TOLERANCE = 1e-5
PAD = 0
# Prompts of 4 and 6 tokens (the first row is left-padded by 2 in a padded batch) and responses
# of 40, 25 and 33 tokens (the shorter ones right-padded): every row is longer than the window.
PROMPT_LENGTHS = (4, 6)
RESPONSE_LENGTHS = ((40, 25), (33,))
# Packed: per row on CPU, within each layer's window; gpt-oss's sinks cannot be packed (refused).
PACKABLE = [name for name in FAMILIES if name != "gpt-oss"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's random model, saved once for the module."""
    return {name: save_family_model(name, tmp_path_factory.mktemp(name)) for name in FAMILIES}


def token_groups(vocab_size: int) -> list[ScoredGroup]:
    """Groups of random tokens (BOS first); their behaviour log-probs are not used here."""
    generator = torch.Generator().manual_seed(1)

    def tokens(count: int) -> list[int]:
        return torch.randint(4, vocab_size, (count,), generator=generator).tolist()

    groups = []
    for index, (prompt_length, lengths) in enumerate(
        zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)
    ):
        prompt = [1, *tokens(prompt_length - 1)]
        responses = [
            ScoredResponse(
                Response(f"p{index}", prompt, tokens(n), [0.0] * n, "length", 0, ""), 1.0, True
            )
            for n in lengths
        ]
        groups.append(ScoredGroup(Prompt(f"p{index}", "", ""), responses))
    return groups


def reference_logprobs(model_dir: Path, responses: list[Response]) -> list[torch.Tensor]:
    """log pi(token) of each response token, from transformers' eager forward of the row alone."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    out = []
    for response in responses:
        ids = response.prompt_token_ids + response.response_token_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        start = len(response.prompt_token_ids) - 1
        targets = torch.tensor(response.response_token_ids)
        positions = torch.arange(start, start + len(targets))
        out.append(logp[positions, targets])
    return out


def unpadded(groups: list[ScoredGroup]) -> list[ScoredGroup]:
    """The second group's response twice: a batch of rows of one length, nothing padded."""
    return [replace(groups[1], responses=groups[1].responses * 2)]


def learner_logprobs(
    group: RankGroup,
    model_dir: Path,
    pack_rows: bool,
    settings: dict[str, Any],
    padding: bool = True,
) -> torch.Tensor:
    """The learner's log-probs [B, T] of the groups' responses, on this rank of `group`."""
    vocab_size = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    learner = LearnerConfig(pack_rows=pack_rows, **settings)
    model = build_policy(str(model_dir), learner, group, torch.device("cpu"))
    assert model.packed == pack_rows
    groups = token_groups(vocab_size)
    batch = collate(groups if padding else unpadded(groups), PAD, learner_version=0)
    with torch.no_grad():
        logp, _ = model(batch, 1.0, with_entropy=False)
    return logp


def learner_error(
    model_dir: Path, pack_rows: bool, world_size: int = 0, padding: bool = True, **settings: Any
) -> float:
    """Max |learner - reference| log-prob over the groups' response tokens (`padding`: the
    rows of `token_groups`, left- and right-padded; else `unpadded`); `world_size`: an FSDP2
    learner of that many ranks (rank 0's), else a single one."""
    vocab_size = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    groups = token_groups(vocab_size)
    responses = [s.response for g in (groups if padding else unpadded(groups)) for s in g.responses]
    expected = reference_logprobs(model_dir, responses)
    if world_size:
        settings = {**settings, "strategy": "fsdp2", "world_size": world_size}
        logp = run_ranks(learner_logprobs, world_size, model_dir, pack_rows, settings)[0]
    else:
        logp = learner_logprobs(RankGroup(), model_dir, pack_rows, settings, padding)
    return max(
        float((logp[row, : len(reference)] - reference).abs().max())
        for row, reference in enumerate(expected)
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_padded_learner_scores_each_family_as_transformers_does(
    family_dirs: dict[str, Path], family: str
) -> None:
    error = learner_error(family_dirs[family], pack_rows=False)
    print(f"{family} padded: max |learner - transformers| {error:.1e}")
    assert error < TOLERANCE


@pytest.mark.parametrize("family", PACKABLE)
def test_the_packed_learner_scores_each_family_as_transformers_does(
    family_dirs: dict[str, Path], family: str
) -> None:
    error = learner_error(family_dirs[family], pack_rows=True)
    print(f"{family} packed: max |learner - transformers| {error:.1e}")
    assert error < TOLERANCE


@pytest.mark.parametrize("family", ["mistral-window", "gemma3"])
def test_compiled_packed_layers_score_each_family_as_transformers_does(
    family_dirs: dict[str, Path], family: str
) -> None:
    """One family of one layer type (a window everywhere) and one hybrid (a mask per type),
    with every decoder layer compiled (`learner.compile`)."""
    torch._dynamo.reset()
    error = learner_error(family_dirs[family], pack_rows=True, compile=True)
    print(f"{family} packed and compiled: max |learner - transformers| {error:.1e}")
    assert error < TOLERANCE


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "mistral-window", "gemma3"])
def test_rows_without_padding_keep_their_family_s_masks(
    family_dirs: dict[str, Path], family: str, attention: str
) -> None:
    """Nothing padded: SDPA's plain causal attention where no window is narrower than the rows,
    the layers' masks where one is; eager attention, which masks only what it is given, always
    gets them (it once got none here, and attended to the future)."""
    error = learner_error(
        family_dirs[family], pack_rows=False, padding=False, attn_implementation=attention
    )
    print(f"{family} unpadded, {attention}: max |learner - transformers| {error:.1e}")
    assert error < TOLERANCE


@pytest.mark.parametrize("family", ["llama", "mistral-window", "gemma2", "gemma3", "llama4"])
def test_the_learner_builds_each_family_s_masks_without_reading_the_device(
    family_dirs: dict[str, Path], family: str
) -> None:
    """Padded, packed, and padded without padding (where the decoder would build its own masks
    if it could, reading the padding mask back to decide whether to skip one): no forward
    reads a device value (`HostReads`; on a GPU each read would stall the host)."""
    model_dir = family_dirs[family]
    vocab_size = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    groups = token_groups(vocab_size)
    for pack_rows in (False, True):
        model = build_policy(
            str(model_dir), LearnerConfig(pack_rows=pack_rows), RankGroup(), torch.device("cpu")
        )
        for rows in (groups, unpadded(groups)):
            batch = collate(rows, PAD, learner_version=0)
            with HostReads() as reads, torch.no_grad():
                model(batch, 1.0, with_entropy=False)
            assert reads.total == 0, (pack_rows, dict(reads.by_name))


@pytest.mark.parametrize(("family", "pack_rows"), [("gemma2", False), ("gemma3", True)])
def test_fsdp2_ranks_score_each_family_as_transformers_does(
    family_dirs: dict[str, Path], family: str, pack_rows: bool
) -> None:
    """Two gloo ranks sharding the decoder layers and the root (embedding, norm, soft-capped
    head): padded with eager attention (Gemma 2), packed with a mask per layer type (Gemma 3)."""
    error = learner_error(family_dirs[family], pack_rows=pack_rows, world_size=2)
    print(f"{family} fsdp2 ({'packed' if pack_rows else 'padded'}): max error {error:.1e}")
    assert error < TOLERANCE


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_hf_engine_samples_each_family_as_transformers_scores_it(
    family_dirs: dict[str, Path], family: str
) -> None:
    """Continuous batching with a group admitted while another decodes (their caches merged,
    ended rows cut out): each token's behaviour log-prob is the reference's."""
    backend = HFBackend(family_dirs[family])
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=30, seed=3)
    first = GroupRequest(Prompt("a", "1+2=", "3"), 3, sampling)
    second = GroupRequest(Prompt("b", "40-13=", "27"), 2, sampling)
    backend.submit([first])
    ended = [group for _ in range(5) for group in backend.step()]
    backend.submit([second])
    while backend.in_flight:
        ended.extend(backend.step())
    responses = [response for group in ended for response in group]
    assert len(responses) == 5
    lengths = [len(r.prompt_token_ids) + len(r.response_token_ids) for r in responses]
    assert max(lengths) > 2 * WINDOW, lengths
    expected = reference_logprobs(family_dirs[family], responses)
    error = max(
        float((torch.tensor(response.behaviour_logprobs) - reference).abs().max())
        for response, reference in zip(responses, expected, strict=True)
    )
    print(f"{family} hf engine: max |behaviour - transformers| {error:.1e}")
    assert error < TOLERANCE
