"""The `math` verifier on LaTeX and plain answers, with the real math-verify, in-process."""

from __future__ import annotations

import pytest

from services.reward.math_equiv import MathConfig, check_math

CONFIG = MathConfig()


@pytest.mark.parametrize(
    ("text", "reference"),
    [
        (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5"),
        (r"\boxed{\frac{1}{2}}", "0.5"),
        (r"so it is $\frac{1}{2}$", "0.5"),
        ("1/2", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{\dfrac12}", "1/2"),
        (r"\boxed{x^2 + 1}", "1 + x^2"),
        (r"\boxed{-3}", "-3"),
        (r"we get \boxed{\sqrt{4}}", "2"),
    ],
)
def test_equivalent_answers_are_correct(text: str, reference: str) -> None:
    assert check_math(text, reference, CONFIG).correct


@pytest.mark.parametrize(
    ("text", "reference"),
    [
        (r"\boxed{3}", "2"),
        (r"\boxed{\frac{1}{3}}", "0.5"),
        (r"\boxed{-3}", "3"),
        (r"\boxed{x^2 - 1}", "x^2 + 1"),
    ],
)
def test_different_answers_are_wrong(text: str, reference: str) -> None:
    assert not check_math(text, reference, CONFIG).correct


@pytest.mark.parametrize(
    "text",
    [r"\boxed{\frac{", r"\boxed{}", r"\left( \right \frac{{{", "", "no idea"],
)
def test_garbage_is_wrong_without_failing(text: str) -> None:
    # Documented choice: an answer that does not parse is wrong (reward 0), not a failure.
    assert not check_math(text, "2", CONFIG).correct


def test_well_formed_means_boxed() -> None:
    assert check_math(r"\boxed{3}", "2", CONFIG).well_formed
    assert not check_math(r"$\frac{1}{2}$", "0.5", CONFIG).well_formed


def test_unparseable_reference_raises() -> None:
    with pytest.raises(ValueError, match="reference answer does not parse"):
        check_math(r"\boxed{1}", "", CONFIG)
