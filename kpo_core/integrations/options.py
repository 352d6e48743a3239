"""An estimator config from a framework's settings plus the user's estimator options."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kpo_core.config import EstimatorConfig, describe_validation_error, resolve_reference_length
from kpo_core.ratios import get_estimator


def framework_estimator_config(
    estimator: str,
    options: Mapping[str, Any],
    framework_values: Mapping[str, tuple[str, Any]],
    options_name: str,
    response_length: tuple[str, int | None],
) -> EstimatorConfig:
    """The config of `estimator` from `options` and the framework's own settings.

    response_length: (the framework setting of its response limit, its value), to which
    KPO's `reference_length: auto` resolves (`resolve_reference_length`), as in a run.

    framework_values: estimator option -> (the framework setting it comes from, its value), e.g.
    clip_low -> ("epsilon", 0.2). The framework owns these: one in `options` is refused. Every
    ValueError names where the bad value was set: the framework setting, or
    `options_name: option`.
    """
    for option, (setting, _) in framework_values.items():
        if option in options:
            raise ValueError(
                f"{options_name}.{option}: the framework's config sets this; use {setting} instead"
            )
    values = {**options, **{option: value for option, (_, value) in framework_values.items()}}
    setting, length = response_length
    try:
        config = get_estimator(estimator).make_config(**values)
        return resolve_reference_length(config, length, setting)
    except ValidationError as error:
        settings = {option: setting for option, (setting, _) in framework_values.items()}
        raise ValueError(describe_validation_error(error, options_name, settings)) from None


# What a framework's run does about truncated training sampling (the service's
# `algorithm.off_policy.truncated_sampling`): `allow` trains against the full softmax anyway,
# `refuse` refuses truncating settings, `replay` would take the learner's log-probs over each
# token's kept set, which needs the set the framework's generation sampled from.
TRUNCATED_SAMPLING_MODES = ("allow", "refuse", "replay")


def check_truncated_sampling(
    mode: str | None, truncating: Mapping[str, Any], mode_setting: str
) -> None:
    """ValueError for a run whose training sampling truncates (`truncating`: the framework
    settings that do, by name, with their values; empty when none does) under `mode` (set at
    `mode_setting`; None: allow, the framework's own behaviour). Neither verl nor TRL passes
    the kept set of each sampled token to its trainer, so `replay` is refused there, naming
    the settings: the trainer's log-probs are over the full softmax, and a ratio taken against
    the truncated behaviour log-probs carries log(kept mass) at every token."""
    if mode is not None and mode not in TRUNCATED_SAMPLING_MODES:
        raise ValueError(f"{mode_setting}={mode!r}: must be one of {TRUNCATED_SAMPLING_MODES}")
    if not truncating or mode in (None, "allow"):
        return
    settings = ", ".join(f"{name}={value!r}" for name, value in truncating.items())
    if mode == "replay":
        raise ValueError(
            f"{mode_setting}='replay': {settings} truncates training sampling, and this "
            "framework's generation does not record the kept set of each sampled token that "
            "replay needs; sample untruncated, or set "
            f"{mode_setting}='allow' (every ratio then carries the log of the kept mass)"
        )
    raise ValueError(
        f"{settings} truncates training sampling, which {mode_setting}='refuse' refuses: the "
        "trainer's log-probs are of the full softmax, so every ratio is biased (below 1 even "
        f"on-policy); sample untruncated, or set {mode_setting}='allow'"
    )
