"""A random-init tiny Qwen2 causal LM with a character-level tokenizer, for generation tests.

It stands in for the project's real tiny model until that exists. Everything is saved with
`save_pretrained` so that backends load it through the normal `from_pretrained` path.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CHARACTERS = "0123456789+-=;# "


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character, `<bos>` prepended to every text."""
    specials = [PAD, BOS, EOS, UNK]
    # Characters are spelled in the byte-level alphabet (a space is "Ġ"; the other characters
    # are printable ASCII and spell themselves) with a byte-level pre-tokenizer and decoder: for
    # model type qwen2, `AutoTokenizer` builds `Qwen2Tokenizer`, which imposes that pipeline, so a
    # tokenizer spelled any other way would tokenize differently once loaded.
    characters = list(CHARACTERS.replace(" ", "Ġ"))
    vocab = {token: index for index, token in enumerate([*specials, *characters])}
    # A BPE model without merges splits every word into its characters.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )


def build_model(
    tokenizer: PreTrainedTokenizerFast, seed: int = 0, tied: bool = False
) -> Qwen2ForCausalLM:
    """Random-init Qwen2: hidden 64, 2 layers, 2 query heads sharing 1 KV head, head_dim 32;
    `tied`: the input embedding is the output head too."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        # Wider than the usual 0.02 so that next-token distributions are far from uniform and
        # top-k / top-p truncation actually removes mass.
        initializer_range=0.2,
        tie_word_embeddings=tied,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def save_tiny_model(directory: Path, seed: int = 0) -> Path:
    """Write tokenizer, config and weights of the tiny model into `directory`; return it."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
