"""A tiny model that really calls the Python tool: trained for a few seconds on CPU.

The character-level test model cannot spell code, so the multi-turn tests use the built-in
tasks' byte-level tokenizer (any ASCII text) and a small random Qwen2 fitted by plain gradient
steps to a handful of two-turn transcripts: after prompt P_i it writes call C_i, the tool's
observation follows (built by the engine's own `ObservationEncoder`, so the layout the model saw
in training is the one generation appends), then it writes the answer and EOS. Observation
tokens carry no loss, as in RL. The fitted model is a real model producing real calls: the
engine decodes them from its logits like any other text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from services.messages import ChatMessage
from services.tasks.tokenizer import build_tokenizer, save_tokenizer
from services.tools.rollout import ObservationEncoder

FENCED_CALL = "```python\nprint(6*7)\n```"
HERMES_CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
OUTPUT = "42"  # what print(6*7) prints, trailing newline stripped as observations are
ANSWER = " so it is 42."


@dataclass(frozen=True)
class Transcript:
    """One training example: a prompt (text, or chat messages), its call, how it is observed."""

    prompt: str
    call: str
    messages: tuple[ChatMessage, ...] = ()

    @property
    def chat(self) -> bool:
        return bool(self.messages)


PLAIN = Transcript("Q: 6*7?\n", "Let me compute. " + FENCED_CALL)
CHAT = Transcript("6*7?", "Computing: " + FENCED_CALL, ({"role": "user", "content": "6*7?"},))
HERMES = Transcript("H: 6*7?\n", "I call the tool. " + HERMES_CALL)
TRANSCRIPTS = (PLAIN, CHAT, HERMES)


def prompt_ids(tokenizer: PreTrainedTokenizerFast, transcript: Transcript) -> list[int]:
    if transcript.chat:
        rendered = tokenizer.apply_chat_template(
            list(transcript.messages), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return [int(t) for t in rendered["input_ids"]]
    return [int(t) for t in tokenizer(transcript.prompt)["input_ids"]]


def training_row(
    tokenizer: PreTrainedTokenizerFast, transcript: Transcript
) -> tuple[list[int], list[bool]]:
    """Token ids of prompt + response, and per id whether it carries loss (model tokens)."""
    encoder = ObservationEncoder(tokenizer, declare_tools=False)
    prompt = prompt_ids(tokenizer, transcript)
    call = tokenizer(transcript.call, add_special_tokens=False)["input_ids"]
    observation = encoder.encode(OUTPUT, chat=transcript.chat)
    answer = tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = [*prompt, *call, *observation, *answer]
    loss = [False] * len(prompt) + [True] * len(call) + [False] * len(observation)
    return ids, loss + [True] * len(answer)


def save_tool_model(directory: Path, steps: int = 400, seed: int = 0) -> Path:
    """Fit a random tiny Qwen2 to the transcripts; save it with its tokenizer to `directory`."""
    tokenizer = build_tokenizer()
    save_tokenizer(tokenizer, directory)  # adds the chat template
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    rows = [training_row(tokenizer, t) for t in TRANSCRIPTS]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), int(tokenizer.pad_token_id))
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, (ids, loss) in enumerate(rows):
        input_ids[index, : len(ids)] = torch.tensor(ids)
        mask[index, : len(ids)] = 1
        labels[index, : len(ids)] = torch.where(torch.tensor(loss), torch.tensor(ids), -100)
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if loss.item() < 2e-4:
            break
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    return directory
