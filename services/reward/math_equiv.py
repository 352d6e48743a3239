"""The `math` verifier: mathematical equivalence of LaTeX / plain answers, by math-verify.

`\\boxed{\\frac{1}{2}}`, `$\\frac{1}{2}$`, `1/2` and `0.5` all match a reference `0.5` (or
`\\frac{1}{2}`). math-verify extracts the answer from the response (boxed first, then other LaTeX,
then plain expressions) and compares it symbolically and numerically with the reference.

A response from which nothing parses (garbage LaTeX, no answer) is a wrong answer, reward 0, not
a failure: math-verify reports it as an empty parse, and a model writing garbage is exactly what
the reward should score low, not what an operator should be alerted about.

math-verify's own timeouts use `signal.alarm`, which only works in a main thread and has a
resolution of whole seconds; they are switched off here (`parsing_timeout=None`,
`timeout_seconds=None`) because every check already runs in a worker process that is killed at
its deadline (`services.reward.pool`). A pathological expression therefore ends as a counted
`timeout`, not as a silent `False` inside math-verify.
"""

from __future__ import annotations

import logging
import re

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from pydantic import Field

from services.reward.base import Verdict, VerifierConfig
from services.tasks.answers import extract_boxed

# A reference that already says where its math is: do not wrap it in `$...$` again.
_DELIMITED = re.compile(r"\$|\\\(|\\\[|\\boxed")


class MathConfig(VerifierConfig):
    """Options of the `math` verifier, passed through to math-verify's `verify`."""

    float_rounding: int = Field(default=6, ge=0)  # decimal places floats are rounded to
    numeric_precision: int = Field(default=15, ge=1)  # significant digits of numeric comparison
    strict: bool = True  # variables matter; sets and tuples differ


class _DropDisabledTimeoutWarning(logging.Filter):
    """Hide math-verify's warning that its timeouts are off: they are off on purpose here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())


def parse_reference(reference: str) -> list[object]:
    """Parse a reference answer, which datasets usually give as bare LaTeX (`\\frac{1}{2}`)."""
    extraction = [LatexExtractionConfig(), ExprExtractionConfig()]
    candidates = [reference] if _DELIMITED.search(reference) else [f"${reference}$", reference]
    for text in candidates:
        gold: list[object] = parse(
            text, extraction_config=extraction, extraction_mode="first_match", parsing_timeout=None
        )
        if gold:
            return gold
    return []


def check_math(response_text: str, reference: str, config: MathConfig) -> Verdict:
    """Score one response: correct when its extracted answer is equivalent to the reference."""
    well_formed = extract_boxed(response_text) is not None
    gold = parse_reference(reference)
    if not gold:
        # A reference that does not parse is a dataset bug, not a wrong answer: fail loudly.
        raise ValueError(f"reference answer does not parse: {reference[:200]!r}")
    predicted = parse(response_text, parsing_timeout=None)
    correct = bool(
        predicted
        and verify(
            gold,
            predicted,
            float_rounding=config.float_rounding,
            numeric_precision=config.numeric_precision,
            strict=config.strict,
            timeout_seconds=None,
        )
    )
    return Verdict(correct=correct, well_formed=well_formed)
