"""Final answers: the `####` convention of the built-in tasks and GSM8K, and the last `\\boxed{...}`
of MATH-style solutions and model outputs (shared by the dataset reader and the verifiers)."""

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


# `\boxed{...}` and `\fbox{...}`, optionally with spaces before the brace, as models and MATH's
# solutions write them.
_BOXED_COMMANDS = ("\\boxed", "\\fbox")


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced;
    None when there is none, or when the last one is never closed.

    `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`; `\\boxed 5` (no braces, as some models write
    it) gives `5`, up to the next whitespace or `$`.
    """
    start = max(text.rfind(command) for command in _BOXED_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOXED_COMMANDS if text.startswith(c, start))
    rest = text[start + len(command) :]
    stripped = rest.lstrip()
    if not stripped.startswith("{"):
        if rest == stripped:  # `\boxedx`: another command, not a box
            return None
        bare = stripped.split(maxsplit=1)[0].split("$", 1)[0] if stripped else ""
        return bare or None
    depth = 0
    for index, char in enumerate(stripped):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return stripped[1:index].strip()
    return None
