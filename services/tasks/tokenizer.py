"""A character-level tokenizer for the built-in tasks, as a standard `tokenizer.json`.

One token per character over printable ASCII and newline, plus `<pad>`, `<bos>`, `<eos>` and
`<unk>`. It is a real `tokenizers` tokenizer wrapped in `PreTrainedTokenizerFast`, so that
`AutoTokenizer.from_pretrained` (and any serving stack that reads `tokenizer.json`) loads it like
any other model's tokenizer.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Printable ASCII covers the arithmetic alphabet (digits, + - * = ; # ( ) and space) and still
# round-trips plain-text prompts from user JSONL files.
ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer; the same ids on every call."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in ALPHABET:
        vocab[char] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own piece, whitespace included.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins pieces with nothing between them, so decode(encode(s)) == s.
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    # No post-processor: a prompt encodes to the same ids whether or not a backend asks for
    # special tokens, so the trained model sees exactly what every backend sends. BOS is still
    # declared because some tools expect one.
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
        padding_side="left",  # batched generation pads prompts on the left
    )
