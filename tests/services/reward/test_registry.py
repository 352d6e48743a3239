"""Verifier registry: names, config validation, registration of extra verifiers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.reward.base import Verdict, VerifierConfig
from services.reward.exact_match import ExactConfig, check_exact
from services.reward.math_equiv import MathConfig
from services.reward.registry import build_verifier, register_verifier, verifier_names
from tests.services.reward.pathological import PATHOLOGICAL, misbehave


def test_builtin_names() -> None:
    assert {"exact", "math"} <= set(verifier_names())


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown verifier 'nope'") as info:
        build_verifier("nope")
    for name in ("exact", "math", PATHOLOGICAL):
        assert name in str(info.value)


def test_config_is_validated_by_the_verifier_class() -> None:
    exact = build_verifier("exact", {"marker": "ANSWER:", "timeout_s": 0.5})
    assert isinstance(exact.config, ExactConfig)
    assert (exact.config.marker, exact.config.timeout_s) == ("ANSWER:", 0.5)
    assert isinstance(build_verifier("math").config, MathConfig)
    assert build_verifier("math").config.timeout_s == 2.0
    with pytest.raises(ValidationError, match="marker"):
        build_verifier("math", {"marker": "####"})  # an `exact` option
    with pytest.raises(ValidationError, match="timeout_s"):
        build_verifier("exact", {"timeout_s": 0})
    with pytest.raises(ValidationError, match="format_reward"):
        build_verifier("exact", {"format_reward": 1.0})


def test_config_instance_of_another_verifier_is_revalidated() -> None:
    shared = VerifierConfig(timeout_s=0.25)
    exact = build_verifier("exact", shared)
    assert isinstance(exact.config, ExactConfig)
    assert exact.config.timeout_s == 0.25
    with pytest.raises(ValidationError):
        build_verifier("math", ExactConfig(marker="ANSWER:"))


def test_verifier_call_checks_and_compares_by_value() -> None:
    verifier = build_verifier("exact")
    assert verifier("#### 5", "5") == Verdict(correct=True, well_formed=True)
    assert verifier == build_verifier("exact", {})
    assert verifier != build_verifier("exact", {"timeout_s": 1.0})
    with pytest.raises(TypeError, match="expected Verdict"):
        build_verifier(PATHOLOGICAL)("not-a-verdict", "5")


def test_register_rejects_a_taken_name() -> None:
    with pytest.raises(ValueError, match="'exact' is built in"):
        register_verifier("exact", ExactConfig)(check_exact)
    with pytest.raises(ValueError, match="already registered"):
        register_verifier(PATHOLOGICAL)(check_exact)
    # The same function again (its module imported twice) is accepted.
    register_verifier(PATHOLOGICAL, ExactConfig)(misbehave)
    assert build_verifier(PATHOLOGICAL).check is misbehave
    assert build_verifier("exact").check is check_exact
