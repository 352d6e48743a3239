"""The character-level tokenizer, in memory and as loaded back from the committed model."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from services.tasks import arith
from services.tasks.tiny_model import DEFAULT_MODEL_DIR
from services.tasks.tokenizer import BYTE_OFFSET, SPECIAL_TOKENS, build_tokenizer


def samples() -> list[str]:
    rng = random.Random(0)
    prompts = arith.generate_prompts(20, seed=0, difficulty=5)
    found = [p.text for p in prompts] + [arith.reference_solution(p) for p in prompts]
    found += ["", " ", "   x  ", "a\r\nb\tc\n", "what's 3 + 4?", "héllo ✓ 你好", "<eos> as text"]
    found += ["".join(chr(rng.randrange(32, 127)) for _ in range(60)) for _ in range(50)]
    return found


@pytest.fixture(scope="module")
def built() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def loaded() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def test_one_token_per_ascii_character(built: PreTrainedTokenizerFast) -> None:
    text = "  19-5+9;    14+9;      23;####23"
    ids = built(text, add_special_tokens=False)["input_ids"]
    assert ids == [BYTE_OFFSET + ord(c) for c in text]


def test_round_trip(built: PreTrainedTokenizerFast) -> None:
    for text in samples():
        if "<eos>" in text:
            continue  # the literal spelling of a special token encodes to that token
        ids = built(text)["input_ids"]
        assert built.decode(ids) == text


def test_no_special_tokens_added(built: PreTrainedTokenizerFast) -> None:
    # Backends that do and do not ask for special tokens must send the model the same ids.
    assert built("7+1=")["input_ids"] == built("7+1=", add_special_tokens=False)["input_ids"]


def test_special_tokens(loaded: PreTrainedTokenizerBase) -> None:
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token) == SPECIAL_TOKENS[:3]
    assert len({loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id}) == 3
    ids = loaded("7+1=")["input_ids"] + [loaded.eos_token_id]
    assert loaded.decode(ids, skip_special_tokens=True) == "7+1="


def test_loaded_tokenizer_matches_built(
    built: PreTrainedTokenizerFast, loaded: PreTrainedTokenizerBase
) -> None:
    # AutoTokenizer rebuilds a qwen2 model's tokenizer with Qwen2's own pipeline; the ids it
    # gives must be the ones the model was trained on, for every kind of input.
    assert len(loaded) == len(built)
    for text in samples():
        ids = built(text, add_special_tokens=False)["input_ids"]
        assert loaded(text)["input_ids"] == ids, text
        assert loaded.decode(ids) == built.decode(ids)
