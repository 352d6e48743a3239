"""An estimator config from a framework's settings plus the user's estimator options."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kpo_core.config import EstimatorConfig, describe_validation_error
from kpo_core.ratios import get_estimator


def framework_estimator_config(
    estimator: str,
    options: Mapping[str, Any],
    framework_values: Mapping[str, tuple[str, Any]],
    options_name: str,
) -> EstimatorConfig:
    """The config of `estimator` from `options` and the framework's own settings.

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
    try:
        return get_estimator(estimator).make_config(**values)
    except ValidationError as error:
        settings = {option: setting for option, (setting, _) in framework_values.items()}
        raise ValueError(describe_validation_error(error, options_name, settings)) from None
