"""The `exact` verifier's answer extraction and normalisation, checked in-process."""

from __future__ import annotations

from decimal import Decimal

import pytest

from services.reward.exact_match import ExactConfig, check_exact, normalise_answer

CONFIG = ExactConfig()


@pytest.mark.parametrize(
    ("text", "reference", "correct"),
    [
        ("20 + 3 = 23\n#### 23", "23", True),
        ("#### 23   \n\n", " 23\n", True),
        ("####23", "23", True),
        ("#### +23", "23", True),
        ("#### 023", "23", True),
        ("#### 23.0", "23", True),
        ("#### 23.", "23", True),
        ("#### 23", "23.00", True),
        ("#### 23.5", "23", False),
        ("#### 24", "23", False),
        ("#### -7", "-7", True),
        ("#### 7", "-7", False),
        ("#### -7", "7", False),
        ("#### -0", "0", True),
        ("#### 1,234", "1234", True),
        ("#### 1,23", "123", False),  # not thousands groups: compared as the string "1,23"
        ("#### 1e3", "1000", False),  # exponents are not plain numbers
        ("#### 23 apples", "23", False),  # everything after the marker is the answer
        ("#### yes", "yes", True),
        ("#### Yes", "yes", False),
        ("#### 12\nno, let me redo it\n#### 23", "23", True),  # the last marker wins
        ("#### 23\nno, let me redo it\n#### 12", "23", False),
        ("7+12=19;19+4=23;####23<eos>", "23", True),  # the built-in arithmetic task's form
        ("#### 23</s>", "23", True),
        ("#### 23 <|im_end|>\n</s>", "23", True),
    ],
)
def test_answer_after_last_marker(text: str, reference: str, correct: bool) -> None:
    verdict = check_exact(text, reference, CONFIG)
    assert verdict.correct is correct
    assert verdict.well_formed is True


@pytest.mark.parametrize(
    "text",
    ["the answer is 23", "", "### 23", "####", "####   \n", "#### </s>"],
)
def test_missing_or_empty_answer_is_wrong_and_malformed(text: str) -> None:
    verdict = check_exact(text, "23", CONFIG)
    assert (verdict.correct, verdict.well_formed) == (False, False)


def test_custom_marker_and_eos() -> None:
    config = ExactConfig(marker="ANSWER:", eos_strings=("<eos>",))
    assert check_exact("work... ANSWER: 42<eos>", "42", config).correct
    # The default marker means nothing now, and the default EOS strings are not stripped.
    assert not check_exact("#### 42", "42", config).well_formed
    assert not check_exact("ANSWER: 42</s>", "42", config).correct


def test_normalise_answer_types() -> None:
    assert normalise_answer(" +023.0 ") == Decimal(23)
    assert normalise_answer("-1,000") == Decimal(-1000)
    assert normalise_answer(" x = 3 ") == "x = 3"
