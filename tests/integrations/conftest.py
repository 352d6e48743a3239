"""The code blocks of docs/integrations.md, which the tests run as a user would paste them."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


@pytest.fixture(scope="session")
def doc_block() -> Callable[[str, str], str]:
    """doc_block(language, marker): the one code block in that language containing marker."""
    blocks = re.findall(r"^```(\w+)\n(.*?)^```$", DOC.read_text(), flags=re.M | re.S)

    def find(language: str, marker: str) -> str:
        found = [code for lang, code in blocks if lang == language and marker in code]
        assert len(found) == 1, f"{DOC}: expected one {language} block with {marker!r}"
        return found[0]

    return find
