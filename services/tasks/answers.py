"""The final-answer convention shared by built-in tasks: the answer follows the last `####`."""

from __future__ import annotations

ANSWER_MARKER = "####"


def extract_final_answer(text: str) -> str | None:
    """Return the stripped text after the last `####` in `text`, or None when there is none."""
    head, marker, tail = text.rpartition(ANSWER_MARKER)
    del head
    if not marker:
        return None
    return tail.strip()


def is_correct(response: str, answer: str) -> bool:
    """Whether `response` ends in `####<answer>` (exact match after stripping whitespace)."""
    return extract_final_answer(response) == answer.strip()
