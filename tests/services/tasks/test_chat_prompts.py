"""Chat prompts: rendered with the tokenizer's chat template, string prompts made chats by the
task's `chat_template` and `system_prompt`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import services.tasks
from services.generation.base import encode_prompts
from services.messages import SINGLE_TURN_AGENT, Prompt
from services.pipeline.prompts import PromptStream, chats_strings
from services.spec import DatasetTask
from services.tasks.models import has_chat_template
from services.tasks.tokenizer import CHAT_TEMPLATE

# The built-in tiny model: it ships ChatML, and its character-level tokenizer spells the
# template's markup out.
TINY_ARITH = Path(services.tasks.__file__).parent / "assets" / "tiny-arith"


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+30?"}]


def test_a_chat_is_encoded_as_the_tokenizers_own_template_renders_it() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_ARITH))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    chat = Prompt("c", "12+30?", "42", messages=CHAT)
    plain = Prompt("p", "12+30?", "42")
    chat_ids, plain_ids = encode_prompts(tokenizer, [chat, plain])
    expected = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert chat_ids == list(expected["input_ids"])
    assert plain_ids == tokenizer("12+30?")["input_ids"]
    assert len(chat_ids) > len(plain_ids)  # the template's markup is there


def test_tools_are_declared_to_chats_that_take_them_only() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_ARITH))
    tokenizer.chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}" + CHAT_TEMPLATE
    tools = [{"type": "function", "function": {"name": "python"}}]
    tool_row = Prompt("t", "12+30?", "42", messages=CHAT, meta={"agent_name": "tool_agent"})
    single = Prompt("s", "12+30?", "42", messages=CHAT, meta={"agent_name": SINGLE_TURN_AGENT})
    declared, undeclared = encode_prompts(tokenizer, [tool_row, single], tools)
    assert undeclared == encode_prompts(tokenizer, [single])[0]
    assert declared[: -len(undeclared)] == tokenizer(json.dumps(tools))["input_ids"]


def test_a_chat_for_a_tokenizer_without_a_template_is_refused(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))  # a random model's: none
    with pytest.raises(ValueError, match="prompt 'c' is a chat, but the model's tokenizer has no"):
        encode_prompts(tokenizer, [Prompt("c", "x", "1", messages=CHAT)])


def test_templates_are_found_without_loading_the_tokenizer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert has_chat_template(TINY_ARITH)
    assert not has_chat_template(tiny_model_dir)
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    assert has_chat_template(tmp_path)


def dataset_task(tmp_path: Path, **settings: object) -> DatasetTask:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "7*6?", "answer": "42"}) + "\n")
    return DatasetTask(path=str(path), shuffle=False, **settings)  # type: ignore[arg-type]


def test_string_prompts_become_chats_after_the_system_prompt(tmp_path: Path) -> None:
    task = dataset_task(tmp_path, system_prompt="Answer after ####.")
    (prompt,) = PromptStream(task, seed=0, chat=True).take(1)
    assert prompt.messages == [
        {"role": "system", "content": "Answer after ####."},
        {"role": "user", "content": "7*6?"},
    ]
    (raw,) = PromptStream(task, seed=0).take(1)
    assert raw.messages == [] and raw.text == "7*6?"


@pytest.mark.parametrize(
    ("setting", "has_template", "chats"),
    [
        ("auto", True, True),
        ("auto", False, False),
        ("always", True, True),
        ("never", True, False),
        ("never", False, False),
    ],
)
def test_the_chat_template_setting_decides_for_string_prompts(
    tmp_path: Path, setting: str, has_template: bool, chats: bool
) -> None:
    assert chats_strings(dataset_task(tmp_path, chat_template=setting), has_template) is chats


def test_always_without_a_template_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'always', but the model's tokenizer has no chat"):
        chats_strings(dataset_task(tmp_path, chat_template="always"), False)
