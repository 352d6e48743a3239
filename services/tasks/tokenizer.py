"""A character-level tokenizer for the built-in tasks, as a standard `tokenizer.json`.

One token per byte, and so one per character of the arithmetic alphabet (digits, + - * = ; #
parentheses, space) and of any ASCII text; other UTF-8 text costs one token per byte, so
nothing is ever lost. Plus `<pad>`, `<bos>`, `<eos>` and `<unk>` (never produced, since every
byte has a token; declared for tools that expect one).

It is a byte-level BPE with no merges, laid out exactly as a Qwen2 tokenizer (same normaliser,
pre-tokeniser and decoder). That matters: for a `qwen2` model directory, `AutoTokenizer`
rebuilds a Qwen2 tokenizer from `tokenizer.json`'s vocabulary with Qwen2's own pipeline, so any
other pipeline would encode differently once loaded. Being an ordinary `tokenizers` tokenizer,
it loads the same through `PreTrainedTokenizerFast` and in serving stacks.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
BYTE_OFFSET = len(SPECIAL_TOKENS)  # id of byte b is BYTE_OFFSET + b
# Qwen2's pre-tokenisation pattern. With no merges it only decides where pieces break, never
# what a token is, but it must match for the rebuilt tokenizer to agree on every input.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_alphabet() -> list[str]:
    """The printable character that byte-level BPE uses for each byte 0..255, in byte order."""
    # GPT-2's mapping: printable Latin-1 bytes stand for themselves, the rest are shifted
    # past 255 (space becomes "Ġ", newline "Ċ").
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += list(range(ord("®"), ord("ÿ") + 1))
    chars: dict[int, str] = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return [chars[b] for b in range(256)]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the tokenizer; the same ids on every call."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in byte_alphabet():
        vocab[char] = len(vocab)
    core = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[],
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    # No post-processor: a prompt encodes to the same ids whether or not a backend asks for
    # special tokens, so the trained model sees exactly what every backend sends. BOS is still
    # declared because some tools expect one.
    # transformers leaves this constructor unannotated.
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )


# ChatML, as Qwen2's tokenizers carry it: chat prompts of the tests and of dataset tasks render
# through it. The built-in task's prompts are strings, never chats, so the model's arithmetic (it
# was warm-started on bare prompts) is unaffected.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Save as `tokenizer.json` + `tokenizer_config.json` (with the ChatML chat template),
    loadable by `AutoTokenizer`."""
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # The class a qwen2 model's tokenizer is loaded as anyway; naming it keeps older releases,
    # which would otherwise pick a generic class, on the same path.
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
