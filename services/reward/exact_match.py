"""The `exact` verifier: the answer after the last `####` marker, compared after normalisation.

Rules (the built-in arithmetic task and GSM8K-style data use them):

- The final answer is everything after the LAST marker, stripped of surrounding whitespace and of
  trailing EOS strings (`eos_strings`, e.g. `</s>`), which decoders may leave in the text.
  Everything after the marker counts: `#### 23 apples` is the answer `23 apples`.
- No marker, or nothing after it: a wrong answer (reward 0), not a verification failure.
- Numbers compare by exact decimal value: `23`, ` 23 `, `+23`, `023`, `23.0` and `23.` are all
  equal; `-23` is not `23`; `1,234` (comma thousands separators in groups of three) is `1234`.
  Exponents (`1e3`), fractions (`1/2`) and units are not numbers here: use `math` for those.
- Anything that is not a number on both sides compares as a stripped, case-sensitive string.
"""

from __future__ import annotations

import re
from decimal import Decimal

from pydantic import Field

from services.reward.base import Verdict, VerifierConfig
from services.tasks.answers import ANSWER_MARKER

_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_GROUPED_NUMBER = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")


class ExactConfig(VerifierConfig):
    """Options of the `exact` verifier."""

    marker: str = Field(default=ANSWER_MARKER, min_length=1)  # the built-in tasks' convention
    # `<eos>` is the built-in tasks' tokenizer's; the others are common LLM tokenizers'.
    eos_strings: tuple[str, ...] = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>")


def extract_final_answer(text: str, marker: str, eos_strings: tuple[str, ...]) -> str | None:
    """Return the text after the last `marker`, cleaned; None when there is no marker."""
    _, found, answer = text.rpartition(marker)
    if not found:
        return None
    answer = answer.strip()
    # Loop: a decoder may leave several (e.g. `<|im_end|></s>`), with whitespace between.
    stripped = True
    while stripped:
        stripped = False
        for eos in eos_strings:
            if eos and answer.endswith(eos):
                answer = answer[: -len(eos)].rstrip()
                stripped = True
    return answer


def normalise_answer(answer: str) -> Decimal | str:
    """Return the decimal value of a plain number, else the stripped string."""
    answer = answer.strip()
    if _GROUPED_NUMBER.fullmatch(answer):
        answer = answer.replace(",", "")
    if _NUMBER.fullmatch(answer):
        return Decimal(answer)
    return answer


def answers_match(answer: str, reference: str) -> bool:
    """True when both normalise to the same number, or to the same string."""
    got, want = normalise_answer(answer), normalise_answer(reference)
    if isinstance(got, Decimal) and isinstance(want, Decimal):
        return got == want
    # A number never equals a string; two strings compare as they are (already stripped).
    return isinstance(got, str) and isinstance(want, str) and got == want


def check_exact(response_text: str, reference: str, config: ExactConfig) -> Verdict:
    """Score one response: correct when its final answer matches the reference."""
    answer = extract_final_answer(response_text, config.marker, config.eos_strings)
    if not answer:
        return Verdict(correct=False, well_formed=False)
    return Verdict(correct=answers_match(answer, reference), well_formed=True)
