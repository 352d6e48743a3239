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
