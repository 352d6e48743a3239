"""Chat prompts: rendered with the tokenizer's chat template, string prompts made chats by the
task's `chat_template` and `system_prompt`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import services.tasks
from kpo_core.config import DatasetTask
from services.generation.base import encode_prompts
from services.messages import Prompt
from services.pipeline.prompts import PromptStream, chats_strings
from services.tasks.models import has_chat_template

# Qwen2's ChatML, as its tokenizer_config.json carries it (system message optional).
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The built-in tiny model: its character-level tokenizer spells out the template's markup.
TINY_ARITH = Path(services.tasks.__file__).parent / "assets" / "tiny-arith"


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model with ChatML in its tokenizer_config.json."""
    out = tmp_path_factory.mktemp("chat-model") / "model"
    shutil.copytree(TINY_ARITH, out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHATML
    config_file.write_text(json.dumps(config))
    return out


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+30?"}]


def test_a_chat_is_encoded_as_the_tokenizers_own_template_renders_it(chat_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(chat_model_dir))
    chat = Prompt("c", "12+30?", "42", messages=CHAT)
    plain = Prompt("p", "12+30?", "42")
    chat_ids, plain_ids = encode_prompts(tokenizer, [chat, plain])
    expected = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert chat_ids == list(expected["input_ids"])
    assert plain_ids == tokenizer("12+30?")["input_ids"]
    assert len(chat_ids) > len(plain_ids)  # the template's markup is there


def test_a_chat_for_a_tokenizer_without_a_template_is_refused() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_ARITH))
    with pytest.raises(ValueError, match="prompt 'c' is a chat, but the model's tokenizer has no"):
        encode_prompts(tokenizer, [Prompt("c", "x", "1", messages=CHAT)])


def test_templates_are_found_without_loading_the_tokenizer(
    chat_model_dir: Path, tmp_path: Path
) -> None:
    assert has_chat_template(chat_model_dir)
    assert not has_chat_template(TINY_ARITH)
    (tmp_path / "chat_template.jinja").write_text(CHATML)
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
