"""The JSONL prompt loader: good files load; every malformed line is named precisely."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.tasks.jsonl import PromptFileError, load_jsonl_prompts

GOOD_LINE = '{"prompt": "1+2=", "answer": "3"}'


def write(tmp_path: Path, content: str | bytes, name: str = "prompts.jsonl") -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def test_good_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"prompt": "1+2=", "answer": "3"}\n'
        "\n"  # blank lines are skipped but still counted
        '{"prompt": "what is 6*7?", "answer": 42, "id": "q-42", "extra": [1]}\n'
        '{"prompt": "x", "answer": " 5 "}',  # no final newline
    )
    prompts = load_jsonl_prompts(path)
    assert [p.text for p in prompts] == ["1+2=", "what is 6*7?", "x"]
    assert [p.answer for p in prompts] == ["3", "42", "5"]
    assert [p.prompt_id for p in prompts] == ["prompts:1", "q-42", "prompts:4"]
    assert prompts[1].meta["source"] == "prompts.jsonl:3"


def test_byte_order_mark_and_crlf(tmp_path: Path) -> None:
    path = write(tmp_path, b"\xef\xbb\xbf" + GOOD_LINE.encode() + b"\r\n" + GOOD_LINE.encode())
    assert len(load_jsonl_prompts(str(path))) == 2


@pytest.mark.parametrize(
    ("bad_line", "key", "fragment"),
    [
        ('{"prompt": "1+2=", "answer": "3"', None, "invalid JSON"),
        ("not json", None, "invalid JSON"),
        ('["1+2=", "3"]', None, "expected a JSON object, got list"),
        ('{"answer": "3"}', "prompt", "missing"),
        ('{"prompt": "1+2="}', "answer", "missing"),
        ('{"prompt": 12, "answer": "3"}', "prompt", "must be a string, got int"),
        ('{"prompt": "1+2=", "answer": [3]}', "answer", "must be a string or integer, got list"),
        ('{"prompt": "1+2=", "answer": true}', "answer", "got bool"),
        ('{"prompt": "1+2=", "answer": 3.5}', "answer", "got float"),
        ('{"prompt": "1+2=", "answer": null}', "answer", "got NoneType"),
        ('{"prompt": "  ", "answer": "3"}', "prompt", "must not be empty"),
        ('{"prompt": "1+2=", "answer": ""}', "answer", "must not be empty"),
        ('{"prompt": "1+2=", "answer": "3", "id": 7}', "id", "non-empty string"),
    ],
)
def test_malformed_line_names_file_line_and_key(
    tmp_path: Path, bad_line: str, key: str | None, fragment: str
) -> None:
    path = write(tmp_path, f"{GOOD_LINE}\n\n{bad_line}\n{GOOD_LINE}\n")
    with pytest.raises(PromptFileError) as info:
        load_jsonl_prompts(path)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.path == path and err.line == 3 and err.key == key
    message = str(err)
    assert message.startswith(f"{path}:3: ")
    assert fragment in message
    if key is not None:
        assert f"key {key!r}" in message


def test_invalid_utf8_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD_LINE.encode() + b"\n" + b'{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(PromptFileError, match=r"prompts\.jsonl:2: not valid UTF-8"):
        load_jsonl_prompts(path)


def test_duplicate_ids(tmp_path: Path) -> None:
    line = '{"prompt": "1+2=", "answer": "3", "id": "a"}'
    path = write(tmp_path, f"{line}\n{GOOD_LINE}\n{line}\n")
    with pytest.raises(PromptFileError, match=r":3: key 'id': duplicate id \(first on line 1\)"):
        load_jsonl_prompts(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path: Path, content: str) -> None:
    path = write(tmp_path, content)
    with pytest.raises(PromptFileError, match="no prompts") as info:
        load_jsonl_prompts(path)
    assert str(path) in str(info.value) and info.value.line is None


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(PromptFileError, match=r"absent\.jsonl: cannot read file"):
        load_jsonl_prompts(path)
