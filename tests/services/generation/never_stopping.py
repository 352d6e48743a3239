"""A variant of the tiny model that never samples EOS: groups that run until told otherwise.

Streaming and in-flight tests need a response that is certainly still decoding when the test
acts (returns a short group, offers weights). Timing cannot promise that; these weights do: one
hidden dimension j carries a constant 1 through the residual stream (the embeddings write 1 to
it, no layer writes to it), and the EOS row of the head reads only that dimension, with weight
-10^4. After the final RMSNorm that dimension is 1 / rms(x) > 0, so EOS's logit sits about a
thousand below the best token's and its probability is exactly 0 in float32: with these
weights a row ends only at `max_new_tokens`. Loading the tiny model's own weights makes rows
stop again.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

CARRIER_DIM = 0


def save_never_stopping_model(tiny_model_dir: Path, directory: Path) -> Path:
    """Write the tiny model with the EOS-suppressing weights above into `directory`."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    j, eos = CARRIER_DIM, tokenizer.eos_token_id
    with torch.no_grad():
        model.model.embed_tokens.weight[:, j] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[j, :] = 0.0
            layer.mlp.down_proj.weight[j, :] = 0.0
        model.model.norm.weight[j] = 1.0
        model.lm_head.weight[eos, :] = 0.0
        model.lm_head.weight[eos, j] = -1e4
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
